"""A rank's DataLoader workers under ``ddprun run``: where they are at a hang report, and their end.

A rank stuck "in data loading" waits for a worker process, and only the worker's own stack says why:
a dataset reading a hung network file system, a lock, a server that never answers, a C library
deadlocked after a fork. Under ``ddprun run`` every DataLoader worker has faulthandler dump every
thread's stack on SIGURG into an anonymous in-memory file (memfd ``ddprun-loader-stacks``); its rank,
at a hang report, signals those of its children that catch it (``SigCgt`` in /proc/PID/status), reads
the dump through /proc/PID/fd, and keeps it as ``stacks/rank-N-loader-PID.txt``.

Why so: SIGURG's default action is to ignore it, so a process that never installed the answer is
unharmed. faulthandler answers from its C signal handler with SA_RESTART: a worker blocked in a system
call goes on with it (no EINTR for a C library that does not retry), and one in C code that holds
the GIL answers too. Nothing is written until a rank asks. A worker in uninterruptible I/O (a hard
NFS mount) answers only when the call ends: its kernel state and wait channel are said instead.

Who installs it: the worker bootstrap (:func:`serve`), for the DataLoader workers a rank forks (``fork``
is DataLoader's start method on Linux up to Python 3.13), and ddprun.fit's ``worker_init_fn``
(train/data.py), for its forkserver workers, with the worker's id (the rank cannot tell a forked
worker's: multiprocessing drops a started process's arguments). Both also tie the worker's life to
its parent's (PR_SET_PDEATHSIG): torch's worker checks its parent only between batches, so one blocked
in its dataset outlived a killed rank, forever. Such workers ignore the job's preemption signals
(ddprun/preempt.py, train/data.py), so the rank kills those it would terminate: torch's shutdown of a
dropped iterator, multiprocessing's exit (:func:`end_workers`).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

from ddprun._util import die_with_parent

SIGNAL = signal.SIGURG
MEMFD_NAME = "ddprun-loader-stacks"
ANSWER_WAIT_S = 1.0
"""How long (s) a rank waits for its workers' answers: a signal handler runs within ms, or not at all."""

SERVING = False
"""True in a ``ddprun run`` rank (after :func:`serve`): its DataLoader workers should answer."""

_FD: int | None = None
_WORKER_LOOP = "torch/utils/data/_utils/worker.py"
_DATALOADER = "torch/utils/data/dataloader.py"
_STDLIB = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib")})
_INSTALLED = ("site-packages", "dist-packages")  # torch and the like (Debian: dist-packages)
_DDPRUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
"""ddprun's own files: its package directory, not any path with a ``ddprun`` folder (a user's clone)."""


def not_users(filename: str) -> bool:
    """Whether ``filename`` is an installed package's, ddprun's, or not a file (``<frozen runpy>``)."""
    return any(part in filename for part in _INSTALLED) or filename.startswith(_DDPRUN) or filename.startswith("<")


def user_frame(frames: Iterable[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost frame of the user's code in ``frames`` (outermost first): not torch or another
    installed package (site- or dist-packages), not ddprun, not the standard library (a ``select``
    the DataLoader waits in)."""
    for fn, ln, func in reversed(list(frames)):
        if not (not_users(fn) or fn.startswith(_STDLIB)):
            return fn, ln, func
    return None


def frames_of(frame: FrameType | None) -> list[tuple[str, int, str]]:
    """(file, line, function) from the outermost frame to ``frame``."""
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    out.reverse()
    return out


def frame_text(f: tuple[str, int, str]) -> str:
    return f"{os.path.basename(f[0])}:{f[1]} in {f[2]}"


def frame_lines(frames: Iterable[tuple[str, int, str]]) -> list[str]:
    """``/path/file.py:15 in f`` per frame, as a place carries them (the store, the report)."""
    return [f"{fn}:{ln} in {func}" for fn, ln, func in frames]


# -- in a DataLoader worker -----------------------------------------------------------------------
def answer_requests(worker_id: int | None = None) -> bool:
    """Dump every thread's stack into this process's memfd on SIGURG (a DataLoader worker, whose
    rank reads it; the memfd's name carries ``worker_id`` and the main thread's id). Any thread; a
    second call replaces the first. Never raises: False where it cannot answer (no memfd: a Python
    built against glibc < 2.27, as conda's are; SIGURG already caught here, e.g. by a Go library)."""
    global _FD
    try:
        if _FD is None and catches(os.getpid()):
            return False
        main = threading.main_thread().ident or 0
        fd = os.memfd_create(f"{MEMFD_NAME}-{'' if worker_id is None else worker_id}-{main:x}", os.MFD_CLOEXEC)
        faulthandler.register(SIGNAL, file=fd, all_threads=True)
    except (OSError, AttributeError, ValueError, RuntimeError):
        return False
    if _FD is not None:
        os.close(_FD)
    _FD = fd
    return True


_RANK_MAIN: int | None = None
"""The rank's main thread's id (:func:`serve`): a child forked by that thread is tied to its life."""

_MULTIPROCESSING = os.path.join("", "multiprocessing", "")


def forked_by_dataloader() -> bool:
    """In an at-fork hook of a forked child: whether torch's DataLoader forked it, as a worker: the
    first frame under the fork that is not multiprocessing's is torch's iterator (not a fork in a
    worker, nor a Process a dataset starts in a rank that loads without workers)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.endswith("ddprun/loaderworkers.py")
                                 or frame.f_code.co_filename.endswith("ddprun/preempt.py")
                                 or _MULTIPROCESSING in frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.endswith(_DATALOADER)


def _inherit() -> None:
    """In a process the rank forked: a DataLoader worker (of the script's own loop) answers, and ends
    with its rank: torch's worker checks its parent only between batches, so one blocked in its
    dataset would outlive a killed rank. Tied only when the rank's main thread forked it (the signal
    comes at the forking thread's end; a thread keeps its id across fork) and torch's DataLoader did:
    another fork of the script is left as it is (a daemon meant to outlive it)."""
    try:
        if forked_by_dataloader():
            answer_requests()  # a Python without memfd: no answer, and still tied to its rank
            if threading.get_ident() == _RANK_MAIN:
                die_with_parent()
    except (OSError, AttributeError, RuntimeError, ValueError):  # no answer: the rank says nothing of it
        pass


def serve() -> None:
    """In a ``ddprun run`` rank (main thread): the DataLoader workers it forks from now on answer;
    fit's workers too. multiprocessing's ``terminate()`` of a DataLoader worker that ignores SIGTERM
    kills it (:func:`_mark_loader_workers`)."""
    global SERVING, _RANK_MAIN
    if not SERVING:
        os.register_at_fork(after_in_child=_inherit)
        _mark_loader_workers()
    SERVING, _RANK_MAIN = True, threading.get_ident()


_LOADER_WORKER = "_ddprun_loader_worker"
"""The attribute that marks a multiprocessing Process object as a DataLoader worker (at its start)."""


def _mark_loader_workers() -> None:
    """In this process, a Process started to run torch's DataLoader worker loop (any start method)
    is marked as such (``start()`` drops its target), and its ``terminate()`` is a SIGKILL while it
    ignores SIGTERM, as the job's preemption signals make it (a scheduler sends them to every process
    of a node). torch's shutdown of an iterator terminates a worker still running after a 5 s join:
    ignored, a worker blocked in its dataset outlived its loop's ``break`` until its rank's exit.
    torch's worker ends as abruptly at its parent's SIGTERM (``_exit``), and its pid is no longer
    watched by then (no failure). Any other process's ``terminate()`` is multiprocessing's own."""
    from multiprocessing import process

    cls = process.BaseProcess
    start, terminate = cls.start, cls.terminate

    def start_marked(self: Any) -> None:
        target = getattr(self, "_target", None)
        if getattr(target, "__name__", "") == "_worker_loop" and \
                getattr(target, "__module__", "") == "torch.utils.data._utils.worker":
            setattr(self, _LOADER_WORKER, True)  # a plain flag: a forkserver's Process is pickled
        start(self)

    def terminate_or_kill(self: Any) -> None:
        pid = self.pid
        if is_loader_worker(self) and isinstance(pid, int) and ignores(pid, signal.SIGTERM):
            self.kill()
        else:
            terminate(self)

    cls.start, cls.terminate = start_marked, terminate_or_kill  # type: ignore[method-assign]


def is_loader_worker(proc: Any) -> bool:
    """Whether a multiprocessing Process was started (after :func:`serve`) as a DataLoader worker."""
    return getattr(proc, _LOADER_WORKER, False) is True


# -- in the rank ------------------------------------------------------------------------------------
def children() -> list[int]:
    """pids of this process's multiprocessing children that have not ended (DataLoader workers,
    whatever their start method). Not ``multiprocessing.active_children()``: it reaps, racing torch's
    own check of its workers (two ``waitpid`` of one pid: one of them takes a dead worker for alive)."""
    return sorted(pid for _, pid in _live_children())


def _live_children() -> list[tuple[Any, int]]:
    """(Process, pid) of this process's multiprocessing children that have not ended."""
    from multiprocessing import process

    out = []
    for p in list(getattr(process, "_children", ())):
        popen = getattr(p, "_popen", None)
        if popen is not None and getattr(popen, "returncode", 0) is None and isinstance(popen.pid, int) \
                and not _ended(popen):
            out.append((p, popen.pid))
    return out


def _ended(popen: Any) -> bool:
    """Whether a child ended unreaped (its sentinel is ready; not reaped here): a forkserver's child
    is reaped by the forkserver, and its pid may already be another process's."""
    from multiprocessing.connection import wait

    try:
        return bool(wait([popen.sentinel], 0))
    except (AttributeError, OSError, ValueError):
        return False


def catches(pid: int, sig: int = SIGNAL) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` in /proc/PID/status)."""
    return _in_mask(pid, "SigCgt:", sig)


def ignores(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` (``SigIgn`` in /proc/PID/status)."""
    return _in_mask(pid, "SigIgn:", sig)


def _in_mask(pid: int, field: str, sig: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fp:
            for line in fp:
                if line.startswith(field):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def end_workers() -> list[int]:
    """SIGKILL this rank's DataLoader workers that are still running (whatever their start method, and
    also where they cannot answer), as the rank ends: they ignore the preemption signals, SIGTERM included, so
    multiprocessing's exit (``terminate()``, then a ``join()`` without a bound) would wait for them
    forever where an iterator outlived the script's loop. torch's own answer to its parent's SIGTERM
    is as abrupt (``_exit``). torch's SIGCHLD handler, which would take their end for a failure and
    raise it in the exiting main thread, is put back to the default first. Main thread; returns the
    pids signalled."""
    # by the mark made at start(), or by the answer's memfd (should torch rename its worker loop)
    workers = sorted(pid for proc, pid in _live_children() if is_loader_worker(proc) or _stack_file(pid) is not None)
    if workers and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    ended = []
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
            ended.append(pid)
        except OSError:
            pass
    return ended


def kernel_state(pid: int) -> str:
    """``uninterruptible I/O (D, wait channel nfs_wait_on_request)`` and the like, from /proc."""
    names = {"D": "uninterruptible I/O", "R": "running", "S": "sleeping", "T": "stopped", "t": "stopped by a tracer",
             "Z": "ended (a zombie)"}
    try:
        with open(f"/proc/{pid}/stat") as fp:
            state = fp.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/wchan") as fp:
            wchan = fp.read().strip()
    except (OSError, IndexError):
        return "gone"
    channel = f", wait channel {wchan}" if wchan and wchan != "0" else ""
    return f"{names.get(state, 'state')} ({state}{channel})"


def _stack_file(pid: int) -> tuple[str, int | None, int | None] | None:
    """``(/proc/PID/fd/N, DataLoader worker id, main thread id)``, each id None where unknown:
    ``pid``'s memfd of stacks (:func:`answer_requests`); None without one."""
    try:
        for n in os.listdir(f"/proc/{pid}/fd"):
            named = re.match(rf"/memfd:{MEMFD_NAME}-(\d*)-([0-9a-f]+) \(deleted\)$", os.readlink(f"/proc/{pid}/fd/{n}"))
            if named:
                return (f"/proc/{pid}/fd/{n}", int(named[1]) if named[1] else None, int(named[2], 16) or None)
    except OSError:
        pass
    return None


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as fp:
            fp.seek(offset)
            return fp.read(1 << 20).decode(errors="replace")
    except OSError:
        return ""


STABLE_S = 0.1
"""A dump that has not grown for this long (s) is whole: faulthandler writes one in well under 1 ms,
unless the scheduler pauses the worker in the middle of it."""


def ask(pids: Iterable[int], wait_s: float = ANSWER_WAIT_S) -> list[dict[str, Any]]:
    """Each of ``pids`` that answers SIGURG: ``pid``, ``worker`` (its DataLoader worker id, where
    known), ``loader`` (a DataLoader worker), ``stack`` (every thread's, faulthandler's text),
    ``frames`` (its main thread's, outermost first) and ``at``; without an answer within ``wait_s``,
    ``silent`` says so with its kernel state."""
    asked: dict[int, tuple[str, int | None, int | None, int]] = {}
    for pid in pids:
        found = _stack_file(pid) if catches(pid) else None
        if found is None:
            continue
        try:
            offset = os.stat(found[0]).st_size  # an earlier report's answer stays before it
            os.kill(pid, SIGNAL)
        except OSError:
            continue
        asked[pid] = (*found, offset)
    texts: dict[int, str] = {}
    start = changed = time.monotonic()
    while asked and time.monotonic() < start + wait_s:
        time.sleep(0.02)
        now = {pid: _read_from(path, offset) for pid, (path, _, _, offset) in asked.items()}
        if now != texts:
            texts, changed = now, time.monotonic()
        elif all(texts.values()) and time.monotonic() - changed >= STABLE_S:
            break
    return [_place(pid, worker, main, texts.get(pid, ""), wait_s) for pid, (_, worker, main, _) in asked.items()]


def _place(pid: int, worker: int | None, main: int | None, stack: str, wait_s: float) -> dict[str, Any]:
    frames = main_thread_frames(stack, main)
    place: dict[str, Any] = {"pid": pid, "worker": worker, "stack": stack,
                             "loader": worker is not None or any(fn.endswith(_WORKER_LOOP) for fn, _, _ in frames),
                             "frames": frame_lines(frames[-8:])}
    if frames:
        place["at"] = _worker_at(frames)
    elif stack:
        place["at"] = "at ? (its main thread is not in the dump: faulthandler lists 100 threads at most)"
    else:
        place.update(at="", silent=f"did not answer within {wait_s:g} s ({kernel_state(pid)})")
    return place


def _worker_at(frames: list[tuple[str, int, str]]) -> str:
    """``at data.py:15 in __getitem__`` (the user's innermost frame), or ``waiting for work`` when
    torch's worker loop is the innermost code outside the standard library (its index queue's get)."""
    user = user_frame(frames)
    if user is not None:
        return f"at {frame_text(user)}"
    inner = next((f for f in reversed(frames) if not f[0].startswith(_STDLIB)), frames[-1])
    if inner[0].endswith(_WORKER_LOOP):
        return "waiting for work (in torch's worker loop)"
    return f"at {frame_text(inner)}"


_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?+) in (.*)$')


def main_thread_frames(stack: str, main: int | None = None) -> list[tuple[str, int, str]]:
    """The main thread's frames (outermost first) in faulthandler's dump of every thread: the thread
    whose id is ``main``, else the last one listed (CPython keeps its threads newest first)."""
    parts = re.split(r"^(?:Current thread|Thread) (0x[0-9a-f]+) .*:$", stack, flags=re.M)
    blocks = dict(zip((int(h, 16) for h in parts[1::2]), parts[2::2]))
    if not blocks:
        return []
    block = blocks.get(main, "") if main is not None else parts[-1]
    frames = []
    for line in block.splitlines():
        m = _FRAME.match(line)
        if m:
            frames.append((m[1], int(m[2]) if m[2].isdigit() else 0, m[3]))
    frames.reverse()
    return frames
