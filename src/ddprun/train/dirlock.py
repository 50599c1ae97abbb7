"""One writing job per checkpoint directory: the writer's lock (``.ddprun-writer.lock``).

Two jobs that write one checkpoint directory at once (a sweep given one ``checkpoint_dir``) delete
each other's files in flight, prune each other's checkpoints and resume from each other's state.
fit's main writer holds a POSIX record lock on the directory's lock file while it runs, with who
holds it written inside; a writer of another run finds it held and is refused, naming the holder.

* A run is its run directory (``runs/<run id>``, absolute): the launch's own identity, where a
  rendezvous id may be every job's default (torchrun's ``none``, ddprun's ``ddprun``).
* A POSIX lock (``fcntl.lockf``), not ``flock``: it belongs to the process, so DataLoader workers
  forked from it do not keep it after it ends; it ends with the process, also on SIGKILL; NFS
  clients share it through the lock manager.
* Held by a process of the same run: an earlier attempt of this job, e.g. a rank 0 cut off on a
  node the job re-formed without, whose NFS lease has not expired yet. The writer goes on without
  the lock: a safety check never stops a healthy job.
* A file system without locks (ENOLCK, EOPNOTSUPP, ...), or whose lock calls do not answer within
  ``WAIT_S`` + ``CALL_S`` (a lock manager that is gone): no check, with a warning for the latter.
* A holder that is ending (a relaunch right after a stop) is waited for, up to ``WAIT_S``.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import warnings

from ddprun.errors import CheckpointError

LOCK_NAME = ".ddprun-writer.lock"
WAIT_S = 5.0
"""How long a writer waits for a holder of another run to end before it is refused."""
CALL_S = 10.0
"""Beyond ``WAIT_S``, how long the lock calls may take before the writer goes on without the lock."""
_HELD: dict[str, int] = {}
"""Directories (absolute) whose lock this process holds, and the file descriptor holding it."""
_BUSY = (errno.EACCES, errno.EAGAIN)


def _holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096) or b"{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return (f"held by {holder.get('host', '?')} pid {holder.get('pid', '?')} (run {holder.get('run') or '?'}, "
            f"since {when})")


def _try_lock(fd: int, me: dict, deadline: float) -> tuple[bool, dict | None]:
    """Lock ``fd``: (True, None) held; (False, None) not held, go on unchecked (no locks on this file
    system, or held by this run's earlier attempt); (False, holder) held by another run past ``deadline``."""
    import fcntl

    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True, None
        except OSError as e:
            if e.errno not in _BUSY:
                return False, None  # this file system has no locks: no check
        holder = _holder(fd)
        if holder.get("run") == me["run"]:
            return False, None
        if time.monotonic() >= deadline:
            return False, holder
        time.sleep(0.25)


def acquire(directory: str, run: str, wait_s: float | None = None) -> None:
    """Hold ``directory``'s writer lock for the run whose directory is ``run`` until :func:`release`.
    Raises CheckpointError when a process of another run holds it past ``wait_s`` (None:
    :data:`WAIT_S`). The directory exists."""
    from ddprun._util import within

    wait_s = WAIT_S if wait_s is None else wait_s
    path = os.path.abspath(directory)
    if path in _HELD:
        return
    me = {"host": socket.gethostname(), "pid": os.getpid(), "run": os.path.abspath(run), "since": time.time()}
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return  # the writes themselves say what is wrong with the directory
    try:
        locked, holder = within(wait_s + CALL_S, _try_lock, fd, me, time.monotonic() + wait_s)
    except TimeoutError:  # its thread keeps the descriptor: closing it under a pending lock call is unsafe
        warnings.warn(f"ddprun: the checkpoint directory {path} did not answer its lock call within "
                      f"{wait_s + CALL_S:g} s: this fit goes on without checking that no other job writes there.",
                      stacklevel=2)
        return
    if not locked:
        os.close(fd)
        if holder is None:
            return
        raise CheckpointError("Another job writes checkpoints in this directory.",
                              seen=f"{path}: {_describe(holder)}",
                              hint="Give each job its own checkpoint_dir (or run_dir), or wait until that job ends; "
                                   f"if it has ended on a node that is gone, remove {LOCK_NAME} there.")
    _HELD[path] = fd
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError:
        pass  # held all the same; a refused job then names no holder


def release(directory: str | None = None) -> None:
    """Let go of ``directory``'s lock (None: every lock this process holds)."""
    paths = list(_HELD) if directory is None else [os.path.abspath(directory)]
    for path in paths:
        fd = _HELD.pop(path, None)
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the POSIX lock
