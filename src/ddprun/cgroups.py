"""Where this process's cgroup keeps a controller's files (cgroup v1 and v2), read without privilege.

``/proc/self/cgroup`` gives the process's cgroup per hierarchy: cgroup v2's ``0::PATH``, or the line
of the v1 hierarchy that holds the controller (``4:memory:PATH``, ``2:cpu,cpuacct:PATH``).
``/proc/self/mountinfo`` says where each hierarchy is mounted and which of its cgroups is the root of
that mount: the directory is the mount point plus the path below that root. This is what the JVM
does, and it is right in a container with a cgroup namespace (path and root ``/``), without one
(Docker on cgroup v1: the container's host path is both), inside nested containers, and wherever the
hierarchy is mounted. A mount whose root is not above the path does not show this cgroup; of several
that do, the last (the one on top) is used. Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

Reader = Callable[[str], "str | None"]
"""A file's text, or None when it cannot be read."""


@dataclass(frozen=True)
class Place:
    """This process's cgroup directory in a hierarchy with a controller, and the hierarchy's mount
    point above it."""

    dir: str
    mount: str
    v2: bool

    def dirs(self) -> list[str]:
        """This cgroup's directory, then each ancestor's visible under the mount point."""
        below = [p for p in self.dir[len(self.mount):].split("/") if p]
        return [self.mount + "".join("/" + p for p in below[:i]) for i in range(len(below), -1, -1)]

    def own(self, name: str, read: Reader) -> str | None:
        """The text of this cgroup's file ``name``, or None."""
        return read(f"{self.dir}/{name}")


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(mountinfo: str, controller: str, v2: bool) -> list[tuple[str, str]]:
    """(root, mount point) of each mount of the v2 hierarchy, or of the v1 one with ``controller``."""
    out = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 4:
            continue
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if (v2 and fstype == "cgroup2") or (not v2 and fstype == "cgroup" and controller in options):
            out.append((_unescape(fields[3]), _unescape(fields[4])))
    return out


def _under(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` ('' for itself), or None when it is not below it."""
    root = root.rstrip("/")
    return path[len(root):].rstrip("/") if path == root or path.startswith(root + "/") else None


def places(proc_cgroup: str, mountinfo: str, controller: str) -> list[Place]:
    """Where ``controller``'s files are for the process whose ``/proc/PID/cgroup`` and
    ``/proc/PID/mountinfo`` texts are given: in the v1 hierarchy that holds it, and in v2's unified
    one, whichever are there and mounted (on a hybrid host the files are in one of them)."""
    out = []
    for line in proc_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        v2 = hier == "0" and controllers == ""
        if not sep or not path.startswith("/") or not (v2 or controller in controllers.split(",")):
            continue
        seen = [(mount, rel) for root, mount in _mounts(mountinfo, controller, v2)
                if (rel := _under(path, root)) is not None]
        if seen:
            mount, rel = seen[-1]
            out.append(Place(mount.rstrip("/") + rel, mount.rstrip("/"), v2))
    return out


def read_text(path: str) -> str | None:
    """The file's text, or None when it cannot be read (a :data:`Reader`)."""
    try:
        with open(path, errors="replace") as f:  # a path with bytes that are not UTF-8 must not raise
            return f.read()
    except OSError:
        return None


def mine(controller: str, read: Reader = read_text) -> list[Place]:
    """:func:`places` of this process, read now."""
    return places(read("/proc/self/cgroup") or "", read("/proc/self/mountinfo") or "", controller)


def counter(text: str | None, key: str) -> int | None:
    """The value of ``key`` in a flat-keyed file (``oom_kill 3``), None when absent or malformed."""
    for line in (text or "").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == key:
            try:
                return int(fields[1])
            except ValueError:
                return None
    return None


def oom_kills(read: Reader = read_text) -> int | None:
    """How many processes the out-of-memory killer ended in this process's own cgroup, where its
    workers are: cgroup v2's ``memory.events`` (which counts its sub-cgroups' too) or v1's
    ``memory.oom_control`` (Linux 4.13 on); None where neither can be read (never an ancestor's,
    which counts other processes' kills)."""
    for place in mine("memory", read):
        kills = counter(place.own("memory.events" if place.v2 else "memory.oom_control", read), "oom_kill")
        if kills is not None:
            return kills
    return None
