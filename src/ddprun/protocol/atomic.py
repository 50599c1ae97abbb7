"""Atomic file writes: a temp file in the target's directory, fsync, rename, fsync the directory.

A reader (or a restart after a kill mid-write) sees the old file or the new one, never a part.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import IO


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms/filesystems cannot open a directory; the rename stands anyway
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask: Linux says it in /proc (no change of it, which other threads could see);
    elsewhere it is read by setting it and straight back."""
    try:
        with open("/proc/self/status") as fp:
            for line in fp:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Create or replace ``path`` with what ``write(fileobj)`` writes, atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 otherwise: every file of a run gets the user's umask
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def remove_durably(path: str) -> None:
    """Unlink ``path`` (gone already: nothing to do) and fsync its directory: a crash after this
    return never brings it back."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_text_atomic(path: str, text: str) -> None:
    def write(f: IO[bytes]) -> None:
        f.write(text.encode())

    write_atomic(path, write)


def write_json_atomic(path: str, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2))
