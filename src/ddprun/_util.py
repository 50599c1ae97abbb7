"""Small helpers shared by several modules (no torch import here)."""

from __future__ import annotations

import os


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
