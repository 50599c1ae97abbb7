"""A subreaper whose grandchild ties its life to its parent's only after that parent has exited.

``python adopted_child.py HOW``: this process becomes a subreaper (PR_SET_CHILD_SUBREAPER) and starts a
parent, which starts a child and exits at once. The child waits until this process has adopted it,
then ties itself to its parent, and prints ``still running`` if that returns. This process reaps the
child and prints ``exit CODE``. HOW: ``agent`` (a fresh interpreter given DDPRUN_AGENT_PID, as a ddprun
worker is), ``exec`` (a fresh interpreter given nothing) or ``fork`` (os.fork, as a DataLoader worker).
"""

import ctypes
import os
import subprocess
import sys
import time

from ddprun import _util

PR_SET_CHILD_SUBREAPER = 36
STARTER = ("import os, subprocess, sys; subprocess.Popen([sys.executable, *sys.argv[1:], str(os.getpid())], "
           "env={**os.environ, 'DDPRUN_AGENT_PID': str(os.getpid())})")


def child(how: str, parent: int) -> None:
    deadline = time.monotonic() + 10
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    if os.getppid() in (parent, 1):
        print(f"not adopted by the subreaper: parent {os.getppid()}", flush=True)
        os._exit(3)
    if how == "agent":
        from ddprun.worker.bootstrap import die_with_agent

        die_with_agent(os.environ)
    else:
        _util.die_with_parent()
    print("still running", flush=True)
    os._exit(0)


def start(how: str) -> None:
    """Start the parent and wait for its end."""
    if how != "fork":
        subprocess.run([sys.executable, "-c", STARTER, __file__, "child", how], check=True, timeout=30)
        return
    parent = os.fork()
    if parent == 0:
        me = os.getpid()
        if os.fork() == 0:
            child(how, me)
        os._exit(0)
    os.waitpid(parent, 0)


def reap_one() -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            print("exit", os.waitstatus_to_exitcode(status), flush=True)
            return
        time.sleep(0.01)
    raise SystemExit("the child did not end within 20 s")


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2], int(sys.argv[3]))
        os._exit(0)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("PR_SET_CHILD_SUBREAPER failed")
    start(sys.argv[1])
    reap_one()
