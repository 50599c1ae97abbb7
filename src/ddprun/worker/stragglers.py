"""Straggler detection over sliding windows of per-rank step timings (pure; rank 0 runs it).

A rank is named when one of its timings exceeds the median of the OTHER ranks by more than
``margin`` (relative) and ``min_abs_s`` (absolute, so that microsecond noise on tiny steps never
counts) in ``k`` consecutive windows. Each (rank, what) pair is named at most once per
``repeat_after_s``. In synchronous DDP every rank's step interval is the same (they meet in the
all-reduce), so the slow part shows in the components: a rank starved of data has a long data
wait, a slow GPU a long compute time, while the others wait longer in the all-reduce.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

WHAT = {"data": "data wait", "compute": "compute (forward+backward)", "optim": "optimizer step",
        "step": "step time"}


@dataclass
class StragglerEvent:
    rank: int
    host: str
    what: str
    value_s: float
    median_s: float
    window: int

    @property
    def slower_pct(self) -> float:
        return 100.0 * (self.value_s / self.median_s - 1.0) if self.median_s > 0 else float("inf")

    def message(self) -> str:
        if self.median_s <= 0:
            how = "much slower"
        elif self.value_s >= 2 * self.median_s:  # "153x" reads better than "15208%"
            how = f"{self.value_s / self.median_s:.0f}x slower"
        else:
            how = f"{self.slower_pct:.0f}% slower"
        return (f"rank {self.rank} ({self.host}) is {how}: {WHAT[self.what]} "
                f"{self.value_s * 1e3:.1f} ms vs {self.median_s * 1e3:.1f} ms median of the other ranks")


def median_without(ordered: list[float], value: float) -> float:
    """The median of ``ordered`` (sorted, ``value`` among them) with one ``value`` left out: what
    ``statistics.median`` of the others gives, in O(log n) instead of O(n log n) per rank (rank 0
    compares every rank each window: at 8,192 ranks the quadratic way took seconds a window)."""
    i = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(j: int) -> float:  # the j-th of the others
        return ordered[j] if j < i else ordered[j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


@dataclass
class StragglerDetector:
    margin: float = 0.2
    k: int = 3
    min_abs_s: float = 0.005
    repeat_after_s: float = 300.0
    metrics: tuple[str, ...] = ("data", "compute", "optim", "step")
    _streak: dict[tuple[int, str], int] = field(default_factory=dict)
    _last_named: dict[tuple[int, str], float] = field(default_factory=dict)
    window: int = 0

    def update(self, summaries: Mapping[int, Mapping[str, float]], hosts: Mapping[int, str],
               now: float) -> list[StragglerEvent]:
        """Feed one window (rank -> medians of its fields); return the ranks to name now."""
        self.window += 1
        events = []
        for metric in self.metrics:
            values = {r: s[metric] for r, s in summaries.items() if metric in s}
            if len(values) < 2:
                continue
            ordered = sorted(values.values())
            for rank, value in values.items():
                others = median_without(ordered, value)
                key = (rank, metric)
                slow = value > others * (1 + self.margin) and value - others > self.min_abs_s
                self._streak[key] = self._streak.get(key, 0) + 1 if slow else 0
                if self._streak[key] >= self.k and now - self._last_named.get(key, -1e18) >= self.repeat_after_s:
                    self._last_named[key] = now
                    events.append(StragglerEvent(rank, hosts.get(rank, "?"), metric, value, others, self.window))
        # one message per rank: its first slow part (data before compute before the whole step)
        first: dict[int, StragglerEvent] = {}
        for e in events:
            first.setdefault(e.rank, e)
        return list(first.values())


class StragglerWatch:
    """Rank 0's side: each window, read every rank's latest timing (one batched read), append the new
    ones to timings.csv, and name stragglers on the console and in events.jsonl.

    timings.csv keeps every window until ROWS_PER_STRIDE rows are written, then every 2nd window for
    as many rows, then every 4th, ...: its size grows with the log of the run's length, not with it
    (one row a rank every 2 s is 1 GB an hour at 8,192 ranks, and the report loads the file whole).
    Detection reads every window either way."""

    ROWS_PER_STRIDE = 200_000
    """About 13 MB of rows at each stride."""

    def __init__(self, run_dir: str, margin: float, windows: int):
        from ddprun.protocol.rundir import RunDir

        self.rundir = RunDir(run_dir)
        self.detector = StragglerDetector(margin=margin, k=windows)
        self._seen: dict[int, int] = {}
        self._said_write_error = False
        self._reads = 0  # reads that brought fresh windows
        self._stride = 1  # of those, every stride-th is written to timings.csv
        self._rows_at_stride = 0

    def fresh(self, values: Mapping[int, object]) -> dict[int, dict]:
        """The windows not seen before among rank -> parsed timing values (malformed ones skipped)."""
        out = {}
        for rank, summary in values.items():
            if not isinstance(summary, dict) or not isinstance(summary.get("w"), int):
                continue
            if summary["w"] != self._seen.get(rank):
                self._seen[rank] = summary["w"]
                out[rank] = summary
        return out

    def update(self, values: Mapping[int, object], hosts: Mapping[int, str], now: float) -> list[str]:
        """Feed one read; returns the console lines it printed (also appended to events.jsonl)."""
        import json
        import sys
        import time

        from ddprun.report import TIMING_COLUMNS

        fresh = self.fresh(values)
        if not fresh:
            return []
        if self._kept():
            self._write_rows(fresh, TIMING_COLUMNS)
        if len(fresh) < 2:
            return []
        lines = []
        for event in self.detector.update(fresh, hosts, now):
            msg = f"ddprun: straggler: {event.message()}"
            print(msg, file=sys.stderr, flush=True)
            lines.append(msg)
            try:
                with open(self.rundir.events_jsonl, "a") as fp:
                    fp.write(json.dumps({"kind": "straggler", "t": time.time(), "rank": event.rank,
                                         "host": event.host, "what": event.what, "value_s": event.value_s,
                                         "median_s": event.median_s, "window": fresh[event.rank]["w"],
                                         "message": event.message()}) + "\n")
            except OSError as e:
                self._cannot_write(self.rundir.events_jsonl, e)
        return lines

    def _kept(self) -> bool:
        """Whether this read's windows go to timings.csv (the class docstring's thinning)."""
        self._reads += 1
        if self._rows_at_stride >= self.ROWS_PER_STRIDE:
            self._stride, self._rows_at_stride = self._stride * 2, 0
        return (self._reads - 1) % self._stride == 0

    def _write_rows(self, fresh: Mapping[int, dict], columns: tuple[str, ...]) -> None:
        import os

        path = self.rundir.timings_csv
        try:
            new_file = not os.path.exists(path)
            with open(path, "a") as fp:
                if new_file:
                    fp.write(",".join(columns) + "\n")
                for r, s in sorted(fresh.items()):
                    row = {**s, "rank": r, "window": s["w"]}
                    fp.write(",".join("" if row.get(c) is None else str(row[c]) for c in columns) + "\n")
            self._rows_at_stride += len(fresh)
        except OSError as e:  # a full disk: the detection goes on (the monitor's poll must not fail of it)
            self._cannot_write(path, e)

    def _cannot_write(self, path: str, e: OSError) -> None:
        """Say once that the run dir refuses a write (the lines still reach the console)."""
        import sys

        if not self._said_write_error:
            self._said_write_error = True
            print(f"ddprun: could not write {path} ({e.strerror or e}); step timings and straggler events may be "
                  "missing from the run directory (the console has the straggler lines)", file=sys.stderr, flush=True)
