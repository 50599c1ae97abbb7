"""Small helpers shared by several modules (no torch import here)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux: PR_SET_PDEATHSIG): a worker never outlives
    its agent, a forkserver never its rank. A parent already gone (reparented to 1) ends it now."""
    if not sys.platform.startswith("linux"):
        return  # the worker's monitor thread checks its parent on other platforms
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call: nothing would deliver the signal
        os._exit(1)


def cpu_count() -> int:
    """CPUs this process may run on (affinity-aware, unlike os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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


def within(timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a helper thread, waited for at most ``timeout_s``: its result or its exception,
    or TimeoutError. For calls that may block without a deadline: a TCPStore client whose server's
    process is stopped (SIGSTOP) waits for the answer for ever, whatever its timeout says. A call that
    timed out goes on blocking its (daemon) thread; don't use that client again."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=call, name="ddprun-bounded-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"{getattr(fn, '__name__', 'a call')} did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Bounded:
    """A client whose every method call is made :func:`within` ``timeout_s``. After one call timed out
    every call raises TimeoutError at once (that call still holds the client). Other attributes are the
    client's own."""

    def __init__(self, target: Any, timeout_s: float):
        self._target, self._timeout_s, self._stuck = target, timeout_s, False
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
            def invoke() -> Any:
                return attr(*args, **kwargs)

            invoke.__name__ = name
            try:
                return within(self._timeout_s, invoke)
            except TimeoutError:
                self._stuck, self.stuck_at = True, time.monotonic()
                raise

        return call
