"""How fit splits a step's time, without adding a collective, a device sync or changing DDP.

DDP all-reduces gradients bucket by bucket while backward still runs; the last bucket holds the
first layers, whose gradients backward computes last. A post-accumulate-grad hook on the first
parameters in model order (the first two: a weight and its bias) notes when those gradients are
ready, i.e. when this rank's compute of the step ended. The time from then until ``backward()``
returns is the time this rank was blocked waiting for the reduction (on slower peers, or the
network); forward + backward before it is compute. DDP keeps its built-in C++ all-reduce: the
hooks only read the clock (one Python call per hooked parameter per backward). On CUDA these are
host times: kernels still queued are counted where the host waits for them.
"""

from __future__ import annotations

import time
from typing import Any

HOOKED_PARAMS = 2


class GradReadyClock:
    """When the hooked (earliest-layer) gradients of the current backward were last ready."""

    def __init__(self) -> None:
        self.ready: float | None = None

    def _hook(self, param) -> None:  # noqa: ARG002 - torch's hook signature
        self.ready = time.perf_counter()


def install(module: Any) -> GradReadyClock:
    """Hook the first parameters (model order) of ``module`` that get gradients."""
    clock = GradReadyClock()
    params = [p for p in module.parameters() if p.requires_grad][:HOOKED_PARAMS]
    for p in params:
        p.register_post_accumulate_grad_hook(clock._hook)
    return clock


def split_backward(t_start: float, t_end: float, clock: GradReadyClock | None, synced: bool) -> tuple[float, float]:
    """(compute, blocked in all-reduce) of a forward+backward that ran from t_start to t_end;
    a micro-batch under ``no_sync`` (``synced=False``) reduces nothing: all compute."""
    ready = clock.ready if clock is not None else None
    if not synced or ready is None or not t_start <= ready <= t_end:
        return t_end - t_start, 0.0
    return ready - t_start, t_end - ready
