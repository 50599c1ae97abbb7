"""``ddprun.fit``: one entry point for both training paths.

A plain ``nn.Module`` goes to :func:`ddprun.train.loop.fit_module`, a ``lightning.pytorch``
LightningModule to :func:`ddprun.lightning.fit_lightning`. The dispatch lives here, above both, so
that ``ddprun.train`` never imports lightning and ``ddprun.lightning`` never imports this module.
Telling the two apart imports nothing: without ``lightning.pytorch`` in ``sys.modules`` no
LightningModule exists.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddprun.errors import ConfigError
from ddprun.train.loop import CheckpointSaved, FitResult, fit_module

__all__ = ["CheckpointSaved", "FitResult", "fit", "is_lightning_module", "lightning_package"]


LIGHTNING_PACKAGES = {"lightning.pytorch": "ddprun.lightning", "pytorch_lightning": "ddprun.pytorch_lightning"}
"""Each Lightning package ddprun drives -> the ddprun module that drives it."""


def lightning_package(model: Any) -> str | None:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"`` when ``model`` is that package's
    LightningModule, else None. Imports neither: a package not yet imported has no LightningModule."""
    for package in LIGHTNING_PACKAGES:
        lit = sys.modules.get(package)
        if lit is not None and isinstance(model, getattr(lit, "LightningModule", ())):
            return package
    return None


def is_lightning_module(model: Any) -> bool:
    """Whether ``model`` is a LightningModule of either package (see :func:`lightning_package`)."""
    return lightning_package(model) is not None


def fit(model: nn.Module, train_data: Any = None, *, val_data: Any = None, loss_fn: Callable | None = None,
        training_step: Callable | None = None, optimizer: Callable | torch.optim.Optimizer | None = None,
        scheduler: Callable | None = None, epochs: int | None = None, max_steps: int | None = None,
        batch_size: int = 32, grad_accum: int = 1, precision: str = "32", grad_clip: float | None = None,
        seed: int = 0, num_workers: int | None = None, val_metrics: Mapping[str, Callable] | None = None,
        checkpoint_dir: str | None = None, run_dir: str | None = None, log_every: int = 50, step_timing: bool = True,
        checkpoint_every: int | None = None, keep_checkpoints: int = 3, resume: bool | str = "auto",
        datamodule: Any = None, trainer_kwargs: Mapping[str, Any] | None = None,
        on_checkpoint: Callable[[CheckpointSaved], None] | None = None) -> FitResult:
    """Train ``model`` data-parallel over every rank of the job (one process: no process group).

    A ``lightning.pytorch.LightningModule`` goes to :func:`ddprun.lightning.fit_lightning`, which
    drives a Lightning Trainer configured from the launch; ``datamodule`` (a LightningDataModule, in
    place of train_data/val_data) and ``trainer_kwargs`` (more Trainer arguments) are for that path
    only. The rest of this docstring is the nn.Module path.

    Data:
      train_data, val_data: a torch ``Dataset`` (fit builds the DataLoader) or a ``DataLoader``
        (rebuilt around fit's resumable DistributedSampler where its order allows; one with a
        sampler of its own is kept in one process, replaced with a warning in several: the rules
        are :func:`ddprun.train.data.build_train_loader`'s). Training batches:
        DistributedSampler(shuffle=True, seed=seed, drop_last=False), ``set_epoch`` every epoch.
        Validation: each sample once, no padding.
      batch_size: samples per rank per micro-batch; the global batch is
        ``batch_size * world_size * grad_accum``. A DataLoader's own batch size wins; one with
        ``batch_size=None`` (automatic batching off: its dataset's items are whole batches) keeps
        it on every rank, each item a micro-batch.
      num_workers: DataLoader workers per rank, at most CPUs // processes on this node; None =
        min(2, that), 0 for a TensorDataset or an IterableDataset (each worker would read all of
        it: :func:`ddprun.train.data.choose_num_workers`). Workers start by forkserver, so the
        dataset must be picklable; their RNG is seeded from ``seed + rank``.

    The step:
      loss_fn: ``(outputs, targets) -> scalar`` for batches ``(inputs, targets)``; or
      training_step: ``(model, batch) -> scalar loss``. It gets the DDP-wrapped model while
        training (call it; don't go through ``.module``) and the plain module in validation.
      optimizer: a factory ``params -> Optimizer`` (default AdamW, lr 1e-3); an Optimizer over the
        model's parameters is accepted too. scheduler: a factory ``optimizer -> scheduler``,
        stepped once per optimizer step, without arguments.
      grad_accum: micro-batches per optimizer step; gradients are all-reduced only on the last one
        (``no_sync`` before); each micro-batch loss is divided by the group's size.
      precision: "32"; "bf16" (autocast to bfloat16, CUDA or CPU); "16" (float16 autocast with a
        GradScaler, CUDA only). Lightning's "bf16-mixed"/"16-mixed"/"32-true" are accepted.
      grad_clip: max total gradient norm (after unscaling), or None.
      epochs, max_steps: stop after ``epochs`` passes or ``max_steps`` optimizer steps, whichever
        comes first; epochs=None means 1, or unbounded when max_steps is given.
      seed: the sampler's shuffle seed (the same on every rank) and, plus the rank, the DataLoader
        workers' seed. fit never reseeds the global RNG: build the model after seeding, identically
        on every rank, or rely on DDP, whose constructor copies rank 0's parameters to every rank.

    Output (rank 0 only prints and writes):
      run_dir: given, else $DDPRUN_RUN_DIR (``ddprun run``), else runs/<timestamp>.
      log_every: every this many steps rank 0 reads its own loss (mean over those steps, not reduced
        over ranks: no extra collective), writes a metrics.csv row and a progress line; the bar
        itself advances every step on a terminal. ``FitResult.train_loss`` is the one value averaged
        over ranks, with one all_reduce at the end.
      checkpoint_dir: where checkpoints go (default run_dir/checkpoints): model, optimizer,
        scheduler, grad scaler, step, epoch, sampler position, every rank's RNG states, validation
        history; see :mod:`ddprun.train.checkpoint` (atomic, SHA-256 checked, weights_only loads).

    Checkpoints and restarts:
      step_timing: time each step's parts (data wait, compute, blocked all-reduce, optimizer; see
        :mod:`ddprun.train.timing`) for the straggler detector and the run report. Off: no comm
        hook and no timestamps (benchmarks/overhead.py measures the difference).
      checkpoint_every: also save every this many optimizer steps (None: only at the end). Costs
        one all_gather_object (RNG states) and one barrier per checkpoint, plus the write on rank 0.
      keep_checkpoints: how many to keep (the newest; at least 1).
      on_checkpoint: ``(CheckpointSaved) -> None``, called on every rank after each checkpoint is
        complete (every rank has passed the save's barrier), and once more at the end (``final``,
        with the run's results; when the run ended on a checkpoint step that call names the same
        file again). For handing checkpoints to another system (``ddprun.ray`` reports them to Ray
        Train); it may run collectives, and must on every rank alike. nn.Module only.
      resume: "auto" (default): if checkpoint_dir has a usable checkpoint, continue from it: model,
        optimizer, scheduler, scaler, the step, the position in the epoch, every rank's RNG states.
        That is what happens when torch's agent restarts the workers (``ddprun run --max-restarts
        R``; the run dir is the same across attempts) and when a job is started again with the same
        run dir. With the same world size, batch size and seed the result is bit for bit the
        uninterrupted run's on CPU with deterministic ops (DataLoader worker processes' own RNG is
        not saved). A damaged newest checkpoint is skipped with a warning. With another world size
        (``--nnodes MIN:MAX`` after losing a node) the per-rank batch size stays, so the global
        batch shrinks with the world; the learning rate is not rescaled (the rest of the epoch is
        split over the ranks there are). Each fit() of a process into one checkpoint_dir has its
        own checkpoints (the n-th after the first in checkpoint_dir/fit-<n>/), which its restart
        resumes. False: start anew (the checkpoints there are moved to checkpoint_dir/previous-<k>/,
        never deleted). True: like "auto" but an error when there is none; a later fit of the
        process with none of its own continues from the fit before it. A path: resume from that
        file or directory. A checkpoint of another model is refused (ConfigError). When
        checkpoint_dir is not shared between nodes, every node's local rank 0 writes its own copy
        (:mod:`ddprun.train.resume`).

    Process group: fit calls :func:`ddprun.init` (joining with a 600 s timeout, then 300 s per
    collective from step 2); call ``ddprun.init(timeout=..., train_timeout=...)`` first to change
    them. While one rank writes a checkpoint or runs on_checkpoint, the others wait for it up to
    that join timeout or, under ``ddprun run``, as long as the stall watch lets such a phase run
    (4 x ``--stall-timeout``: 1200 s by default) where that is longer: for longer writes raise
    ``--stall-timeout`` (or ``timeout``). Per step there is no collective besides DDP's gradient
    all-reduce. fit does not destroy the process group. Returns a :class:`FitResult`.
    """
    package = lightning_package(model)
    if package is not None:
        import importlib

        fit_lightning = importlib.import_module(LIGHTNING_PACKAGES[package]).fit_lightning

        if on_checkpoint is not None:
            raise ConfigError("on_checkpoint is for a plain nn.Module.", seen=f"model: {type(model).__name__}",
                              hint="With a LightningModule, add a lightning Callback through trainer_kwargs="
                                   "{'callbacks': [...]} (its on_save_checkpoint, or trainer.save_checkpoint).")
        return fit_lightning(model, train_data, val_data=val_data, datamodule=datamodule, epochs=epochs,
                             max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum, precision=precision,
                             grad_clip=grad_clip, seed=seed, num_workers=num_workers, checkpoint_dir=checkpoint_dir,
                             run_dir=run_dir, log_every=log_every, checkpoint_every=checkpoint_every,
                             resume=resume, trainer_kwargs=trainer_kwargs, loss_fn=loss_fn,
                             training_step=training_step, optimizer=optimizer, scheduler=scheduler,
                             val_metrics=val_metrics)
    _check_module_data(model, train_data, datamodule, trainer_kwargs)
    return fit_module(model, train_data, val_data=val_data, loss_fn=loss_fn, training_step=training_step,
                      optimizer=optimizer, scheduler=scheduler, epochs=epochs, max_steps=max_steps,
                      batch_size=batch_size, grad_accum=grad_accum, precision=precision, grad_clip=grad_clip,
                      seed=seed, num_workers=num_workers, val_metrics=val_metrics, checkpoint_dir=checkpoint_dir,
                      run_dir=run_dir, log_every=log_every, step_timing=step_timing,
                      checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints, resume=resume,
                      on_checkpoint=on_checkpoint)


def _check_module_data(model: Any, train_data: Any, datamodule: Any, trainer_kwargs: Any) -> None:
    """A plain nn.Module takes train_data, and neither of the LightningModule-only arguments."""
    if datamodule is not None or trainer_kwargs is not None or train_data is None:
        given = lambda value: "given" if value is not None else None  # noqa: E731
        raise ConfigError("fit() of a plain nn.Module takes train_data, and neither datamodule nor trainer_kwargs.",
                          seen=f"model: {type(model).__name__}, train_data={given(train_data)}, "
                               f"datamodule={given(datamodule)}, trainer_kwargs={given(trainer_kwargs)}",
                          hint="Pass a Dataset or DataLoader as train_data; datamodule and trainer_kwargs are for a "
                               "lightning.pytorch.LightningModule.")
