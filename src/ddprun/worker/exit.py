"""How a worker ends: its failure recorded where the agent and the other ranks find it, and a hard
exit that skips the interpreter and C++ teardown after the user's atexit handlers ran (bounded).

Why the hard exit: a healthy worker that returns from its script normally goes through Python
finalization and C++ static destructors. With a gloo/NCCL process group still alive (never
destroyed, or destroyed while peers still close their pairs), a joinable C++ thread can be destroyed
there, and std::terminate aborts the process with SIGABRT ("terminate called without an active
exception") after training finished. ``os._exit`` after the atexit handlers and an explicit flush of
every open file gives the user's cleanup its turn and leaves nothing for teardown to break. Set
``DDPRUN_SOFT_EXIT=1`` to exit through the interpreter instead.

Where a record goes (protocol/failure.py): this node's store (``own-failure/<rank>``: the agent's
copy when the error file is lost to a full disk, or the job store to its host ending first), the job
store (the other ranks' monitors and every agent read it there), torch's error file
(``extraInfo.ddprun``: the agent reads it back), and ``failures/rank-N.json`` in the run directory.
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any, Protocol

from ddprun import loaderworkers
from ddprun.protocol import defaults
from ddprun.protocol import env as wenv
from ddprun.protocol.atomic import write_text_atomic
from ddprun.protocol.failure import ERROR, FailureRecord
from ddprun.protocol.rundir import rank_log_name


class Publisher(Protocol):
    """What :func:`record` needs of the job channel (worker/channel.py)."""

    def record_failure(self, rec: FailureRecord) -> None: ...

STOPPED_MARK = "ddprun: stopped because"


def exit_code_of(e: SystemExit) -> int:
    """The status ``python`` would exit with for this SystemExit."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def stopped_message(cause: FailureRecord, ch: Any = None) -> str:
    """What a rank ended by another rank's failure says (the agent groups these). ``ch``: this rank's
    JobChannel; where a restart may follow this attempt, the cause's log is named as the restart keeps
    it (``rank-N.attempt-<attempt id>.log``)."""
    if cause.rank < 0:
        return f"{STOPPED_MARK} {cause.headline()}"
    attempt = "" if ch is None or ch.last_attempt else str(ch.wenv.attempt or "")
    return f"{STOPPED_MARK} {cause.headline()} (its log: {rank_log_name(cause.rank, attempt)} on {cause.host})"


def say(text: str) -> None:
    """One message on stderr (the rank log); a full disk or a closed stream must not turn a failure
    report into a second failure (the record still goes to the store)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def print_user_traceback(e: BaseException) -> None:
    """The traceback from the user's code down, without ddprun's and runpy's frames above it."""
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename.endswith(
            ("ddprun/worker/bootstrap.py", "ddprun/worker/fnworker.py", "runpy.py"))
            or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    say("".join(traceback.format_exception(type(e), e, tb or e.__traceback__)).rstrip())


def own_record(kind: str, summary: str, environ: Mapping[str, str], exit_code: int | None = 1) -> FailureRecord:
    """A record of this process's failure from torchrun's variables (where there is no job channel)."""
    def num(name: str) -> int:
        try:
            return int(environ.get(name, "-1"))
        except ValueError:
            return -1

    return FailureRecord(kind, num("RANK"), summary, num("GROUP_RANK"), socket.gethostname(), num("LOCAL_RANK"),
                         exit_code, t=time.time())


SHM_ERRORS = ("unable to allocate shared memory", "unable to write to file </torch_", "out of shared memory",
              "insufficient shared memory")
"""torch's words when the shared memory a DataLoader worker hands its batches through is full."""


LOADER_END = re.compile(r"DataLoader worker \(pid(?:\(s\))? [\d, ]+\) (?:exited unexpectedly(?! with exit code)"
                        r"|is killed by signal: Killed)|DataLoader worker ended while handing"
                        r"|Pin memory thread exited unexpectedly")
"""Words for a DataLoader worker that ended without a Python error: torch's, when its rank found it
gone (a forkserver's or spawn's worker) or its SIGCHLD said SIGKILL (a forked one), or when the pin
memory thread, which takes the batches from the workers with pin_memory=True, died of it; ddprun's,
when it went in the middle of a hand-over (:func:`error_text`)."""
HANDOVER_ERRORS = (ConnectionError, EOFError, FileNotFoundError)


def error_text(e: BaseException) -> str:
    """``Type: message`` of an error that left the user's code. A batch's tensors pass from a
    DataLoader worker to its rank through the worker (the rank asks it for their file descriptors):
    when the worker is killed in between, the rank gets a bare ``ConnectionResetError`` (torch looks
    for a dead worker only once the forkserver has reaped it, a moment later), said here for what it is."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, HANDOVER_ERRORS):
        files = {os.path.normpath(f.filename) for f in traceback.extract_tb(e.__traceback__)}
        if any(f.endswith(os.path.join("torch", "utils", "data", "dataloader.py")) for f in files) and \
                any(f.endswith(os.path.join("torch", "multiprocessing", "reductions.py")) for f in files):
            return f"its DataLoader worker ended while handing it a batch ({text})"
    return text


def error_hint(text: str, shm: str = "/dev/shm", statvfs: Callable[[str], Any] = os.statvfs,
               oom_kills: tuple[int | None, int | None] = (None, None)) -> str:
    """A HINT for an error whose cause is the node rather than the code, else '':

    - shared memory too small for the batches DataLoader workers hand their rank (a container's
      /dev/shm is 64 MiB unless it is given more), with its size;
    - a DataLoader worker that ended without a Python error, most often the out-of-memory killer's
      pick (each worker holds its own copy of the dataset): ``oom_kills`` is the cgroup's oom_kill
      count when the rank started and now (cgroups.oom_kills); a rise is the evidence.
    """
    if any(m in text for m in SHM_ERRORS):
        return _shm_hint(shm, statvfs)
    if not LOADER_END.search(text):
        return ""
    before, now = oom_kills
    if before is not None and now is not None and now > before:
        return (f"the out-of-memory killer ended a DataLoader worker of this rank (the cgroup's oom_kill count "
                f"went {before} -> {now} while the rank ran): each worker holds its own copy of the dataset and of "
                "the batches it prefetches; use fewer workers (num_workers), a dataset that reads its samples "
                "lazily, smaller batches, or a larger memory limit")
    return ("a DataLoader worker of this rank ended without a Python error: the out-of-memory killer? (each "
            "worker holds its own copy of the dataset; see `dmesg` or the cgroup's memory.events: oom_kill); "
            "num_workers=0 loads in the rank itself and shows a crash's traceback")


def _shm_hint(shm: str, statvfs: Callable[[str], Any]) -> str:
    try:
        st = statvfs(shm)
        size = f"{st.f_blocks * st.f_frsize / 2**20:.0f} MiB"
    except OSError as e:
        size = f"unreadable: {e.strerror}"
    return (f"the shared memory DataLoader workers pass batches through is full ({shm} is {size}): give the "
            "container more (docker run --shm-size=8g or --ipc=host; Kubernetes: an emptyDir volume with "
            "medium: Memory at /dev/shm), or use fewer workers or smaller batches")


def user_frame(e: BaseException) -> str:
    """``file.py:12 in fn``: the innermost frame of ``e``'s traceback outside torch and ddprun."""
    where = "?"
    for frame in traceback.extract_tb(e.__traceback__):
        if not loaderworkers.not_users(frame.filename):
            where = f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return where


def write_error_file(message: str, exc: BaseException | None = None, record: FailureRecord | None = None) -> None:
    """torch's error-file JSON, so the agent's failure carries our message (and our record)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stack = "".join(traceback.format_exception(exc)) if exc is not None else ""
    extra: dict[str, object] = {"py_callstack": stack, "timestamp": str(int(time.time()))}
    if record is not None:
        extra["ddprun"] = asdict(record)
    try:  # atomic: the monitor thread and the main thread may both write it, and os._exit may cut one short
        write_text_atomic(path, json.dumps({"message": {"message": message, "extraInfo": extra}}))
    except OSError as e:
        say(f"ddprun: could not write the error file {path}: {e}")


def record(rec: FailureRecord, channel: Publisher | None, exc: BaseException | None = None,
           message: str | None = None) -> None:
    """Write ``rec`` everywhere it is read (module docstring): the store first (no disk needed: the
    copy a full disk cannot lose; the first cause then waits for acks), then the files."""
    if channel is not None:
        channel.record_failure(rec)
    write_error_file(message if message is not None else rec.summary, exc, rec)
    run_dir = os.environ.get(wenv.RUN_DIR)
    if run_dir:
        try:
            os.makedirs(os.path.join(run_dir, "failures"), exist_ok=True)
            write_text_atomic(os.path.join(run_dir, "failures", f"rank-{rec.rank}.json"), rec.to_json())
        except OSError as e:
            say(f"ddprun: could not write this rank's failure record: {e}")


_WRITABLE = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


def _flush_open_files() -> None:
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which deprecated proxies warn on
        if issubclass(type(obj), _WRITABLE):
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # noqa: BLE001 - a broken stream must not block the exit
                pass


THREADS_STAGE = "a thread the script left running (a non-daemon thread or a thread pool: an async save?)"


def _hung_handlers(code: int, limit_s: float, stage: list[str], channel: Publisher | None = None) -> None:
    """The exit's ``stage[0]`` (the threads the script left running, the atexit handlers, the flush of
    open files) ran past ``limit_s``: a clean end records why it fails now (the stage, and the threads
    still running), then says where they are (those threads' stacks, else the main thread's), and leaves."""
    last = threading.Timer(5.0, os._exit, args=(code or 1,))  # stderr may be the stream that blocks
    last.daemon = True
    last.start()
    frames = sys._current_frames()
    left = [t for t in threading.enumerate() if not t.daemon and t.is_alive()
            and t is not threading.main_thread() and t is not threading.current_thread()]
    summary = f"its exit did not end within {limit_s:.0f} s (--exit-timeout): {stage[0]} did not return"
    if left:
        summary += "; non-daemon threads still running: " + ", ".join(repr(t.name) for t in left)
    rec = own_record(ERROR, summary, os.environ) if code == 0 else None
    if rec is not None:  # a failure has its own record already: the hang is no cause
        record(rec, None)  # the files first: the agent reads the error file as this worker's record
    shown = left if stage[0] == THREADS_STAGE and left else [threading.main_thread()]
    where = "".join(f"  thread {t.name!r}:\n" + "".join(traceback.format_stack(frames[t.ident])[-4:])
                    for t in shown if t.ident in frames) or "?\n"
    print(f"ddprun: {stage[0]} did not return within {limit_s:.0f} s; exiting anyway. It is at:\n{where}",
          file=sys.stderr, flush=True)
    if rec is not None and channel is not None:
        channel.record_failure(rec)  # the job's copy (bounded by the timer above at worst)
    os._exit(code or 1)


def hard_exit(code: int, handlers_s: float = defaults.EXIT_TIMEOUT_S, channel: Publisher | None = None) -> None:
    """As the interpreter's own exit, each step bounded together by ``handlers_s``: after a clean end
    wait for the threads the script left running (non-daemon threads, thread pools: an async
    checkpoint's save), run the atexit handlers, flush every open file; then ``os._exit(code)`` (no
    finalization)."""
    if wenv.soft_exit(os.environ):
        sys.exit(code)
    stage = [THREADS_STAGE]
    guard = threading.Timer(handlers_s, _hung_handlers, args=(code, handlers_s, stage, channel))
    guard.daemon = True
    guard.start()
    if code == 0 and threading.current_thread() is threading.main_thread():  # a failure ends at once
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # what Python's exit does before atexit
        except Exception:  # noqa: BLE001 - a thread pool's exit hook that failed: the exit goes on
            traceback.print_exc()
    stage[0] = "an atexit handler"
    try:
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    guard.args = (code, handlers_s, stage, channel)
    # the guard stays on: a flush blocks on a pipe nobody reads (a child's stdin) or a hung file system
    stage[0] = "the flush of an open file (a pipe nobody reads? a hung file system?)"
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    guard.cancel()
    os._exit(code)
