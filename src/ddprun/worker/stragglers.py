"""Straggler detection over sliding windows of per-rank step timings (pure; rank 0 runs it).

A rank is named when one of its timings exceeds the median of the OTHER ranks by more than
``margin`` (relative) and ``min_abs_s`` (absolute, so that microsecond noise on tiny steps never
counts) in ``k`` consecutive windows. Each (rank, what) pair is named at most once per
``repeat_after_s``. In synchronous DDP every rank's step interval is the same (they meet in the
all-reduce), so the slow part shows in the components: a rank starved of data has a long data
wait, a slow GPU a long compute time, while the others wait longer in the all-reduce.
"""

from __future__ import annotations

import statistics
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
            for rank, value in values.items():
                others = statistics.median(v for r, v in values.items() if r != rank)
                key = (rank, metric)
                slow = value > others * (1 + self.margin) and value - others > self.min_abs_s
                self._streak[key] = self._streak.get(key, 0) + 1 if slow else 0
                if self._streak[key] >= self.k and now - self._last_named.get(key, -1e18) >= self.repeat_after_s:
                    self._last_named[key] = now
                    events.append(StragglerEvent(rank, hosts.get(rank, "?"), metric, value, others, self.window))
        # one message per rank: its first slow part (data before compute before the whole step)
        seen: set[int] = set()
        return [e for e in events if not (e.rank in seen or seen.add(e.rank))]
