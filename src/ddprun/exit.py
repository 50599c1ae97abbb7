"""How a worker ends: failures recorded where the launcher and the other ranks find them, and a
hard exit that skips the interpreter and C++ teardown after the user's atexit handlers ran.

Why the hard exit: a healthy worker that returns from its script normally goes through Python
finalization and C++ static destructors. With a gloo/NCCL process group still alive (never
destroyed, or destroyed while peers still close their pairs), a joinable C++ thread can be destroyed
there, and std::terminate aborts the process with SIGABRT ("terminate called without an active
exception") after training finished. ``os._exit`` after the atexit handlers and an explicit flush of
every open file gives the user's cleanup its turn and leaves nothing for teardown to break. Set
``DDPRUN_SOFT_EXIT=1`` to exit through the interpreter instead.
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddprun.jobstore import JobChannel


def exit_code_of(e: SystemExit) -> int:
    """The status ``python`` would exit with for this SystemExit."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


STOPPED_MARK = "ddprun: stopped because"


def stopped_message(cause: dict) -> str:
    """What a rank ended by another rank's failure says (the launcher groups these)."""
    return (f"{STOPPED_MARK} rank {cause['rank']} (node {cause['node_rank']}, {cause['host']}) failed: "
            f"{cause['summary']} (its log: logs/rank-{cause['rank']}.log on {cause['host']})")


def print_user_traceback(e: BaseException) -> None:
    """The traceback from the user's code down, without ddprun's and runpy's frames above it."""
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename.endswith(("ddprun/worker.py", "ddprun/fnworker.py", "runpy.py"))
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__)
    sys.stderr.flush()


def write_error_file(message: str, exc: BaseException | None = None) -> None:
    """Write torch's error-file JSON so the agent's failure record carries our message."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stack = "".join(traceback.format_exception(exc)) if exc is not None else ""
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError:
        pass


def report_failure(channel: JobChannel | None, summary: str, code: int, exc: BaseException | None = None) -> None:
    """Record this rank's failure in its error file and, for the other ranks, in the job store."""
    write_error_file(summary, exc)
    if channel is not None:
        channel.record_failure(summary, code)


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


def hard_exit(code: int, channel: JobChannel | None = None) -> None:
    """Run atexit handlers, flush every open file, then ``os._exit(code)`` (module docstring)."""
    if channel is not None:
        channel.stop_monitor()
        if code == 0:
            channel.flush_timing()
    if os.environ.get("DDPRUN_SOFT_EXIT") == "1":
        sys.exit(code)
    try:
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
