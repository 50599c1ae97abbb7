"""How fit splits a step's time, without adding a collective or a device sync.

All-reduce time is measured through a DDP communication hook that is numerically DDP's default
(``default_hooks.allreduce_hook``: divide by the world size, then all-reduce) and notes when the
last bucket's all-reduce was launched. Gradients are ready bucket by bucket during backward, so
the time from that launch until ``backward()`` returns is the time this rank was blocked waiting
for the reduction to finish (on slower peers, or the network). Forward + backward before it is
compute. On CUDA these are host times: kernels still queued are counted where the host waits for
them (at the all-reduce or at the next step), not where they run.
"""

from __future__ import annotations

import time
from typing import Any


class AllReduceClock:
    """The launch time of the latest bucket's all-reduce (``time.perf_counter`` seconds)."""

    def __init__(self) -> None:
        self.last_launch: float | None = None

    def hook(self, process_group, bucket):  # unannotated: DDP checks the annotations it finds
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.last_launch = time.perf_counter()
        return default_hooks.allreduce_hook(process_group, bucket)


def install(ddp: Any) -> AllReduceClock:
    """Register the timed all-reduce on a DistributedDataParallel module."""
    clock = AllReduceClock()
    ddp.register_comm_hook(None, clock.hook)
    return clock


def split_backward(t_start: float, t_end: float, clock: AllReduceClock | None) -> tuple[float, float]:
    """(compute, blocked in all-reduce) of a forward+backward that ran from t_start to t_end."""
    launch = clock.last_launch if clock is not None else None
    if launch is None or not t_start <= launch <= t_end:
        return t_end - t_start, 0.0
    return launch - t_start, t_end - launch
