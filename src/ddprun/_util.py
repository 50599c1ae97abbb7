"""Small helpers shared by several modules (no torch import here)."""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

PR_SET_PDEATHSIG = 1


_FORK_PARENT = 0
"""In a process forked after this module's import: the pid of the process that forked it (set in the
parent just before each fork, so the child has it from its first instruction); 0 elsewhere."""


def _record_fork_parent() -> None:
    global _FORK_PARENT
    _FORK_PARENT = os.getpid()


os.register_at_fork(before=_record_fork_parent)


def die_with_parent(expected: int = 0) -> None:
    """SIGKILL this process when its parent dies (Linux: PR_SET_PDEATHSIG): a worker never outlives
    its agent, a forkserver never its rank. A parent already gone ends it now: the parent is not
    ``expected`` (a pid), or, without one, not the process that forked this one, or (an interpreter
    started by exec, no ``expected``) it is pid 1. Comparing pids, not only asking for pid 1, also
    catches an orphan adopted by a subreaper (slurmstepd, tini -s, systemd, Ray's raylet)."""
    if not sys.platform.startswith("linux"):
        return  # the worker's monitor thread checks its parent on other platforms
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if _FORK_PARENT != os.getpid():
        expected = expected or _FORK_PARENT
    parent = os.getppid()
    if parent == 1 or (expected and parent != expected):  # gone before the call: no signal would come
        os._exit(1)


def parse_bool(value: str | None, default: bool = False) -> bool:
    """Parse '1/0/true/false/yes/no/on/off' (case-insensitive); None or '' gives ``default``."""
    if value is None or value.strip() == "":
        return default
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r} (use 1/0, true/false, yes/no, on/off)")


def ranks_text(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
            run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
    return ", ".join(out)


def tail_lines(path: str, n: int = 15) -> list[str]:
    """The last ``n`` lines of a text file ([] if it does not exist)."""
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            size = fp.tell()
            fp.seek(max(0, size - 64 * 1024))
            data = fp.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return data.splitlines()[-n:]


def _call_into(fn: Callable[[], Any], box: dict[str, Any], done: threading.Event) -> None:
    try:
        box["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        box["error"] = e
    finally:
        done.set()


def _outcome(box: dict[str, Any], done: threading.Event, timeout_s: float, name: str) -> Any:
    if not done.wait(timeout_s):
        raise TimeoutError(f"{name} did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def within(timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a helper thread, waited for at most ``timeout_s``: its result or its exception,
    or TimeoutError. For calls that may block without a deadline: a TCPStore client whose server's
    process is stopped (SIGSTOP) waits for the answer for ever, whatever its timeout says. A call that
    timed out goes on blocking its (daemon) thread; don't use that client again."""
    box: dict[str, Any] = {}
    done = threading.Event()
    threading.Thread(target=_call_into, args=(lambda: fn(*args), box, done), name="ddprun-bounded-call",
                     daemon=True).start()
    return _outcome(box, done, timeout_s, getattr(fn, "__name__", "a call"))


_CALLERS: weakref.WeakSet[_Caller] = weakref.WeakSet()
"""Every live _Caller of this process, for :func:`_reset_callers_after_fork`."""


def _reset_callers_after_fork() -> None:
    for caller in list(_CALLERS):
        caller._after_fork()


os.register_at_fork(after_in_child=_reset_callers_after_fork)


class _Caller:
    """One daemon thread that makes the calls handed to it, in order, for one :class:`Bounded`: a
    thread started per call costs a handshake with the new thread (Thread.start waits for it to run),
    which a process with hundreds of polling threads (the control-plane benchmark) waits on for longer
    than the call. It ends after ``IDLE_S`` without a call; the next call starts another."""

    IDLE_S = 5.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pid = -1  # the process whose thread serves the queue (-1: none; a forked child starts its own)
        _CALLERS.add(self)

    def _after_fork(self) -> None:
        """In a forked child: a lock another thread held at the fork (inside :meth:`submit`) would
        stay locked for ever there, since that thread does not exist in the child."""
        self._lock, self._pid = threading.Lock(), -1

    def submit(self, fn: Callable[[], Any]) -> tuple[dict[str, Any], threading.Event]:
        box: dict[str, Any] = {}
        done = threading.Event()
        with self._lock:  # the thread's exit checks the queue under this lock: no call is left unserved
            if self._pid != os.getpid():
                calls: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(calls,), name="ddprun-bounded-call",
                                 daemon=True).start()  # may raise (no thread left): the next call tries again
                self._queue, self._pid = calls, os.getpid()
            self._queue.put((fn, box, done))
        return box, done

    def _serve(self, calls: queue.SimpleQueue) -> None:
        while True:
            try:
                fn, box, done = calls.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if calls.empty():
                        self._pid = -1
                        return
                continue
            _call_into(fn, box, done)


class Bounded:
    """A client whose every method call is made within ``timeout_s``, on this wrapper's own helper
    thread (calls from several threads take turns, as they do on a TCPStore client). After one call
    timed out every call raises TimeoutError at once (that call still holds the client and its
    thread). Other attributes are the client's own."""

    def __init__(self, target: Any, timeout_s: float):
        self._target, self._timeout_s, self._stuck = target, timeout_s, False
        self._caller = _Caller()
        self.stuck_at: float | None = None
        """time.monotonic() of the call that timed out; None while none did."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never the wrapper's own (copy, pickle: before __init__ ran)
            raise AttributeError(name)
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._stuck:
                raise TimeoutError(f"an earlier call did not return within {self._timeout_s:g} s")
            box, done = self._caller.submit(lambda: attr(*args, **kwargs))
            try:
                return _outcome(box, done, self._timeout_s, name)
            except TimeoutError:
                if not done.is_set():
                    self._stuck, self.stuck_at = True, time.monotonic()
                raise

        return call
