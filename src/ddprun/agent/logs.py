"""Where worker output goes: ``<run dir>/logs/rank-<N>.log`` per worker, rank 0 (and --tee ranks)
followed onto the console, torch's own agent chatter into ``logs/agent-<host>.log`` (appended to).
Nothing is overwritten: a restart keeps each attempt's log (``rank-<N>.attempt-<attempt id>.log``), a
relaunch into the same run directory moves the earlier launch's to ``logs/before-<launch>/``.

:class:`RankLogsSpecs` plugs into torch's agent (``LogsSpecs.reify`` is called once per attempt
with every local worker's environment, global RANK included), so files are named by global rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import BinaryIO, TextIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from ddprun.protocol.env import AGENT_PID, WorkerEnv


def rank_log_path(run_dir: str, rank: int | str) -> str:
    return os.path.join(run_dir, "logs", f"rank-{rank}.log")


def early_log_path(run_dir: str, rank: int | str) -> str:
    return os.path.join(run_dir, "logs", f"rank-{rank}.early.log")


def remove_empty_early_logs(run_dir: str) -> None:
    logs = os.path.join(run_dir, "logs")
    for name in os.listdir(logs) if os.path.isdir(logs) else ():
        path = os.path.join(logs, name)
        try:
            if name.endswith(".early.log") and os.path.getsize(path) == 0:
                os.unlink(path)
        except FileNotFoundError:  # a run dir on a shared file system: another node removed it first
            pass


def keep_as_attempt(path: str, attempt: str = "", ours: tuple[int, int] | None = None) -> None:
    """Move ``rank-N.log`` aside to ``rank-N.attempt-<attempt>.log``, the job-wide id of the attempt that
    wrote it (agent/attempt.py: the name a restart's line printed for it). A log of an attempt not
    known here (another node's, in a shared run dir), or whose name is taken, goes to the first free
    ``rank-N.attempt-K.log`` (K from 0). ``ours``: the file this node created there (:func:`identity`);
    another file at ``path`` (the live log of the node an elastic round gave the rank, in a shared run
    dir) stays where it is, also where it took the path between the check and the move."""
    if ours is not None and identity(path) != ours:
        return
    stem = path[:-len(".log")]
    target = f"{stem}.attempt-{attempt}.log" if attempt else ""
    k = 0
    while not target or os.path.exists(target):
        target, k = f"{stem}.attempt-{k}.log", k + 1
    try:
        os.replace(path, target)
    except OSError:  # gone meanwhile
        return
    if ours is not None and identity(target) != ours:
        try:  # another node's: its name back (link fails where a third file took the path), then ours gone
            os.link(target, path)
            os.unlink(target)
        except OSError:
            pass


def identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path`` now; None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def create_log(path: str) -> tuple[int, int] | None:
    """Create the (empty) log at ``path`` before torch's agent opens it with "w" (which keeps the file):
    its :func:`identity`, so that this node's next start moves only this file aside; None where it
    cannot (torch's open then says why)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def keep_earlier_launch(run_dir: str, rank: int | str, launch: str, started: float) -> None:
    """A relaunch into the same run directory (an explicit --rdzv-id, a requeued scheduler job): the
    logs and failure record rank ``rank`` left there before this launch ``started`` (epoch seconds)
    move to ``logs/before-<launch>/`` (this launch's start on this node), never overwritten. Files of
    this launch (another node's, in a shared run dir) stay: the live log among them is then kept as an
    attempt's (:func:`keep_as_attempt`); a file that cannot move stays too."""
    logs = os.path.join(run_dir, "logs")
    names = [n for n in os.listdir(logs) if n.startswith(f"rank-{rank}.") and n.endswith((".log", ".json"))]
    moves = [(os.path.join(logs, n), n) for n in names]
    moves.append((os.path.join(run_dir, "failures", f"rank-{rank}.json"), f"failure-rank-{rank}.json"))
    dest = os.path.join(logs, f"before-{launch}")
    for src, name in moves:
        try:
            if os.path.getmtime(src) >= started:
                continue
            os.makedirs(dest, exist_ok=True)
            os.replace(src, os.path.join(dest, name))
        except OSError:  # gone (another node's agent moved it: a shared run dir), or not ours to move
            pass


class _Followed:
    """One followed path: its console prefix, the file open on it, and a line not yet complete."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.fp: BinaryIO | None = None
        self.pending = b""


class LogFollower:
    """Copies new lines of some files to a stream, each with its prefix, until stopped (drained).

    A path is followed like ``tail -F``: the file stays open, and when a restart moves it aside
    (``rank-N.attempt-K.log``) and torch's agent creates a new one at the path, the old file is read
    to its end first and the new one from its start. Nothing is read twice and no line is lost,
    whatever the order of the move, the new file and a poll.
    """

    def __init__(self, out: TextIO, interval_s: float = 0.05):
        self._out = out
        self._interval = interval_s
        self._files: dict[str, _Followed] = {}
        self._dropped: list[_Followed] = []
        """Files no longer followed (:meth:`follow` ``only``), to copy to the end of what they have open."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddprun-log-follower", daemon=True)
        self._thread.start()

    def follow(self, files: Mapping[str, str], *, only: bool = False) -> None:
        """Follow ``path -> prefix`` from the start of each file, in addition to earlier ones (``only``:
        instead of them). A path followed already keeps its place (a restart's new file is found by
        the move). A dropped path's lines are copied to the end of the file open on it, never from a
        file that took its path since: another node's rank, in a run directory shared by the nodes
        (an elastic round that moved rank 0 elsewhere; seen: both nodes echoed the new rank 0)."""
        with self._lock:
            if only:  # copied by the next poll, after what it read before: the console keeps the order
                self._dropped += [self._files.pop(path) for path in [p for p in self._files if p not in files]]
            for path, prefix in files.items():
                if path in self._files:
                    self._files[path].prefix = prefix
                else:
                    self._files[path] = _Followed(prefix)

    @staticmethod
    def _drain(f: _Followed) -> str:
        """The rest of the file ``f`` has open (every line, the last one whole or not), then closed."""
        if f.fp is None:
            return _prefixed(f.pending, f.prefix)
        try:
            data = f.pending + f.fp.read()
        except OSError:
            data = f.pending
        finally:
            f.fp.close()
            f.fp = None
        return _prefixed(data, f.prefix)

    def _read(self, path: str, f: _Followed) -> bytes:
        """What is new at ``path``: the rest of the open file and, once another file took its path,
        the start of that one."""
        data = b""
        for _ in range(2):  # the file open now, then at most the one that replaced it
            if f.fp is None:
                try:
                    f.fp = open(path, "rb")  # noqa: SIM115 - kept open between polls, closed when replaced
                except OSError:
                    return data
            data += f.fp.read()
            if _same_file(path, f.fp):
                return data
            f.fp.close()  # moved aside (and read to its end above): the path is a new file now
            f.fp = None
            if not (f.pending + data).endswith(b"\n") and (f.pending or data):
                data += b"\n"  # the old file's last line, incomplete, ends with it
        return data

    def _pump(self, final: bool = False) -> None:
        # one writer at a time (the follower's thread, or stop() once it has ended): lines keep their order
        with self._lock:  # a restart's follow() waits for a read in progress, never the console
            dropped, self._dropped = self._dropped, []
            texts = [*(self._drain(f) for f in dropped), *(self._lines(path, f, final) for path, f in self._files.items())]
        for text in texts:
            if text:
                self._out.write(text)
        self._out.flush()

    def _lines(self, path: str, f: _Followed, final: bool) -> str:
        """The whole lines new at ``path`` with their prefix (``final``: and a last incomplete one)."""
        try:
            data = f.pending + self._read(path, f)
        except OSError:
            return ""
        # only whole lines, so a line being written is not split
        end = len(data) if final else data.rfind(b"\n") + 1
        f.pending = data[end:]
        return _prefixed(data[:max(end, 0)], f.prefix)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._pump()

    def stop(self) -> None:
        """Stop, then copy what is left (bounded: one last read of each file) and close the files."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._pump(final=True)
        with self._lock:
            for f in self._files.values():
                if f.fp is not None:
                    f.fp.close()
                    f.fp = None


def _prefixed(data: bytes, prefix: str) -> str:
    """``data`` as console text: each line with ``prefix``, the last one ended ("" for nothing)."""
    if not data:
        return ""
    text = data.decode("utf-8", errors="replace")
    if prefix:
        text = "".join(prefix + line for line in text.splitlines(keepends=True))
    return text if text.endswith("\n") else text + "\n"


def _same_file(path: str, fp: BinaryIO) -> bool:
    """Whether ``path`` still names the file ``fp`` has open: False once another file took the path."""
    try:
        st = os.stat(path)
    except OSError:
        return True  # moved, the new one not created yet: keep reading the old one
    own = os.fstat(fp.fileno())
    return (st.st_ino, st.st_dev) == (own.st_ino, own.st_dev)


class RankLogsSpecs(LogsSpecs):
    """torch LogsSpecs naming each worker's log by global rank, with ddprun's worker variables."""

    def __init__(self, run_dir: str, follower: LogFollower | None, tee_local_ranks: set[int],
                 worker_env: WorkerEnv, extra_env: Mapping[str, str] | None = None,
                 on_workers_start: Callable[[], None] | None = None,
                 attempt_id: Callable[[str], str] | None = None):
        super().__init__(log_dir=run_dir)
        self._on_workers_start = on_workers_start
        self.has_rank0 = False
        """Whether this node's latest workers include global rank 0 (it then writes the run report)."""
        self.local_workers: dict[int, tuple[int, str]] = {}
        """Global rank -> (local rank, error file) of this node's latest workers."""
        # restart count -> the job-wide attempt id (ddprun.agent.attempt.AttemptIds.current), asked once per start
        self._attempt_id = attempt_id
        self._starts = 0
        self._run_dir = run_dir
        self._follower = follower
        self._tee_local = tee_local_ranks
        self._worker_env = worker_env
        self._extra_env = dict(extra_env or {})
        self.attempt = ""
        """The attempt id given to the latest workers."""
        self._wrote: dict[str, tuple[str, tuple[int, int] | None]] = {}
        """Global rank -> the attempt id of the log this node's latest start wrote for it, and that
        file's identity (:func:`create_log`)."""
        self._launch_t = time.time()
        self._launch = time.strftime("%Y%m%d-%H%M%S-", time.localtime(self._launch_t)) + f"{os.getpid()}"

    @property
    def root_log_dir(self) -> str:
        return self._run_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        if self._on_workers_start is not None:
            self._on_workers_start()
        logs_dir = os.path.join(self._run_dir, "logs")
        os.makedirs(logs_dir, exist_ok=True)
        stdouts, stderrs, errors, follow = {}, {}, {}, {}
        # this start's workers only: an elastic round may give this node other ranks than the last
        self.has_rank0, self.local_workers = False, {}
        self._starts += 1
        attempt = ""
        if self._attempt_id is not None and envs:
            attempt = self._attempt_id(next(iter(envs.values())).get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.attempt = attempt or f"c{next(iter(envs.values())).get('TORCHELASTIC_RESTART_COUNT', '0')}" if envs else ""
        exported = replace(self._worker_env, attempt=attempt, merge_stderr=True).to_environ()
        # every log of this node's last start, by the attempt that wrote it: also one of a rank that an
        # elastic round gives another node now (the restart line named it so)
        for rank, (wrote, ours) in self._wrote.items():
            if os.path.exists(rank_log_path(self._run_dir, rank)):
                keep_as_attempt(rank_log_path(self._run_dir, rank), wrote, ours)
        self._wrote = {}
        for local_rank, env in envs.items():
            rank = env["RANK"]
            path = rank_log_path(self._run_dir, rank)
            if self._starts == 1:
                keep_earlier_launch(self._run_dir, rank, self._launch, self._launch_t)
            if os.path.exists(path):
                # keep every attempt's log: the failed one explains the restart. Also one of this launch
                # that another node wrote in an earlier round (a shared run dir; torch's "w" would empty it)
                keep_as_attempt(path)
            self._wrote[rank] = (self.attempt, create_log(path))
            error_file = os.path.join(logs_dir, f"rank-{rank}.error.json")
            if os.path.exists(error_file):
                os.unlink(error_file)
            env.update(self._extra_env)
            env.update(exported)
            env["NODE_RANK"] = env["GROUP_RANK"]
            env[AGENT_PID] = str(os.getpid())  # torch's agent starts the workers from this process
            env["TORCHELASTIC_ERROR_FILE"] = error_file
            stdouts[local_rank] = path
            # The worker joins stderr to stdout as its first act; this file keeps only what a
            # worker printed before that (an interpreter that could not start, say).
            stderrs[local_rank] = early_log_path(self._run_dir, rank)
            errors[local_rank] = error_file
            self.local_workers[int(rank)] = (local_rank, error_file)
            if rank == "0":
                self.has_rank0 = True
                follow[path] = ""
            elif local_rank in self._tee_local:
                follow[path] = f"[rank{rank}] "
        if self._follower is not None:
            self._follower.follow(follow, only=True)
        return LogsDest(stdouts, stderrs, {}, {}, errors,
                        os.path.join(logs_dir, "filtered_stdout.log"), os.path.join(logs_dir, "filtered_stderr.log"))


ROUTED_LOGGERS = ("torch.distributed", "torch.distributed.elastic", "ddprun.agent")


def route_torch_logging(path: str) -> Callable[[], None]:
    """Send torch.distributed's Python logging (and ddprun's agent's) to ``path`` instead of the console.
    Returns what puts those loggers back as they were and closes the file: a second launch in the same
    process (``ddprun.launch`` twice) must not write into the first one's log."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in ROUTED_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, list(lg.handlers), lg.level, lg.propagate))
        lg.handlers[:] = [handler]
        lg.setLevel(logging.INFO)
        lg.propagate = False

    def restore() -> None:
        for lg, handlers, level, propagate in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate
        handler.close()
    return restore
