"""What :func:`ddprun.train.loop.fit_module` is asked to do: :class:`FitOptions`, checked where it is built.

Every check here needs no process group, so a bad argument fails on every rank alike (ConfigError
with a HINT) before any collective. The helpers are public for ``ddprun.lightning``, which checks
the same numbers and precisions for a LightningModule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ddprun.errors import ConfigError
from ddprun.train.resume import check_resume

PRECISIONS = {"32": "32", "32-true": "32", "bf16": "bf16", "bf16-mixed": "bf16", "16": "16", "16-mixed": "16"}
"""Accepted precision -> fit's own name ("32", "bf16", "16"); Lightning's names are accepted too."""


def int_at_least(name: str, value: Any, low: int, *, optional: bool = False) -> None:
    """ConfigError unless ``value`` is an int (not a bool) >= ``low``, or None when ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}" + (" or None." if optional else "."),
                          seen=f"{name}={value!r}", hint=f"Give e.g. {name}={max(low, 1)}.")


SEED_LIMIT = 2**63
"""seed is below this: torch generators take up to 2**64 - 1 and are seeded with seed + epoch (the
sampler) and seed + rank (the DataLoader workers), so a seed just under 2**64 would fail mid-run."""


def check_seed(value: Any) -> None:
    """ConfigError unless ``value`` is an int (not a bool) in ``0 <= value < SEED_LIMIT``."""
    int_at_least("seed", value, 0)
    if value >= SEED_LIMIT:
        raise ConfigError("seed must be an integer >= 0 and < 2**63.", seen=f"seed={value!r}",
                          hint="Give e.g. seed=0; torch seeds its generators with seed + epoch and seed + rank.")


def check_callable(name: str, value: Any, signature: str) -> None:
    """ConfigError unless ``value`` is None or callable."""
    if value is not None and not callable(value):
        raise ConfigError(f"{name} must be a callable {signature}.", seen=f"{name}: {type(value).__name__}",
                          hint=f"Pass a function or lambda: {signature}.")


@dataclass(frozen=True)
class FitOptions:
    """fit's arguments for an ``nn.Module`` (``ddprun.fit``'s docstring says what each one means).

    Build it with :meth:`build`: checked, ``precision`` normalised, ``epochs`` resolved.
    """

    loss_fn: Callable | None = None
    """``(outputs, targets) -> scalar``; exactly one of loss_fn and training_step."""
    training_step: Callable | None = None
    """``(model, batch) -> scalar loss``."""
    optimizer: Callable | torch.optim.Optimizer | None = None
    """A factory ``params -> Optimizer``, or an Optimizer; None: AdamW(lr=1e-3)."""
    scheduler: Callable | None = None
    """A factory ``optimizer -> scheduler``, stepped once per optimizer step."""
    epochs: int | None = None
    """Passes over train_data. After :meth:`build`: None only when max_steps bounds the run."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (None: at the end of ``epochs``)."""
    batch_size: int = 32
    """Samples per rank per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    precision: str = "32"
    """After :meth:`build`: "32", "bf16" or "16"."""
    grad_clip: float | None = None
    """Max total gradient norm (after unscaling), or None."""
    seed: int = 0
    """The sampler's shuffle seed; plus the rank, the DataLoader workers' seed."""
    num_workers: int | None = None
    """DataLoader workers per rank (None: ddprun's default)."""
    val_metrics: Mapping[str, Callable] | None = None
    """Name -> ``(outputs, targets) -> value(s)``, reported as ``val_<name>``."""
    checkpoint_dir: str | None = None
    """None: run_dir/checkpoints."""
    run_dir: str | None = None
    """None: $DDPRUN_RUN_DIR, else runs/<timestamp>."""
    log_every: int = 50
    """Steps per metrics.csv row and progress line (rank 0)."""
    step_timing: bool = True
    """Time each step's parts for the straggler detector and the report."""
    checkpoint_every: int | None = None
    """Also save every this many optimizer steps (None: only at the end)."""
    keep_checkpoints: int = 3
    """Checkpoints kept, the newest."""
    resume: bool | str = "auto"
    """'auto', True, False, or a checkpoint file or directory."""
    on_checkpoint: Callable[[Any], None] | None = None
    """Called with a :class:`~ddprun.train.loop.CheckpointSaved` after every checkpoint."""

    @classmethod
    def build(cls, model: Any, **kwargs: Any) -> FitOptions:
        """Options from fit's keyword arguments, checked against ``model`` (TypeError for an unknown
        keyword, ConfigError for a bad value; the checks run in fit's documented order)."""
        options = cls(**kwargs)
        precision = _check_args(model, options)
        int_at_least("checkpoint_every", options.checkpoint_every, 1, optional=True)
        int_at_least("keep_checkpoints", options.keep_checkpoints, 1)
        check_callable("on_checkpoint", options.on_checkpoint, "(CheckpointSaved) -> None")
        check_resume(options.resume)
        epochs = options.epochs
        if epochs is None:
            epochs = 1 if options.max_steps is None else None
        return replace(options, precision=precision, epochs=epochs)


def _check_args(model: Any, o: FitOptions) -> str:
    """The model and the step's arguments; returns the normalised precision."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ConfigError("fit() got a model already wrapped in DistributedDataParallel.",
                          seen=f"model: DistributedDataParallel({type(model.module).__name__})",
                          hint="Pass the plain module (model.module); fit() wraps it when world_size > 1.")
    if not isinstance(model, nn.Module):
        raise ConfigError("fit() trains a torch.nn.Module.", seen=f"model: {type(model).__name__}",
                          hint="Pass an nn.Module (a LightningModule goes through ddprun's Lightning adapter).")
    if o.training_step is None and o.loss_fn is None:
        raise ConfigError("fit() needs a way to compute the loss.", seen="loss_fn=None, training_step=None",
                          hint="Give loss_fn=torch.nn.functional.cross_entropy (batches of (inputs, targets)), "
                               "or training_step=lambda model, batch: <scalar loss>.")
    if o.training_step is not None and o.loss_fn is not None:
        raise ConfigError("fit() got both loss_fn and training_step.", seen="loss_fn and training_step both given",
                          hint="Give one: training_step computes the loss itself (it may call your loss_fn).")
    check_callable("loss_fn", o.loss_fn, "(outputs, targets) -> scalar loss")
    check_callable("training_step", o.training_step, "(model, batch) -> scalar loss")
    if not isinstance(o.optimizer, torch.optim.Optimizer):
        check_callable("optimizer", o.optimizer, "params -> torch.optim.Optimizer")
    check_callable("scheduler", o.scheduler, "optimizer -> LR scheduler")
    _check_numbers(o)
    key = str(o.precision)
    if key not in PRECISIONS:
        raise ConfigError("Unknown precision.", seen=f"precision={o.precision!r}",
                          hint="Use '32' (default), 'bf16' (autocast to bfloat16) or '16' (float16, CUDA only).")
    return PRECISIONS[key]


def _check_numbers(o: FitOptions) -> None:
    int_at_least("epochs", o.epochs, 1, optional=True)
    int_at_least("max_steps", o.max_steps, 1, optional=True)
    int_at_least("batch_size", o.batch_size, 1)
    int_at_least("grad_accum", o.grad_accum, 1)
    int_at_least("log_every", o.log_every, 1)
    check_seed(o.seed)
    int_at_least("num_workers", o.num_workers, 0, optional=True)
    grad_clip = o.grad_clip
    if grad_clip is not None and (isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float))
                                  or not grad_clip > 0):
        raise ConfigError("grad_clip must be a positive max gradient norm, or None.", seen=f"grad_clip={grad_clip!r}",
                          hint="e.g. grad_clip=1.0.")
    val_metrics = o.val_metrics
    if val_metrics is not None:
        if not isinstance(val_metrics, Mapping) or not all(isinstance(k, str) and callable(f)
                                                           for k, f in val_metrics.items()):
            raise ConfigError("val_metrics must map names to callables (outputs, targets) -> value(s).",
                              seen=f"val_metrics: {val_metrics!r}",
                              hint="e.g. val_metrics={'accuracy': lambda out, y: (out.argmax(1) == y).float()}.")
