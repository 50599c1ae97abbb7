"""A warm worker: ``python -m ddprun.worker SCRIPT ARGS...`` with ``DDPRUN_STANDBY_FD`` set, started by
the agent before its rendezvous, with the very command line its worker will have.

It imports what every worker imports anyway (torch, torch.distributed, ddprun's worker side), and
while no go message has come the modules DDP's first construction imports (about 4 s of CPU here in
all), then blocks on ``DDPRUN_STANDBY_FD``. Once the agent's rendezvous is done, torch's agent
"starts" this rank's worker and ddprun hands it this process instead of a fresh interpreter
(agent/standby.py): the go message carries the exact command line, environment, directory and log
files torch would have given a new process, and the process becomes that worker
(:func:`ddprun.worker.bootstrap.main`). So the imports overlap the agent's own start and rendezvous
instead of following them.

The go message is one JSON object: ``argv`` (what follows ``-m ddprun.worker``), ``env``, ``cwd``,
``stdout`` and ``stderr`` (paths, appended to). End of file without a message (the agent did not use
this process, or died): exit 0 at once. What the imports printed before the go message (a warning
of an incompatible library, say) was captured in a file the agent gave as stdout; it is copied to the
top of the rank's log, where a fresh worker would have printed it.
"""

from __future__ import annotations

import json
import os
import select
import sys

GO_MAX_BYTES = 64 * 1024 * 1024
"""Upper bound of a go message (an environment of a few hundred kB at most in practice)."""


WORKER_IMPORTS = ("torch", "torch.distributed", "ddprun.worker.monitor", "ddprun.worker.channel",
                  "ddprun.worker.pgstore", "ddprun.worker.preflight")
"""What every worker imports before the user's first line (its job channel is a torch TCPStore)."""
WHILE_WAITING = ("torch.nn.parallel", "torch._dynamo", "ddprun.train")
"""What DDP's first construction (and ddprun.fit) imports: only while no go message is there, so that
a standby whose agent has nothing to wait for is not later than a fresh worker by these 2 s of CPU."""


def preimport(go_fd: int) -> None:
    """The imports above; one that fails is left for the worker to meet (Python forgets a failed
    module, so it fails there the same way, with the traceback where a fresh worker prints it)."""
    for names in (WORKER_IMPORTS, WHILE_WAITING):
        if names is WHILE_WAITING and select.select([go_fd], [], [], 0)[0]:
            return  # the go message (or the agent's end) is there: become the worker now
        for name in names:
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - see the docstring: the real worker meets it again
                pass


def read_go(fd: int) -> dict | None:
    """The go message, or None at end of file without one; blocks until the agent writes or exits."""
    chunks, size = [], 0
    while size <= GO_MAX_BYTES:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        chunks.append(data)
        size += len(data)
    os.close(fd)
    if not chunks:
        return None
    return json.loads(b"".join(chunks))


def _become(go: dict) -> list[str]:
    """Take the worker's directory, environment and log files; its argv for the bootstrap."""
    os.chdir(go["cwd"])
    os.environ.clear()
    os.environ.update(go["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    os.lseek(1, 0, os.SEEK_SET)
    early = b""
    while chunk := os.read(1, 1 << 16):  # stdout is the capture file the agent opened for reading too
        early += chunk
    for fd, path in ((1, go["stdout"]), (2, go["stderr"])):
        if path:
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
    if early:
        os.write(1, early)
    return list(go["argv"])


def main(go_fd: int) -> None:
    """Import, wait for the go message, become the worker (module docstring); exit 0 without one."""
    from ddprun.worker.bootstrap import die_with_agent

    die_with_agent(os.environ)
    preimport(go_fd)
    go = read_go(go_fd)
    if go is None:
        os._exit(0)
    argv = _become(go)
    from ddprun.worker.bootstrap import main as worker_main

    worker_main(argv)
