"""Failure records: who failed, how, and who was only stopped because of it; and the one classifier.

A record is written by whoever sees the failure first-hand: the worker that raised (its error file
and the job store), or the worker's agent when the worker died without one (a signal such as the
OOM killer's SIGKILL, or an exit without a record). Records are JSON; a malformed one is skipped,
never trusted. :func:`root_cause` picks the cause that every node's console names and that
:class:`~ddprun.errors.WorkerFailed` carries: first-hand failures before echoes ("Connection reset
by peer" is what the peers of a dead rank see, never a cause), then the earliest.
"""

from __future__ import annotations

import json
import signal as _signal
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

ERROR = "error"
"""The user's code raised (or exited non-zero through SystemExit)."""
SIGNAL = "signal"
"""The process was killed by a signal (recorded by its agent)."""
EXIT = "exit"
"""The process exited non-zero without a record of its own (recorded by its agent)."""
STALL = "stall"
PREFLIGHT = "preflight"
MISMATCH = "mismatch"
"""A configuration error every rank raised alike (e.g. Lightning's Trainer vs the launch)."""
TIMEOUT = "timeout"
"""``ddprun.launch``'s own timeout ran out."""
LOST = "lost"
"""A node stopped answering: its agent vanished (kill -9, the machine died) or its store did."""
STOPPED = "stopped"
"""Ended because of another rank's failure (``cause_rank``): an echo, never a cause."""
FINISHED_FIRST = "finished-first"
"""A rank whose script ended (exit 0) while another still waited for it in a collective: what that
rank's echo points at (recorded by the rank that saw the echo, :func:`finished_first`)."""
KINDS = (ERROR, SIGNAL, EXIT, STALL, PREFLIGHT, MISMATCH, TIMEOUT, LOST, STOPPED, FINISHED_FIRST)

ECHOES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ECONNRESET",
          "connection refused", "Connection refused", "remote process exited", "NCCL communicator was aborted",
          "Socket closed", "Read error", "Write error", "recvBytes", "sendBytes", "DistNetworkError",
          "failed to recv, got 0 bytes", "Timed out waiting for peer")
"""What a rank sees when a peer of its collective died; the peer's failure is the cause."""
OWN_PROCESSES = ("DataLoader worker",)
"""Words of an error from a rank's own helper processes: never a peer's echo, whatever follows (a
DataLoader worker refused by a data server, or gone while it handed its rank a batch)."""

SUMMARY_MAX = 2000
"""Characters of a summary a record keeps (a bad value in the store must not flood every console)."""
TRACEBACK_MARKS = ("Original Traceback (most recent call last):", "Traceback (most recent call last):")


def condense(text: str, limit: int = SUMMARY_MAX) -> str:
    """An error's text as a record's summary, at most ``limit`` characters (idempotent). A traceback
    inside the message (torch re-raises a DataLoader worker's error in its rank with the worker's
    traceback in it) becomes the error that ended it: ``Caught RuntimeError in DataLoader worker
    process 0: RuntimeError: unable to allocate shared memory(shm) ...``; a text still too long keeps
    its start and its end, where the error is. A peer's echo (:data:`ECHOES`) stays one."""
    short = _without_traceback(text)
    if looks_like_echo(text) and not looks_like_echo(short):
        short = text
    if len(short) <= limit:
        return short
    out = _clip(short, limit)
    phrase = next((p for p in ECHOES if p in short), None)
    return out if phrase is None or phrase in out else _clip(short, limit, phrase)


def _clip(text: str, limit: int, phrase: str | None = None) -> str:
    """``text``'s start and end, and between them how much was left out: ``limit`` characters."""
    head, dropped = limit // 4, len(text) - limit
    for _ in range(3):  # the marker's length depends on the count it gives
        marker = f" [... {dropped} characters{f' with {phrase!r}' if phrase else ''} ...] "
        if (dropped_now := len(text) - limit + len(marker)) == dropped:
            break
        dropped = dropped_now
    tail = limit - head - len(marker)
    return text[:head] + marker + text[len(text) - tail:]


def _without_traceback(text: str) -> str:
    """``text`` with a traceback after its first lines replaced by the error that ended it."""
    lines = text.splitlines()
    mark = next((i for i, line in enumerate(lines) if line.strip() in TRACEBACK_MARKS), None)
    if mark is None or mark == 0:
        return text
    rest = lines[mark + 1:]
    frames = [i for i, line in enumerate(rest) if line.startswith('  File "')]
    start = frames[-1] + 1 if frames else 0
    while start < len(rest) and rest[start].startswith("    "):  # the frame's code and its ^^^ marks
        start += 1
    error = [line for line in rest[start:] if line.strip()]
    if not error:
        return text
    head = " ".join(line.strip() for line in lines[:mark] if line.strip()).rstrip(".:")
    return f"{head}: " + "\n".join(error)


SIGKILL_HINT = ("killed by SIGKILL: the out-of-memory killer? see `dmesg` or the cgroup's memory.events "
                "(oom_kill; cgroup v1: memory.oom_control); or a scheduler that ended the job")


def sigkill_hint(oom_kills: tuple[int, int] | None) -> str:
    """Why a worker may have got SIGKILL, from the cgroup's oom_kill count (before, after; None: not
    readable, and the hint can only ask)."""
    if oom_kills is None:
        return SIGKILL_HINT
    before, after = oom_kills
    if after > before:
        return (f"the out-of-memory killer ended it (the cgroup's oom_kill count went {before} -> {after}): the "
                "node's processes needed more memory than the node or its container allows (smaller batches, "
                "fewer DataLoader workers, or a larger memory limit)")
    return (f"killed by SIGKILL, not by the out-of-memory killer (the cgroup's oom_kill count stayed {after}): "
            "a scheduler that ended the job (its time or memory limit, a preemption) or another process "
            "(kill -9); see the scheduler's log for the job")


@dataclass(frozen=True)
class FailureRecord:
    """One rank's failure. ``rank`` is the global rank (-1: a whole node, see ``node_rank``)."""

    kind: str
    rank: int
    summary: str
    node_rank: int = -1
    host: str = "?"
    local_rank: int = -1
    exit_code: int | None = None
    signal: str | None = None
    hint: str = ""
    cause_rank: int | None = None
    by: str = "worker"
    """``worker`` (first-hand), ``agent`` (its agent saw it die), or ``observer`` (another node saw it go)."""
    t: float = 0.0
    """Wall-clock time (s since the epoch) the record was made; orders causes across nodes."""
    cause: dict[str, Any] | None = None
    """For ``stopped``: the cause's own record, so that whoever holds this one knows the cause too
    (the store it came from may be gone)."""
    stop_step: str | None = None
    """For an agent's ``signal`` record: the job's answer to the preemption request as that agent
    knew it when it stopped its workers (protocol/preempt.py: a step, or ``NO_STEP``; None: no
    answer). Its peers may never read the answer in the store, which can go with that node."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureRecord:
        """The record in ``text``; ValueError when it is not one (wrong type, missing fields)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a failure record is a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FailureRecord:
        known = {f.name: f for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        if kw.get("kind") not in KINDS or not isinstance(kw.get("rank"), int) or not isinstance(kw.get("summary"), str):
            raise ValueError(f"not a failure record: {str(data)[:200]}")
        for name in ("node_rank", "local_rank"):
            if not isinstance(kw.get(name, -1), int):
                raise ValueError(f"{name} is not an integer")
        if not isinstance(kw.get("stop_step"), (str, type(None))):
            kw["stop_step"] = None  # a malformed value is no answer
        kw["summary"] = condense(kw["summary"])
        if kw.get("cause") is not None:
            kw["cause"] = asdict(cls.from_dict(kw["cause"])) if isinstance(kw["cause"], dict) else None
        return cls(**kw)

    @property
    def is_echo(self) -> bool:
        """Only a consequence of another failure: stopped by one, or a peer's connection error."""
        return self.kind == STOPPED or (self.kind == ERROR and looks_like_echo(self.summary))

    def how(self) -> str:
        """``was killed by SIGKILL`` / ``exited with code 3`` / ``failed``."""
        if self.kind == SIGNAL:
            return f"was {'stopped' if self.rank < 0 else 'killed'} by {self.signal or 'a signal'}"
        if self.kind == EXIT:
            return f"exited with code {self.exit_code}"
        if self.kind == LOST:
            return "was lost"
        if self.kind == STALL:
            return "found the job stalled"
        if self.kind == STOPPED:
            return "was stopped"
        if self.kind == FINISHED_FIRST:
            return "finished first"
        return "failed"

    def where(self) -> str:
        """``rank 1 (node 1, host-b)``, or ``node 1 (host-b)`` for a whole node."""
        if self.rank < 0:
            return f"node {self.node_rank} ({self.host})" if self.node_rank >= 0 else "the node hosting the job store"
        return f"rank {self.rank} (node {self.node_rank}, {self.host})"

    def headline(self) -> str:
        """One line for every console: where, how, and what it said."""
        text = f"{self.where()} {self.how()}"
        if self.summary and self.summary != self.how():
            text += f": {self.summary}"
        return text


def looks_like_echo(text: str) -> bool:
    """Whether an error text is what a rank sees when a peer died (module docstring); one that names
    the rank's own helper processes (:data:`OWN_PROCESSES`) is its own failure."""
    return any(p in text for p in ECHOES) and not any(p in text for p in OWN_PROCESSES)


def signal_name(exit_code: int) -> str:
    """``SIGKILL`` for -9 (a negative exit code is the signal that ended the process)."""
    try:
        return _signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def from_exit(rank: int, exit_code: int, *, node_rank: int, host: str, local_rank: int, t: float,
              oom_kills: tuple[int, int] | None = None) -> FailureRecord:
    """The agent's record of a worker that ended with ``exit_code`` and left no record of its own;
    ``oom_kills``: the cgroup's oom_kill count when the attempt started and after this exit (None: not
    readable), which says whether the out-of-memory killer ended a SIGKILLed worker."""
    if exit_code < 0:
        name = signal_name(exit_code)
        hint = sigkill_hint(oom_kills) if name == "SIGKILL" else ""
        return FailureRecord(SIGNAL, rank, "", node_rank, host, local_rank, exit_code, name, hint, by="agent", t=t)
    return FailureRecord(EXIT, rank, "the process ended without a Python error", node_rank, host, local_rank,
                         exit_code, by="agent", t=t)


FINISHED_FIRST_HINT = ("every rank must call the same collectives: a rank with fewer batches (uneven data per rank), "
                       "or one that skips a step, an evaluation or a barrier, leaves the others waiting for it (with "
                       "NCCL until its timeout). Give every rank the same number of batches (DistributedSampler with "
                       "drop_last=True), or let ddprun.fit shard the data")


def finished_first(end: CleanEnd) -> FailureRecord:
    """The cause a rank whose peer went away names when that peer's script had ended cleanly: the
    same record from every rank that names it (from the same :class:`CleanEnd`)."""
    return FailureRecord(FINISHED_FIRST, end.rank, f"its script ended (exit 0) after {end.steps} optimizer steps "
                         "while another rank still waited for it in a collective", end.node_rank, end.host,
                         end.local_rank, 0, hint=FINISHED_FIRST_HINT, by="observer", t=end.t)


@dataclass(frozen=True)
class CleanEnd:
    """The first rank of an attempt whose script ended by itself with exit 0 (``first-end`` in the job
    store, the first writer's): how many optimizer steps it made, and when (s since the epoch)."""

    rank: int
    node_rank: int
    host: str
    local_rank: int
    steps: int
    t: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def parse(cls, raw: str | bytes | None) -> CleanEnd | None:
        """The end in ``raw``; None when it is empty or not one (a bad value is never trusted)."""
        try:
            d = json.loads(raw) if raw else None
            if not isinstance(d, dict):
                return None
            end = cls(int(d["rank"]), int(d["node_rank"]), str(d["host"]), int(d["local_rank"]), int(d["steps"]),
                      float(d["t"]))
        except (ValueError, TypeError, KeyError):
            return None
        return end if end.rank >= 0 else None


def parse_many(raw: Iterable[str | bytes]) -> list[FailureRecord]:
    """The well-formed records among ``raw``; the rest are skipped (a bad value never breaks a reader)."""
    out = []
    for text in raw:
        try:
            out.append(FailureRecord.from_json(text))
        except (ValueError, TypeError):
            continue
    return out


def _order(r: FailureRecord) -> tuple[bool, bool, bool, float, int]:
    # a rank that finished first is an inference from an echo: any record seen first-hand outranks it
    # (a node lost in a job whose ranks may end at different times, say), whenever it arrives
    return (r.is_echo, r.kind == FINISHED_FIRST, r.kind == LOST and r.by == "observer", r.t, r.rank)


def with_causes(records: Iterable[FailureRecord]) -> list[FailureRecord]:
    """``records`` and the causes the stopped ones carry."""
    out = []
    for r in records:
        out.append(r)
        if r.cause is not None:
            try:
                out.append(FailureRecord.from_dict(r.cause))
            except (ValueError, TypeError):
                continue
    return out


def answer_in(records: Iterable[FailureRecord]) -> str | None:
    """The answer to the preemption request that an agent's ``signal`` record carries
    (``stop_step``), itself or as the cause a stopped rank's record holds; None where none does."""
    return next((r.stop_step for r in with_causes(records)
                 if r.kind == SIGNAL and r.rank < 0 and r.stop_step is not None), None)


def root_cause(records: Iterable[FailureRecord]) -> FailureRecord | None:
    """The failure that ended the job: first-hand before echoes (and before a rank inferred to have
    finished first), then the earliest (then lowest rank). Causes carried by stopped records count too."""
    records = with_causes(records)
    return min(records, key=_order) if records else None




def stopped_by(cause: FailureRecord, *, rank: int, node_rank: int, host: str, local_rank: int, t: float,
               seen: str = "") -> FailureRecord:
    """The record of a rank ended because of ``cause`` (``seen``: what it saw itself, e.g. a reset)."""
    carried = asdict(replace(cause, cause=None))
    return FailureRecord(STOPPED, rank, seen, node_rank, host, local_rank, cause_rank=cause.rank, t=t, cause=carried)

