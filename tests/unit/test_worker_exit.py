"""A worker's exit (worker/exit.py): bounded as a whole (the atexit handlers, and the flush of open
files after them, which blocks on a pipe nobody reads); its error file is never seen half-written."""

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

FULL_PIPE = """
import os, sys
from ddprun.worker.exit import hard_exit
r, w = os.pipe()
os.set_blocking(w, False)
try:
    while True:
        os.write(w, b"x" * 4096)  # fill the pipe: nobody reads r
except BlockingIOError:
    pass
os.set_blocking(w, True)
stuck = os.fdopen(w, "wb")
stuck.write(b"unflushed")  # in the buffer: hard_exit's flush of open files blocks on it
print("exiting", flush=True)
hard_exit(0, handlers_s=float(sys.argv[1]))
"""


def test_a_flush_that_blocks_at_exit_is_bounded_and_named(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", FULL_PIPE, "1"], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    took = time.monotonic() - t0
    assert r.stdout == "exiting\n", r.stdout + r.stderr
    assert r.returncode == 1, r.stderr
    assert "ddprun: the flush of an open file (a pipe nobody reads? a hung file system?) did not return within 1 s" \
        in r.stderr, r.stderr
    assert took < 15, took


def test_the_error_file_is_replaced_whole_never_rewritten_in_place(tmp_path, monkeypatch):
    """The monitor thread and the main thread may both write it, and os._exit may end one mid-write:
    torch's agent parses it (a torn file raised inside the agent). A new file is renamed over it."""
    from ddprun.protocol import failure as fr
    from ddprun.worker.exit import write_error_file

    path = tmp_path / "rank-1.error.json"
    path.write_text('{"message": ')  # what a write cut short in place would leave
    before = os.stat(path).st_ino
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    rec = fr.FailureRecord(fr.ERROR, 1, "ValueError: bad batch", 0, "host-a")
    write_error_file("rank 1 failed", record=rec)
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "rank 1 failed" and data["message"]["extraInfo"]["ddprun"]["rank"] == 1
    assert os.stat(path).st_ino != before and [p.name for p in tmp_path.iterdir()] == ["rank-1.error.json"]


HEALTHY = """
import atexit, sys
from ddprun.worker.exit import hard_exit

class Teardown:
    def __del__(self):  # interpreter finalization: where healthy gloo/NCCL workers abort
        print("finalized", flush=True)

keep = Teardown()
out = open(sys.argv[1], "w")
out.write("buffered, never flushed by the script")
atexit.register(print, "handler 1", flush=True)
atexit.register(print, "handler 2", flush=True)
hard_exit(3)
"""


@pytest.mark.parametrize("soft", [False, True], ids=["hard", "DDPRUN_SOFT_EXIT=1"])
def test_a_healthy_exit_runs_atexit_handlers_flushes_files_and_skips_finalization_unless_soft(tmp_path, soft):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), **({"DDPRUN_SOFT_EXIT": "1"} if soft else {})}
    r = subprocess.run([sys.executable, "-c", HEALTHY, str(tmp_path / "out.txt")], capture_output=True, text=True,
                       timeout=30, env=env)
    assert r.returncode == 3, r.stderr
    assert r.stdout.splitlines() == ["handler 2", "handler 1", *(["finalized"] if soft else [])], r.stdout + r.stderr
    assert (tmp_path / "out.txt").read_text() == "buffered, never flushed by the script"


THREADS = """
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from ddprun.worker.exit import hard_exit

def later(name, after_s):
    time.sleep(after_s)
    open(sys.argv[1] + "/" + name, "w").write("done")

threading.Thread(target=later, args=("thread", 0.3)).start()
ThreadPoolExecutor(1).submit(later, "pool", 0.3)  # how torch's dcp.async_save runs by default
def stuck():
    time.sleep(3600)

if sys.argv[2] == "stuck":
    threading.Thread(target=stuck, name="saver").start()
hard_exit(0, handlers_s=float(sys.argv[3]))
"""


def test_the_exit_waits_for_the_threads_the_script_left_running_as_python_does(tmp_path):
    # an async checkpoint's last save on a thread pool: os._exit after the atexit handlers alone cut it
    # short and the rank still exited 0
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    r = subprocess.run([sys.executable, "-c", THREADS, str(tmp_path), "ends", "20"], capture_output=True, text=True,
                       timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool", "thread"]


def test_a_thread_that_never_ends_is_bounded_and_named(tmp_path):
    """The rank's record names the stage and the thread still running (its agent's line would say
    "the process ended without a Python error"), and the stack shown is that thread's, not the main
    thread's wait for it in ddprun's own exit."""
    error_file = tmp_path / "rank-3.error.json"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "TORCHELASTIC_ERROR_FILE": str(error_file),
           "RANK": "3", "GROUP_RANK": "1", "LOCAL_RANK": "1"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", THREADS, str(tmp_path), "stuck", "1"], capture_output=True, text=True,
                       timeout=30, env=env)
    assert r.returncode == 1 and time.monotonic() - t0 < 15, r.stderr
    assert "ddprun: a thread the script left running (a non-daemon thread or a thread pool: an async save?) did not " \
        "return within 1 s; exiting anyway" in r.stderr, r.stderr
    assert "thread 'saver':" in r.stderr and "in stuck" in r.stderr, r.stderr
    assert "hard_exit" not in r.stderr and "_shutdown" not in r.stderr, r.stderr
    rec = json.loads(error_file.read_text())["message"]["extraInfo"]["ddprun"]
    assert (rec["kind"], rec["rank"], rec["node_rank"]) == ("error", 3, 1), rec
    assert rec["summary"] == ("its exit did not end within 1 s (--exit-timeout): a thread the script left running "
                              "(a non-daemon thread or a thread pool: an async save?) did not return; non-daemon "
                              "threads still running: 'saver'"), rec
