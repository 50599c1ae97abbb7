"""One writing job per checkpoint directory: the writer's lock (``.ddprun-writer.lock``).

Two jobs that write one checkpoint directory at once (a sweep given one ``checkpoint_dir``) delete
each other's files in flight, prune each other's checkpoints and resume from each other's state.
fit's main writer holds a record lock on the directory's lock file while it runs, with who holds
it written inside (the holder's identity comes from there, not from the kernel); a writer of another
run finds it held and is refused, naming the holder.

* A run is its run directory (``runs/<run id>``, absolute): the launch's own identity, where a
  rendezvous id may be every job's default (torchrun's ``none``, ddprun's ``ddprun``).
* An open-file-description lock (``F_OFD_SETLK``, Linux 3.15+), not a POSIX one (``lockf``): the
  kernel drops a POSIX lock when the process closes *any* descriptor of the file, so an
  ``on_checkpoint`` hook that tars the directory released it and let another job in. An OFD lock
  lives while its own descriptor does; it ends with the process, also on SIGKILL; it conflicts
  with POSIX locks (an older ddprun's) and NFS clients share it through the lock manager, as they
  do POSIX locks. A forked child (a DataLoader worker) closes its copy of the descriptor at the
  fork, so it does not keep the lock after the writer ends. Where ``F_OFD_*`` is missing (not
  Linux, an older kernel): ``lockf``, as before.
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
import struct
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
_STRANDED: list[int] = []
"""Descriptors left to a lock call that did not answer (acquire): it may still take the lock."""
_BUSY = (errno.EACCES, errno.EAGAIN)


def _close_in_child() -> None:
    """After a fork, in the child: close its copies of the lock descriptors. An OFD lock lasts while
    any descriptor of its open file description does, and a forked DataLoader worker living on would
    hold the writer's lock after the writer ended (closing them leaves the parent's lock as it is)."""
    for fd in [*_HELD.values(), *_STRANDED]:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()
    _STRANDED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _lock(fd: int) -> None:
    """An exclusive lock of the whole file, without waiting: OFD where the kernel has it, else
    ``lockf``. OSError as ``lockf`` raises it (EACCES or EAGAIN: held elsewhere)."""
    import fcntl

    ofd = getattr(fcntl, "F_OFD_SETLK", None)
    if ofd is not None:
        # struct flock: l_type, l_whence, l_start, l_len (0: to the end, whatever it grows to), l_pid
        # (0, as OFD requires); spare bytes for the padding the C struct ends with
        arg = struct.pack("@hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0) + bytes(8)
        try:
            fcntl.fcntl(fd, ofd, arg)
            return
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: a kernel without OFD locks
                raise
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


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
    while True:
        try:
            _lock(fd)
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
        _STRANDED.append(fd)
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
            os.close(fd)  # closing the descriptor that holds it drops the lock
