"""How many CPUs this process may use: the cores it may run on, capped by its cgroup's CPU limit.

A container's CPU limit (``docker run --cpus``, a Kubernetes pod's ``resources.limits.cpu``) is a CFS
quota, not an affinity mask: the process still sees, and runs on, every core of the host, but gets
``quota / period`` CPUs' worth of time per period and is stopped (throttled) for the rest of it.
Sizing processes and threads by the host's cores oversubscribes it: 96 processes for
``--nproc-per-node cpu`` in a 4-CPU pod, or threads that each wait out most of every period.
``os.cpu_count()``, ``os.sched_getaffinity`` and torch read the cores only; the JVM, Go (1.25) and
Ray read the limit too, and so does ddprun.

The limit is read from this process's own cgroup (``/proc/self/cgroup``: cgroup v2's ``0::PATH``, or
the line of cgroup v1's ``cpu`` controller) and each of its ancestors under the standard mount points,
and the smallest one wins. Inside a container the cgroup namespace shows its own cgroup as ``/``,
the mount point itself; a path missing under the mount point (a container without a cgroup namespace
shows its host's path) is skipped. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

V2_MOUNT = "/sys/fs/cgroup"
V1_CPU_MOUNT = "/sys/fs/cgroup/cpu"  # a link to cpu,cpuacct where the two controllers share a hierarchy

Reader = Callable[[str], "str | None"]
"""A file's text, or None when it cannot be read."""


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
        if self.usable >= self.cores or self.limit is None:
            return ""
        unit = "CPU" if self.limit == 1 else "CPUs"
        return f"the cgroup's CPU limit ({self.limit:g} {unit}; {self.cores} cores visible)"


def cgroup_paths(proc_cgroup: str) -> list[tuple[str, str]]:
    """(mount point, cgroup path) of this process's CPU controller from ``/proc/self/cgroup``'s text:
    cgroup v1's ``cpu`` line and cgroup v2's ``0::`` line, whichever are there."""
    out = []
    for line in proc_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or not path.startswith("/"):
            continue
        if hier == "0" and controllers == "":
            out.append((V2_MOUNT, path))
        elif "cpu" in controllers.split(","):
            out.append((V1_CPU_MOUNT, path))
    return out


def _ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``/a/b``, ``/a``, ``/``."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]


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


def cgroup_limit(proc_cgroup: str, read: Reader) -> float | None:
    """The smallest CPU limit (CPUs) on this process's cgroup and its ancestors; None without one.
    Pure but for ``read``; what cannot be read or parsed is no limit."""
    limits = []
    for mount, path in cgroup_paths(proc_cgroup):
        for d in _ancestors(path):
            base = mount.rstrip("/") + ("" if d == "/" else d)
            if mount == V2_MOUNT:
                limit = _v2_limit(read(f"{base}/cpu.max"))
            else:
                quota, period = read(f"{base}/cpu.cfs_quota_us"), read(f"{base}/cpu.cfs_period_us")
                limit = _ratio(quota.strip(), period.strip()) if quota and period else None
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def probe(read: Reader = _read) -> Cpus:
    """This process's :class:`Cpus`, read now (a pod's limit may be resized while it runs)."""
    return Cpus(_cores(), cgroup_limit(read("/proc/self/cgroup") or "", read))


def cpu_count() -> int:
    """CPUs this process may use: its affinity, capped by its cgroup's CPU limit."""
    return probe().usable
