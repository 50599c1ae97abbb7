"""Where a rank's DataLoader workers are at a hang report (ddprun/loaderworkers.py): they answer
SIGURG with faulthandler's dump, a process without the answer is never signalled, one that cannot
answer is said with its kernel state, and the report names the worker's own line."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ddprun import loaderworkers
from ddprun.train.data import LoaderWorkerInit
from ddprun.worker.stacks import DATA_LOADING, hang_report

DUMP = """\
Thread 0x00007f71f50136c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f721548db80 (most recent call first):
  File "/data/jobs/mydata.py", line 15 in __getitem__
  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/fetch.py", line 54 in fetch
  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", line 374 in _worker_loop
  File "<string>", line 1 in <module>
"""


def test_the_main_thread_is_the_last_thread_faulthandler_lists_read_outermost_first():
    frames = loaderworkers.main_thread_frames(DUMP)
    assert frames[0] == ("<string>", 1, "<module>")
    assert frames[-1] == ("/data/jobs/mydata.py", 15, "__getitem__")
    assert loaderworkers.main_thread_frames("") == []
    assert loaderworkers.main_thread_frames("Fatal Python error: garbage\n  File nonsense") == []


def test_the_main_thread_is_found_by_its_id_wherever_the_dump_lists_it():
    main_first = DUMP.replace("Current thread 0x00007f721548db80", "Thread 0x00007f72154800aa")
    main_first = "Thread 0x00007f721548db80 (most recent call first):\n  File \"/job/d.py\", line 3 in get\n\n" + main_first
    assert loaderworkers.main_thread_frames(main_first, 0x7F721548DB80) == [("/job/d.py", 3, "get")]
    assert loaderworkers.main_thread_frames(DUMP, 0x1234) == []  # not listed (over 100 threads): no guess
    assert loaderworkers._place(1, 0, 0x1234, DUMP, 1.0)["at"].startswith("at ? (its main thread is not in the dump")


def test_the_users_frame_is_never_the_standard_library():
    """A rank waiting for its DataLoader sits in multiprocessing and selectors: the user's frame is the
    script's loop, not `selectors.py:415 in select`."""
    import selectors

    frames = [("/job/train.py", 40, "main"), (torch.utils.data.__file__, 1291, "_try_get_data"),
              (selectors.__file__, 415, "select")]
    assert loaderworkers.user_frame(frames) == ("/job/train.py", 40, "main")
    assert loaderworkers.user_frame(frames[1:]) is None
    debian = [("/job/train.py", 40, "main"), ("/usr/local/lib/python3.11/dist-packages/torch/utils/data/x.py", 9, "f")]
    assert loaderworkers.user_frame(debian) == ("/job/train.py", 40, "main")
    # a script in a folder named ddprun (a clone of this repository) is the user's; ddprun's own files are not
    clone = [("/home/u/ddprun/train.py", 40, "main"), (loaderworkers.__file__, 9, "f")]
    assert loaderworkers.user_frame(clone) == ("/home/u/ddprun/train.py", 40, "main")


def test_without_memfd_a_worker_does_not_answer_and_nothing_fails(monkeypatch):
    """A Python built against glibc < 2.27 (conda's, uv's) has no os.memfd_create."""
    monkeypatch.delattr(os, "memfd_create")
    assert loaderworkers.answer_requests(0) is False
    assert LoaderWorkerInit((), answer=True)(0) is None
    assert not loaderworkers.catches(os.getpid())


class Blocks(Dataset):
    """Blocks at its third sample in ``threading.Event().wait()``: never set; each sample is the
    worker's parent-death signal (PR_GET_PDEATHSIG)."""

    def __len__(self):
        return 100

    def __getitem__(self, i):
        if i == 2:
            threading.Event().wait()  # line the test names
        return torch.tensor([pdeathsig()])


def pdeathsig() -> int:
    import ctypes

    got = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
    return got.value


def test_a_forked_worker_of_safe_worker_init_is_not_tied_to_the_thread_that_started_it():
    """PR_SET_PDEATHSIG fires when the parent *thread* ends: an iterator made in a prefetch thread
    would lose its workers with that thread. Only a forkserver's workers (its one thread) are tied."""
    loader = DataLoader(Pdeathsig(), batch_size=1, num_workers=1, multiprocessing_context="fork",
                        worker_init_fn=LoaderWorkerInit((), answer=True))
    assert [int(b) for b in loader] == [0, 0]


class Pdeathsig(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor([pdeathsig()])


@pytest.mark.timeout(60)
def test_a_forkserver_worker_of_fit_answers_with_its_id_and_its_line_and_a_stopped_one_with_its_state():
    loader = DataLoader(Blocks(), batch_size=1, num_workers=1, multiprocessing_context="forkserver",
                        worker_init_fn=LoaderWorkerInit((), answer=True), timeout=0, prefetch_factor=4)
    it = iter(loader)
    assert int(next(it)) == signal.SIGKILL  # ends with its parent, the forkserver, which ends with the rank
    next(it)
    time.sleep(0.5)  # the worker is in its third sample by now
    [pid] = loaderworkers.children()
    [place] = loaderworkers.ask([pid, os.getpid()])  # this process catches no SIGURG: not asked
    assert place["worker"] == 0 and place["loader"] is True and place["pid"] == pid, place
    assert place["at"] == f"at test_loader_workers.py:{Blocks.__getitem__.__code__.co_firstlineno + 2} in __getitem__"
    assert "Current thread" in place["stack"] or "Thread 0x" in place["stack"]
    again = loaderworkers.ask([pid])  # a second report reads only its own answer
    assert again[0]["stack"].count("most recent call first") == place["stack"].count("most recent call first")
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        [stopped] = loaderworkers.ask([pid], wait_s=0.3)
        assert time.monotonic() - t0 < 1.5
        assert re.fullmatch(r"did not answer within 0.3 s \(stopped \(T(, wait channel \w+)?\)\)", stopped["silent"]), stopped
        assert stopped["worker"] == 0  # its memfd's name says it
    finally:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
        del it


def test_a_process_that_installed_no_answer_is_not_signalled():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        assert not loaderworkers.catches(child.pid)
        assert loaderworkers.ask([child.pid]) == []
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


BLOCKS = textwrap.dedent("""
    import multiprocessing, os, signal, sys, threading, time
    import torch
    from torch.utils.data import DataLoader
    from ddprun import loaderworkers

    def sample(i):
        if i == 2:
            threading.Event().wait()  # blocked: torch's check of its parent never comes
        return i

    class Blocks(torch.utils.data.Dataset):
        __len__ = lambda self: 100
        __getitem__ = lambda self, i: sample(i)
""")
"""A dataset whose sample 2 blocks a worker for ever (the scripts below start with it)."""

FORKS = BLOCKS + textwrap.dedent("""
    class Starts(torch.utils.data.Dataset):  # loaded in the rank (no workers): starts a process
        __len__ = lambda self: 1
        def __getitem__(self, i):
            import multiprocessing
            p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
            p.start()
            return p.pid

    loaderworkers.serve()
    pid = os.fork()  # a fork of the script's own: left as it is
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    [started] = list(DataLoader(Starts(), num_workers=0))  # a dataset's own process: not a worker
    time.sleep(0.2)
    print("dataset's process answers:", loaderworkers.catches(int(started)), flush=True)
    os.kill(int(started), signal.SIGKILL)
    os.waitpid(int(started), 0)
    multiprocessing.process._children.clear()  # reaped here, not by multiprocessing
    it = iter(DataLoader(Blocks(), num_workers=1))  # fork: torch's default here
    next(it), next(it)
    time.sleep(0.5)
    [worker] = loaderworkers.children()
    print(loaderworkers.catches(pid), loaderworkers.catches(worker), flush=True)
    [place] = loaderworkers.ask([worker])
    print(place["loader"], place["worker"], place["at"], flush=True)
    os.kill(pid, signal.SIGKILL)
    os._exit(0)  # the rank ends at once: its worker must end with it
    """)


@pytest.mark.timeout(60)
def test_a_forked_dataloader_worker_answers_and_ends_with_its_rank_and_another_fork_is_left_alone(tmp_path):
    out = subprocess.run([sys.executable, "-c", FORKS], capture_output=True, text=True, timeout=50,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines.pop(0) == "dataset's process answers: False", out.stdout
    assert lines[0] == "False True", out.stdout
    assert lines[1] == "True None at <string>:9 in sample", out.stdout
    deadline = time.monotonic() + 3  # torch's worker would never notice: it is blocked
    while time.monotonic() < deadline and _workers_of(tmp_path):
        time.sleep(0.1)
    assert not _workers_of(tmp_path), "the DataLoader worker outlived its rank"


NO_MEMFD = BLOCKS + textwrap.dedent("""
    loaderworkers.serve()
    del os.memfd_create  # as a Python built against glibc < 2.27 (conda's)
    it = iter(DataLoader(Blocks(), num_workers=1))  # fork: torch's default here
    next(it)
    [worker] = loaderworkers.children()
    print("answers:", loaderworkers.catches(worker), flush=True)
    os._exit(0)  # the rank ends at once: its worker must end with it
    """)


@pytest.mark.timeout(60)
def test_a_forked_dataloader_worker_that_cannot_answer_still_ends_with_its_rank(tmp_path):
    """Without memfd the worker does not answer a hang report, and is tied to its rank all the same
    (before: not tied, it outlived a killed rank, blocked, for ever)."""
    with open(tmp_path / "out", "w") as fp:  # not a pipe: a worker left behind would hold it open
        rc = subprocess.run([sys.executable, "-c", NO_MEMFD], stdout=fp, stderr=subprocess.STDOUT, timeout=50,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path).returncode
    out = (tmp_path / "out").read_text()
    assert rc == 0 and out == "answers: False\n", out
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and _workers_of(tmp_path):
        time.sleep(0.1)
    left = _workers_of(tmp_path)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the DataLoader worker outlived its rank"


def _workers_of(directory) -> list[int]:
    left = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{entry}/cwd") == str(directory):
                left.append(int(entry))
        except OSError:
            pass
    return left


def place(where, user="train.py:40 in main", loaders=None):
    p = {"where": where, "user_frame": user, "host": "h", "frames": ["train.py:40 in main"]}
    if loaders is not None:
        p["loaders"] = loaders
    return p


def test_the_report_names_the_worker_its_rank_waits_for_and_skips_malformed_answers():
    busy = {"pid": 4242, "worker": 0, "loader": True, "at": "at data.py:15 in __getitem__",
            "frames": ["/job/data.py:15 in __getitem__"]}
    idle = {"pid": 4243, "worker": 1, "loader": True, "at": "waiting for work (in torch's worker loop)", "frames": []}
    silent = {"pid": 4244, "worker": None, "loader": False, "at": "", "frames": [],
              "silent": "did not answer within 1 s (uninterruptible I/O (D, wait channel nfs_wait_on_request))"}
    places = {0: place("in backward (DDP's gradient all-reduce)"),
              1: place(DATA_LOADING, loaders=[busy, idle, silent, {"pid": "x"}, 7, {"at": 3}])}
    summary, report = hang_report(places, 2, 31.0, {})
    assert summary.endswith("; rank 1's DataLoader worker 0 (pid 4242) is at data.py:15 in __getitem__; rank 1's "
                            "child process (pid 4244) did not answer within 1 s (uninterruptible I/O (D, wait channel "
                            "nfs_wait_on_request))"), summary
    assert "  its DataLoader worker 0 (pid 4242) is at data.py:15 in __getitem__\n      /job/data.py:15 in __getitem__" in report
    assert "  its DataLoader worker 1 (pid 4243) is waiting for work (in torch's worker loop)" in report
    only_idle = {**places, 1: place(DATA_LOADING, loaders=[idle])}
    assert hang_report(only_idle, 2, 31.0, {})[0].endswith("; rank 1's DataLoader workers are all waiting for work")
    for bad in (None, "x", {"a": 1}, [None]):
        summary, _ = hang_report({0: places[0], 1: place(DATA_LOADING, loaders=bad)}, 2, 31.0, {})
        assert "DataLoader worker" not in summary
    no_frames = {0: {"where": DATA_LOADING, "user_frame": "?", "host": "h"}, 1: place(DATA_LOADING)}
    assert "rank 0 (h), step 0" in hang_report(no_frames, 2, 31.0, {})[1]  # a place without frames is no crash


IN_C = textwrap.dedent("""
    import ctypes
    from ddprun import loaderworkers
    loaderworkers.answer_requests(7)
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the call holds the GIL throughout
    buf = ctypes.create_string_buffer(1)
    print("reading", flush=True)
    n = libc.read(0, buf, 1)  # libc's read: no retry on EINTR, as many C libraries
    print(n, ctypes.get_errno(), buf.raw, flush=True)
    """)


@pytest.mark.timeout(30)
def test_a_worker_in_c_code_holding_the_gil_answers_and_its_blocked_call_goes_on_without_eintr():
    """The README's claims: faulthandler's C handler answers while Python cannot run, and SA_RESTART
    restarts the interrupted read, so a C library that does not retry never sees EINTR."""
    child = subprocess.Popen([sys.executable, "-c", IN_C], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"reading\n"
        time.sleep(0.3)  # in the read by now
        [place] = loaderworkers.ask([child.pid])
        assert place["worker"] == 7 and place["at"] == "at <string>:8 in <module>", place
        child.stdin.write(b"x")
        child.stdin.flush()
        assert child.stdout.readline() == b"1 0 b'x'\n"
    finally:
        child.kill()
        child.wait()




TERMINATE = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    from ddprun import loaderworkers

    class Slow(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            time.sleep(30)  # as a dataset blocked in a read
            return torch.ones(1)

    def ignoring(*args):  # as the job's preemption signals make a DataLoader worker (or any process)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not args:
            time.sleep(30)

    def ignoring_now(p):
        deadline = time.monotonic() + 20
        while not loaderworkers.ignores(p.pid, signal.SIGTERM) and time.monotonic() < deadline:
            time.sleep(0.02)
        return p

    def started(ctx):
        it = iter(DataLoader(Slow(), num_workers=1, worker_init_fn=ignoring, multiprocessing_context=ctx))
        return it, ignoring_now(it._workers[0])

    if __name__ == "__main__":
        loaderworkers.serve()
        ctx = multiprocessing.get_context(sys.argv[1])
        if sys.argv[1] == "fork":  # terminate() is the rank's: the same for any start method
            other = ctx.Process(target=ignoring, daemon=True)
            other.start()
            ignoring_now(other).terminate()
            other.join(0.5)
            print(f"other: loader worker={loaderworkers.is_loader_worker(other)} alive={other.is_alive()}",
                  flush=True)
        it, worker = started(ctx)
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(it))  # as torch's shutdown does first
        it._worker_pids_set = False
        worker.terminate()
        worker.join(2)
        print(f"worker: loader worker={loaderworkers.is_loader_worker(worker)} exitcode={worker.exitcode}",
              flush=True)
        it2, worker2 = started(ctx)  # its pid still in torch's SIGCHLD watch, as at an exit
        ended = loaderworkers.end_workers()
        print(f"at the exit: {'the worker' if ended == [worker2.pid] else ended} killed", flush=True)
        if sys.argv[1] == "fork":
            print(f"other: alive={other.is_alive()}", flush=True)
            other.kill()
        os._exit(0)  # nothing more of the exit is asked
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_terminate_kills_a_dataloader_worker_that_ignores_sigterm_and_no_other_process(tmp_path, method):
    """torch's shutdown of an iterator terminates a worker that did not stop within 5 s; the job's
    preemption signals make it ignore SIGTERM, so in a rank that is a SIGKILL. Another process that
    ignores SIGTERM keeps multiprocessing's own terminate(), as without ddprun. At the rank's exit
    the workers left are killed (torch's SIGCHLD watch of them put aside), the other is not."""
    script = tmp_path / "terminate.py"
    script.write_text(TERMINATE)
    out = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=50,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    fork = method == "fork"
    assert out.stdout.splitlines() == [*(["other: loader worker=False alive=True"] if fork else []),
                                       f"worker: loader worker=True exitcode={-signal.SIGKILL}",
                                       "at the exit: the worker killed",
                                       *(["other: alive=True"] if fork else [])], out.stderr
