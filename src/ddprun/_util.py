"""Small helpers shared by several modules (no torch import here)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable

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
