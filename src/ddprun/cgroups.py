"""Where this process's cgroup keeps a controller's files (cgroup v1 and v2), read without privilege.

``/proc/self/cgroup`` gives the process's cgroup per hierarchy: cgroup v2's ``0::PATH`` line, or the
line of the v1 hierarchy that holds the controller (``4:memory:PATH``, ``2:cpu,cpuacct:PATH``). The
files are under the standard mount points (``/sys/fs/cgroup``, ``/sys/fs/cgroup/<controller>``).
Inside a container the cgroup namespace shows the container's cgroup as ``/``, the mount point
itself; a container without one shows its host's path, which its mount does not have, so a missing
directory is skipped in favour of its nearest existing ancestor. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ROOT = "/sys/fs/cgroup"

Reader = Callable[[str], "str | None"]
"""A file's text, or None when it cannot be read."""


@dataclass(frozen=True)
class Place:
    """Where a controller's files are: the hierarchy's mount point and this process's path in it."""

    mount: str
    path: str
    v2: bool

    def dirs(self) -> list[str]:
        """This cgroup's directory, then each ancestor's up to the mount point."""
        parts = [p for p in self.path.split("/") if p]
        return [self.mount + "".join("/" + p for p in parts[:i]) for i in range(len(parts), -1, -1)]

    def own(self, name: str, read: Reader) -> str | None:
        """The file ``name`` of the nearest cgroup that has it (this one, inside a container), else None."""
        for d in self.dirs():
            text = read(f"{d}/{name}")
            if text is not None:
                return text
        return None


def places(proc_cgroup: str, controller: str) -> list[Place]:
    """Where ``controller``'s files are for the process whose ``/proc/PID/cgroup`` text is given:
    the v1 hierarchy that holds it, and v2's unified one, whichever are there (on a hybrid host
    the controller's files are in one of them)."""
    out = []
    for line in proc_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or not path.startswith("/"):
            continue
        if hier == "0" and controllers == "":
            out.append(Place(ROOT, path, True))
        elif controller in controllers.split(","):
            out.append(Place(f"{ROOT}/{controller}", path, False))
    return out


def read_text(path: str) -> str | None:
    """The file's text, or None when it cannot be read (a :data:`Reader`)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


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
