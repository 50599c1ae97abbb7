"""Counting progress in every worker (telemetry.PROGRESS): torch's global optimizer step hook, a thin
wrapper around torch.distributed's collectives that counts each one that returns, and DDP's forward.

Installed once by the worker bootstrap before the user's code imports anything, so unmodified scripts
are covered, evaluation loops (an all_reduce of metrics and no optimizer step) included. The wrapper
adds one integer increment per collective call; it adds no collective and does not touch DDP's own
gradient all-reduce (which runs in C++ and is counted by the optimizer steps that follow it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from ddprun.preempt import PREEMPT, at_optimizer_step
from ddprun.telemetry import PROGRESS, TIMER

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
               "monitored_barrier", "send", "recv")


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:  # noqa: ARG001 - torch's hook signature
    PROGRESS.stepped(time.monotonic())
    TIMER.on_optimizer_step()
    if PREEMPT.stop_step is not None:  # the job's agreed stop step (ddprun.preempt): outside fit, stop here
        at_optimizer_step(PROGRESS.steps)


def _counting(fn: Callable[..., Any], count: Callable[[], None]) -> Callable[..., Any]:
    """``fn`` that calls ``count`` (a PROGRESS method) each time it returns."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        count()
        return out

    wrapper._ddprun_counted = True  # type: ignore[attr-defined]
    return wrapper


def install() -> None:
    """Hook the optimizer steps and wrap the collectives (idempotent)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if getattr(install, "_done", False):
        return
    register_optimizer_step_post_hook(_on_optimizer_step)
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_ddprun_counted", False):
            continue
        wrapped = _counting(original, PROGRESS.collected)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    _count_ddp_forward()
    install._done = True  # type: ignore[attr-defined]


def _count_ddp_forward() -> None:
    """Each DDP forward counts too: a loop that updates parameters by hand (no torch.optim) makes no
    optimizer step, and DDP's gradient all-reduce runs in C++, past the collective wrappers."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP.forward
    if getattr(original, "_ddprun_counted", False):
        return
    DDP.forward = _counting(original, PROGRESS.forwarded)  # type: ignore[method-assign]
