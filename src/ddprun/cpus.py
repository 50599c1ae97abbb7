"""How many CPUs this process may use: the cores it may run on, capped by its cgroup's CPU limit.

A container's CPU limit (``docker run --cpus``, a Kubernetes pod's ``resources.limits.cpu``) is a CFS
quota, not an affinity mask: the process still sees, and runs on, every core of the host, but gets
``quota / period`` CPUs' worth of time per period and is stopped (throttled) for the rest of it.
Sizing processes and threads by the host's cores oversubscribes it: 96 processes for
``--nproc-per-node cpu`` in a 4-CPU pod, or threads that each wait out most of every period.
``os.cpu_count()``, ``os.sched_getaffinity`` and torch read the cores only; the JVM, Go (1.25) and
Ray read the limit too, and so does ddprun.

The limit is read from this process's own cgroup and each of its ancestors (cgroups.py: v2's
``cpu.max``, v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), and the smallest one wins. Nothing
here imports torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ddprun import cgroups
from ddprun.cgroups import Reader


@dataclass(frozen=True)
class Cpus:
    """This process's CPUs: ``cores`` it may run on (its affinity) and its cgroup's ``limit`` in CPUs
    (quota / period; None without one)."""

    cores: int
    limit: float | None = None

    @property
    def usable(self) -> int:
        """The cores, capped by the limit rounded up (a limit of 1.5 CPUs keeps 2 threads busy), ≥ 1."""
        if self.limit is None:
            return max(1, self.cores)
        return max(1, min(self.cores, math.ceil(round(self.limit, 6))))

    def note(self) -> str:
        """Why :attr:`usable` is less than the cores, for a plan or a warning; '' when it is not."""
        if self.limit is None or self.usable >= self.cores:
            return ""
        unit = "CPU" if self.limit == 1 else "CPUs"
        return f"the cgroup's CPU limit ({self.limit:g} {unit}; {self.cores} cores visible)"


def _v2_limit(text: str | None) -> float | None:
    fields = (text or "").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _v1_limit(quota: str | None, period: str | None) -> float | None:
    return _ratio(quota, period) if quota and period else None


def cgroup_limit(places: list[cgroups.Place], read: Reader) -> float | None:
    """The smallest CPU limit (CPUs) on this process's cgroup and its ancestors in ``places``; None
    without one. Pure but for ``read``; what cannot be read or parsed is no limit."""
    limits = []
    for place in places:
        for d in place.dirs():
            if place.v2:
                limit = _v2_limit(read(f"{d}/cpu.max"))
            else:
                limit = _v1_limit(read(f"{d}/cpu.cfs_quota_us"), read(f"{d}/cpu.cfs_period_us"))
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def probe(read: Reader = cgroups.read_text) -> Cpus:
    """This process's :class:`Cpus`, read now (a pod's limit may be resized while it runs)."""
    return Cpus(_cores(), cgroup_limit(cgroups.mine("cpu", read), read))


def cpu_count() -> int:
    """CPUs this process may use: its affinity, capped by its cgroup's CPU limit."""
    return probe().usable
