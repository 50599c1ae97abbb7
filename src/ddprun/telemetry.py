"""Per-rank step timing, recorded in the worker and summarised per window for the job channel.

``ddprun.fit`` records each step split into data wait (blocked on the next batch), forward +
backward compute, time blocked in the gradient all-reduce, and the optimizer step. For unmodified
scripts the optimizer step hook records the interval between steps only. Recording appends one
tuple to a list (no collective, no I/O); the job channel's monitor thread drains it every window
and publishes the medians through the store (the same channel as the watchdog's progress).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator

FIELDS = ("step", "data", "compute", "allreduce", "optim")
"""Seconds per step: interval, data wait, forward+backward, blocked in all-reduce, optimizer."""


MAX_RECORDS = 10_000
"""Step records a :class:`StepTimer` holds at most: a ddprun worker's monitor drains them every 2 s
(10,000 steps of 0.2 ms); where nothing drains them (ddprun.fit under torchrun, srun, plain python)
the oldest go, and memory stays bounded however long the run."""


class StepTimer:
    """Step records of this process. ``detailed`` is set by fit so the optimizer hook stays quiet."""

    def __init__(self) -> None:
        self._records: deque[tuple[float, ...]] = deque(maxlen=MAX_RECORDS)
        self._lock = threading.Lock()
        self.detailed = False
        self._last_hook_t: float | None = None

    def record(self, step: float, data: float = math.nan, compute: float = math.nan,
               allreduce: float = math.nan, optim: float = math.nan) -> None:
        with self._lock:
            self._records.append((step, data, compute, allreduce, optim))

    def on_optimizer_step(self) -> None:
        """From torch's global optimizer step hook: the step interval, when fit is not timing."""
        now = time.perf_counter()
        if not self.detailed and self._last_hook_t is not None:
            self.record(now - self._last_hook_t)
        self._last_hook_t = now

    def drain(self) -> list[tuple[float, ...]]:
        with self._lock:
            out, self._records = list(self._records), deque(maxlen=MAX_RECORDS)
        return out


TIMER = StepTimer()


def summarize(records: list[tuple[float, ...]]) -> dict[str, float] | None:
    """Median of each field over a window's records (NaN fields left out); None for no records."""
    if not records:
        return None
    out: dict[str, float] = {"n": float(len(records))}
    for i, name in enumerate(FIELDS):
        values = [r[i] for r in records if not math.isnan(r[i])]
        if values:
            out[name] = statistics.median(values)
    return out


class Progress:
    """Proof that this process is alive, counted without I/O: optimizer steps, completed
    collectives and heartbeats (``ddprun.heartbeat()``, ddprun.fit's validation and checkpoints).

    The worker's monitor publishes ``total`` through the store; the stall observers compare totals.
    ``steps`` alone is what the hang report shows as the rank's step.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.collectives = 0
        self.beats = 0
        self.phase = ""
        """What the process says it is doing (``validation``, ``checkpoint``, ...); "" = training or unknown."""
        self.busy_since: float | None = None
        """Set while a :func:`busy` phase runs: the monitor thread beats for it (within a bound)."""
        self.step_at = 0.0
        """time.monotonic() of the latest optimizer step (0: none yet)."""
        self.step_s = 0.0
        """Seconds between the two latest optimizer steps (0: fewer than two)."""
        self.forwards = 0
        """DDP forwards that returned (also counted in ``collectives``)."""
        self.began = False
        """Whether this process's own loop runs: an optimizer step, or outside :func:`setup_phase` a
        second DDP forward (its first backward's all-reduce is done), a collective, or :func:`heartbeat`.
        Setup (init's probe, fit's broadcast of the run directory, a resume, Lightning's barriers and
        sanity check) does not say so: the first batch may still be far off."""
        self.in_setup = 0
        """Setup phases now open (:func:`setup_phase`, :class:`SetupPhase`)."""
        self._loop_forwards = 0

    def stepped(self, now: float) -> None:
        """One optimizer step done at ``now`` (the optimizer step hook, worker/progress.py)."""
        if self.step_at:
            self.step_s = now - self.step_at
        self.step_at = now
        self.steps += 1
        self.began = True

    def collected(self) -> None:
        """One torch.distributed collective returned (worker/progress.py)."""
        self.collectives += 1
        self.began = self.began or not self.in_setup

    def forwarded(self) -> None:
        """One DDP forward returned (worker/progress.py)."""
        self.forwards += 1
        self.collectives += 1
        if not self.in_setup:
            self._loop_forwards += 1
            self.began = self.began or self._loop_forwards > 1

    def beat(self) -> None:
        """One :func:`heartbeat`."""
        self.beats += 1
        self.began = self.began or not self.in_setup

    def restart(self) -> None:
        """Another loop's setup starts (a Lightning fit after ``trainer.validate`` or another fit): the
        loop has not begun until its own start, by the rules of :attr:`began`."""
        self.began = False
        self._loop_forwards = 0

    @property
    def total(self) -> int:
        return self.steps + self.collectives + self.beats


PROGRESS = Progress()


_PHASES = threading.Lock()
"""Guards ``in_setup``: a dropped Trainer's phase ends in whichever thread collects it."""


class SetupPhase:
    """A setup phase (:func:`setup_phase`) that spans hooks: open from its creation until :meth:`end`.
    ddprun.lightning opens one when a Trainer is built and ends it at its first training batch."""

    def __init__(self) -> None:
        self._progress = PROGRESS  # the one it opened in, however late it ends (a Trainer's collection)
        with _PHASES:
            self._progress.in_setup += 1
            self._open = True

    @property
    def ended(self) -> bool:
        return not self._open

    def end(self) -> None:
        """Close the phase (once; later calls do nothing)."""
        with _PHASES:
            if self._open:
                self._open = False
                self._progress.in_setup -= 1


@contextlib.contextmanager
def setup_phase() -> Iterator[None]:
    """Work before a loop (``ddprun.init``'s probe, ``ddprun.fit``'s setup and resume): its collectives,
    DDP forwards and heartbeats are progress, but not the loop's start, so the stall watch keeps its
    longer first-step bound (worker/monitor.py ``stall_threshold``) while every rank waits for its
    first batch. Only an optimizer step begins the loop inside it."""
    phase = SetupPhase()
    try:
        yield
    finally:
        phase.end()


@contextlib.contextmanager
def busy(phase: str) -> Iterator[None]:
    """A phase that proves nothing by itself for a while (a checkpoint write, a validation pass):
    the worker's monitor thread beats for it, at most ``4 x --stall-timeout`` (worker/monitor.py,
    protocol/defaults.py ``BUSY_LIMIT_FACTOR``; ranks waiting for another's phase wait as long), so a
    long but healthy phase is not a stall and a phase that hangs still is."""
    previous, since = PROGRESS.phase, PROGRESS.busy_since
    PROGRESS.phase, PROGRESS.busy_since = phase, time.monotonic()
    try:
        yield
    finally:
        PROGRESS.phase, PROGRESS.busy_since = previous, since
        PROGRESS.beats += 1


def heartbeat(phase: str | None = None) -> None:
    """Tell ddprun's stall watchdog this process is making progress (e.g. once per evaluation batch,
    or around a long save): a job whose ranks all beat is never reported as stalled. Cheap (an integer
    increment, no I/O, no collective); safe to call outside a ddprun job. ``phase`` names the work in the
    hang report (``None`` keeps the current one, ``""`` clears it)."""
    PROGRESS.beat()
    if phase is not None:
        PROGRESS.phase = phase
