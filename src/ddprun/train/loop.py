"""``fit_module``: data-parallel training of a plain ``nn.Module``, the loop nanoGPT writes by hand.

``ddprun.fit`` (:mod:`ddprun.api`) calls it for every model that is not a LightningModule.

What happens on every rank, in order:
  1. arguments checked (ConfigError with a HINT, on every rank, before any collective);
  2. :func:`ddprun.init` joins the process group (none under plain ``python``);
  3. loaders built (:mod:`ddprun.train.data`), the model moved to this rank's device, the optimizer
     and scheduler made from their factories;
  4. the model wrapped in DDP when world_size > 1; DDP's constructor broadcasts rank 0's parameters
     and buffers, so fit neither reseeds nor broadcasts anything itself;
  5. steps: forward/backward per micro-batch (``no_sync`` on all but the last of each group of
     ``grad_accum``), then clip, optimizer step, scheduler step. The only collective of a step is
     DDP's gradient all-reduce; once, after step 1, a barrier switches to the training timeout;
  6. after every epoch (and at the end) validation on the plain module, one all_reduce of sums and
     counts;
  7. every ``checkpoint_every`` steps and at the end a checkpoint (every rank's RNG states gathered
     once, rank 0 writes atomically, a barrier); at the start, a run whose checkpoint_dir has one
     resumes from it (:mod:`ddprun.train.resume`: a restarted worker group continues bit for bit).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddprun import runtime
from ddprun.errors import ConfigError
from ddprun.runtime import RankInfo
from ddprun.train import checkpoint as ckpt
from ddprun.train import resume as resume_mod
from ddprun.telemetry import TIMER
from ddprun.train import timing
from ddprun.train.data import build_train_loader, build_val_loader
from ddprun.train.metrics import MetricsLog
from ddprun.train.progress import Progress

PRECISIONS = {"32": "32", "32-true": "32", "bf16": "bf16", "bf16-mixed": "bf16", "16": "16", "16-mixed": "16"}


@dataclass
class FitResult:
    """What :func:`fit` returns, the same on every rank (except ``checkpoint``: rank 0 only)."""

    train_loss: float | None
    """Mean loss over the last logging window (≤ ``log_every`` steps), averaged over ranks."""
    val_metrics: dict[str, float]
    """``val_loss`` and ``val_<name>`` of the last validation, over all ranks; empty without val_data."""
    steps: int
    """Optimizer steps taken."""
    epochs: int
    """Epochs completed (a run stopped by ``max_steps`` mid-epoch does not count that epoch)."""
    model: nn.Module
    """The trained model, unwrapped (no DDP), on this rank's device."""
    run_dir: str
    checkpoint: str | None = None
    """Path of the final checkpoint (rank 0; None on other ranks)."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Validation results per epoch, in order."""


@dataclass(frozen=True)
class CheckpointSaved:
    """What ``fit(on_checkpoint=...)`` is told after a checkpoint (the same on every rank but ``path``)."""

    path: str | None
    """The checkpoint file on rank 0; None on the other ranks."""
    step: int
    epoch: int
    final: bool
    """True for the one call at the end of fit."""
    metrics: dict[str, float]
    """Final call: ``train_loss`` (averaged over ranks) and the last validation's ``val_*``; before
    it: the last validation's, if any."""


# -- argument checks ------------------------------------------------------------------------------

def _int_at_least(name: str, value: Any, low: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}" + (" or None." if optional else "."),
                          seen=f"{name}={value!r}", hint=f"Give e.g. {name}={max(low, 1)}.")


def _check_callable(name: str, value: Any, signature: str) -> None:
    if value is not None and not callable(value):
        raise ConfigError(f"{name} must be a callable {signature}.", seen=f"{name}: {type(value).__name__}",
                          hint=f"Pass a function or lambda: {signature}.")


def _check_args(model: Any, *, loss_fn, training_step, optimizer, scheduler, epochs, max_steps, batch_size,
                grad_accum, precision, grad_clip, seed, val_metrics, log_every) -> str:
    """Every check that needs no process group; returns the normalised precision."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ConfigError("fit() got a model already wrapped in DistributedDataParallel.",
                          seen=f"model: DistributedDataParallel({type(model.module).__name__})",
                          hint="Pass the plain module (model.module); fit() wraps it when world_size > 1.")
    if not isinstance(model, nn.Module):
        raise ConfigError("fit() trains a torch.nn.Module.", seen=f"model: {type(model).__name__}",
                          hint="Pass an nn.Module (a LightningModule goes through ddprun's Lightning adapter).")
    if training_step is None and loss_fn is None:
        raise ConfigError("fit() needs a way to compute the loss.", seen="loss_fn=None, training_step=None",
                          hint="Give loss_fn=torch.nn.functional.cross_entropy (batches of (inputs, targets)), "
                               "or training_step=lambda model, batch: <scalar loss>.")
    if training_step is not None and loss_fn is not None:
        raise ConfigError("fit() got both loss_fn and training_step.", seen="loss_fn and training_step both given",
                          hint="Give one: training_step computes the loss itself (it may call your loss_fn).")
    _check_callable("loss_fn", loss_fn, "(outputs, targets) -> scalar loss")
    _check_callable("training_step", training_step, "(model, batch) -> scalar loss")
    if not isinstance(optimizer, torch.optim.Optimizer):
        _check_callable("optimizer", optimizer, "params -> torch.optim.Optimizer")
    _check_callable("scheduler", scheduler, "optimizer -> LR scheduler")
    _int_at_least("epochs", epochs, 1, optional=True)
    _int_at_least("max_steps", max_steps, 1, optional=True)
    _int_at_least("batch_size", batch_size, 1)
    _int_at_least("grad_accum", grad_accum, 1)
    _int_at_least("log_every", log_every, 1)
    _int_at_least("seed", seed, 0)
    if grad_clip is not None and (isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float))
                                  or not grad_clip > 0):
        raise ConfigError("grad_clip must be a positive max gradient norm, or None.", seen=f"grad_clip={grad_clip!r}",
                          hint="e.g. grad_clip=1.0.")
    if val_metrics is not None:
        if not isinstance(val_metrics, Mapping) or not all(isinstance(k, str) and callable(f)
                                                           for k, f in val_metrics.items()):
            raise ConfigError("val_metrics must map names to callables (outputs, targets) -> value(s).",
                              seen=f"val_metrics: {val_metrics!r}",
                              hint="e.g. val_metrics={'accuracy': lambda out, y: (out.argmax(1) == y).float()}.")
    key = str(precision)
    if key not in PRECISIONS:
        raise ConfigError("Unknown precision.", seen=f"precision={precision!r}",
                          hint="Use '32' (default), 'bf16' (autocast to bfloat16) or '16' (float16, CUDA only).")
    return PRECISIONS[key]


# -- setup --------------------------------------------------------------------------------------

def _unwrap(model: nn.Module, info: RankInfo) -> nn.Module:
    if isinstance(model, nn.DataParallel):
        if info.is_main:
            warnings.warn("ddprun: the model is wrapped in nn.DataParallel; fit() unwraps it and trains "
                          "model.module with DDP, one process per device (DataParallel is never used).",
                          stacklevel=4)  # the user's ddprun.fit line (<- fit_module <- ddprun.api.fit)
        return model.module
    return model


def _amp(precision: str, device: torch.device) -> tuple[Callable[[], Any], Any]:
    """(autocast context factory, GradScaler or None) for ``precision`` on ``device``."""
    if precision == "32":
        null = contextlib.nullcontext()
        return (lambda: null), None
    if precision == "16":
        if device.type != "cuda":
            raise ConfigError("precision='16' (float16 with a GradScaler) needs CUDA.", seen=f"device {device}",
                              hint="Use precision='bf16' on CPU, or '32'.")
        return (lambda: torch.autocast("cuda", dtype=torch.float16)), torch.amp.GradScaler("cuda")
    return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), None


def _make_optimizer(optimizer: Any, model: nn.Module) -> torch.optim.Optimizer:
    if optimizer is None:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    opt = optimizer(model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError("The optimizer factory did not return a torch.optim.Optimizer.",
                          seen=f"optimizer(params) returned {type(opt).__name__}",
                          hint="Pass e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1).")
    return opt


def _make_scheduler(scheduler: Any, opt: torch.optim.Optimizer) -> Any:
    if scheduler is None:
        return None
    sched = scheduler(opt)
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError("fit() steps the scheduler every optimizer step without a metric; ReduceLROnPlateau "
                          "needs one.", seen="scheduler(optimizer) returned ReduceLROnPlateau",
                          hint="Use a step-based scheduler (e.g. CosineAnnealingLR, OneCycleLR), or write the loop "
                               "yourself with ddprun.init().")
    if not hasattr(sched, "step") or not hasattr(sched, "state_dict"):
        raise ConfigError("The scheduler factory did not return an LR scheduler.",
                          seen=f"scheduler(optimizer) returned {type(sched).__name__}",
                          hint="Pass e.g. scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 100).")
    return sched


def _run_dir(run_dir: str | None, info: RankInfo) -> str:
    """``run_dir``, else DDPRUN_RUN_DIR, else ``runs/<timestamp>`` chosen by rank 0 for every rank."""
    if run_dir:
        return os.path.abspath(run_dir)
    env_dir = os.environ.get("DDPRUN_RUN_DIR")
    if env_dir:
        return env_dir
    from ddprun.config import DEFAULT_RUNS_ROOT
    from ddprun.protocol.rundir import new_run_id

    chosen = [os.path.abspath(os.path.join(DEFAULT_RUNS_ROOT, new_run_id()))]
    if info.distributed and info.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(chosen, src=0)  # once, at setup: ranks' clocks may straddle a second
    return chosen[0]


# -- the step -----------------------------------------------------------------------------------

def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def _batch_len(batch: Any) -> int:
    while isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    if isinstance(batch, Mapping) and batch:
        return _batch_len(next(iter(batch.values())))
    return int(batch.shape[0]) if isinstance(batch, torch.Tensor) and batch.ndim > 0 else 1


def _pair(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ConfigError("With loss_fn, every batch must be a pair (inputs, targets).",
                      seen=f"batch: {type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (list, tuple))
                                                               else ""),
                      hint="Give training_step=lambda model, batch: <scalar loss> for other batch layouts.")


def _scalar(loss: Any, where: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise ConfigError(f"{where} must return a scalar loss tensor.",
                          seen=f"got {type(loss).__name__}" + (f" of shape {tuple(loss.shape)}"
                                                               if isinstance(loss, torch.Tensor) else ""),
                          hint="Reduce it, e.g. loss.mean(), or use the default reduction='mean' of torch losses.")
    return loss


def _micro_batches(loader: Any, sized: bool, grad_accum: int) -> Iterator[tuple[Any, int, bool, int]]:
    """Yield ``(batch, divisor, last_in_group, group_len)`` over one epoch.

    Each micro-batch loss is divided by ``divisor``. With a known length that is the exact size of
    its group (the last group of an epoch may be short). Without one (an IterableDataset) one batch
    is held back to know which is last, the divisor is ``grad_accum``, and a short last group shows
    as ``group_len < divisor``: the caller rescales its gradients. ``group_len`` is exact when
    ``last_in_group``.
    """
    if sized and grad_accum == 1:
        for batch in loader:
            yield batch, 1, True, 1
        return
    if sized:
        n = len(loader)
        for i, batch in enumerate(loader):
            start = i - i % grad_accum
            size = min(grad_accum, n - start)
            yield batch, size, i - start == size - 1, size
        return
    it = iter(loader)
    try:
        pending = next(it)
    except StopIteration:
        return
    k = 0  # micro-batches of the current group yielded so far
    for batch in it:
        k += 1
        yield pending, grad_accum, k == grad_accum, k
        k %= grad_accum
        pending = batch
    yield pending, grad_accum, True, k + 1


def _loss(net: Any, batch: Any, training_step: Callable | None, loss_fn: Callable | None) -> torch.Tensor:
    """The scalar loss of one micro-batch: ``training_step(net, batch)``, or ``loss_fn(net(x), y)``."""
    if training_step is not None:
        return _scalar(training_step(net, batch), "training_step")
    x, y = _pair(batch)
    return _scalar(loss_fn(net(x), y), "loss_fn")


def _rebuild_ddp_buckets(ddp: Any, module: nn.Module, opt: torch.optim.Optimizer, loader: Any, sampler: Any,
                         model_state: Mapping[str, Any], epoch: int, loss_of: Callable, amp: Callable,
                         move: tuple[torch.device, bool] | None) -> None:
    """One forward/backward whose result is thrown away, so that a resumed run's first step
    all-reduces with the bucket layout the interrupted run had.

    Why: DDP's first iteration reduces every gradient in one bucket in parameter order, then rebuilds
    its buckets in the order gradients became ready; the gloo/NCCL sum of an element depends on where
    it lies in its bucket, so the resumed run's first step would round differently from the
    interrupted run's (measured: 1e-9 apart after 14 steps). The batch comes from an epoch other
    than the resumed one (one is always non-empty); model state is reloaded afterwards (BatchNorm
    statistics), gradients dropped, and RNG states are restored after this. training_step is called
    once more than the steps it makes (on restarts only).
    """
    if sampler is not None:
        sampler.set_epoch(epoch + 1)  # fit's loop sets the epoch again before its first batch
    batch = next(iter(loader), None)
    if batch is None:
        return
    if move is not None:
        batch = _to_device(batch, *move)
    with amp():
        loss = loss_of(ddp, batch)
    (loss * 0).backward()
    opt.zero_grad(set_to_none=True)
    module.load_state_dict(model_state)


def _optimizer_step(opt: torch.optim.Optimizer, sched: Any, scaler: Any, params: list, grad_clip: float | None) -> None:
    """Clip (after unscaling), step, zero the gradients, step the scheduler."""
    if scaler is not None:
        if grad_clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        scaler.step(opt)
        scaler.update()
    else:
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()


def _total_steps(batches: int | None, grad_accum: int, epochs: int | None, max_steps: int | None) -> int | None:
    """Optimizer steps the run will take, when known (for the progress bar)."""
    total = math.ceil(batches / grad_accum) * epochs if batches is not None and epochs is not None else None
    if max_steps is not None:
        total = min(total, max_steps) if total is not None else max_steps
    return total


# -- validation ---------------------------------------------------------------------------------

def _validate(module: nn.Module, loader: Any, info: RankInfo, *, loss_fn, training_step, metrics: Mapping,
              amp: Callable[[], Any]) -> dict[str, float]:
    """Loss and metrics over every rank's shard: sums and counts, one all_reduce."""
    device = info.device
    names = list(metrics)
    sums = torch.zeros(2 + 2 * len(names), dtype=torch.float64, device=device)
    was_training = module.training
    module.eval()
    with torch.no_grad():
        for batch in loader:
            if device.type != "cpu":
                batch = _to_device(batch, device, non_blocking=True)
            n = _batch_len(batch)
            out = None
            with amp():
                if training_step is not None:
                    loss = _scalar(training_step(module, batch), "training_step")
                else:
                    x, y = _pair(batch)
                    out = module(x)
                    loss = _scalar(loss_fn(out, y), "loss_fn")
                if names and out is None:
                    x, y = _pair(batch)
                    out = module(x)
            sums[0] += loss.detach().double() * n
            sums[1] += n
            for j, name in enumerate(names):
                value = torch.as_tensor(metrics[name](out, y), device=device).double()
                if value.ndim == 0:  # a batch mean: weight by the batch size
                    sums[2 + 2 * j] += value * n
                    sums[3 + 2 * j] += n
                else:  # per-sample values
                    sums[2 + 2 * j] += value.sum()
                    sums[3 + 2 * j] += value.numel()
    module.train(was_training)
    if info.distributed and info.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(sums)
    totals = sums.tolist()
    result = {"val_loss": totals[0] / totals[1] if totals[1] else math.nan}
    for j, name in enumerate(names):
        count = totals[3 + 2 * j]
        result[f"val_{name}"] = totals[2 + 2 * j] / count if count else math.nan
    return result


# -- fit ----------------------------------------------------------------------------------------

def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, *, step: int,
                   epoch: int, batches_done: int, seed: int, world_size: int, batch_size: int | None = None,
                   samples_done: int | None = None, rng: list[dict] | None = None,
                   history: list[dict] | None = None) -> dict[str, Any]:
    """Everything a later run needs to resume (checkpoint.save adds the format version).

    ``sampler``: the epoch to continue, the micro-batches of it every rank took (``batches_done``)
    and the positions of the epoch's global order they covered (``samples_done``, = batches_done x
    batch_size x world_size): with the same seed the sampler continues there (see
    :class:`~ddprun.train.data.ResumableSampler`). ``rng``: every rank's RNG states, by rank
    (default: this process's only). ``history``: the validation results so far.
    """
    if samples_done is None:
        samples_done = batches_done * (batch_size or 0) * world_size
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "grad_scaler": scaler.state_dict() if scaler is not None else None,
        "step": step,
        "epoch": epoch,
        "sampler": {"epoch": epoch, "batches_done": batches_done, "samples_done": samples_done, "seed": seed,
                    "num_replicas": world_size, "batch_size": batch_size},
        "rng": rng if rng is not None else [ckpt.rng_state()],
        "history": list(history or []),
    }


class _Skipped:
    """``loader`` without its first ``n`` batches, which are still loaded (resuming where no sampler can skip).

    A DataLoader without a generator of its own draws a seed from the global torch RNG when its
    iterator is made; the interrupted run made that draw before the checkpoint (its RNG state is
    after it), so here the global state is put back after the iterator exists. A random order of
    the loader's own (shuffle=True) is drawn anew, so only an order that does not depend on the RNG
    resumes exactly (fit's own sampler does: it is used for every Dataset, and whenever world > 1).
    """

    def __init__(self, loader: Any, n: int):
        self.loader, self.n = loader, n

    def __iter__(self) -> Iterator[Any]:
        import itertools

        state = torch.get_rng_state()
        it = iter(self.loader)
        torch.set_rng_state(state)
        return itertools.islice(it, self.n, None)

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.n)


def fit_module(model: nn.Module, train_data: Any, *, val_data: Any = None, loss_fn: Callable | None = None,
               training_step: Callable | None = None, optimizer: Callable | torch.optim.Optimizer | None = None,
               scheduler: Callable | None = None, epochs: int | None = None, max_steps: int | None = None,
               batch_size: int = 32, grad_accum: int = 1, precision: str = "32", grad_clip: float | None = None,
               seed: int = 0, num_workers: int | None = None, val_metrics: Mapping[str, Callable] | None = None,
               checkpoint_dir: str | None = None, run_dir: str | None = None, log_every: int = 50,
               step_timing: bool = True, checkpoint_every: int | None = None, keep_checkpoints: int = 3,
               resume: bool | str = "auto", on_checkpoint: Callable[[CheckpointSaved], None] | None = None) -> FitResult:
    """Train a plain ``nn.Module`` data-parallel over every rank of the job; ``ddprun.fit``
    (:mod:`ddprun.api`) documents the arguments. Returns a :class:`FitResult`."""
    prec = _check_args(model, loss_fn=loss_fn, training_step=training_step, optimizer=optimizer, scheduler=scheduler,
                       epochs=epochs, max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum,
                       precision=precision, grad_clip=grad_clip, seed=seed, val_metrics=val_metrics,
                       log_every=log_every)
    _int_at_least("checkpoint_every", checkpoint_every, 1, optional=True)
    _int_at_least("keep_checkpoints", keep_checkpoints, 1)
    _check_callable("on_checkpoint", on_checkpoint, "(CheckpointSaved) -> None")
    resume_mod.check_resume(resume)
    info = runtime.init()
    device = info.device
    module = _unwrap(model, info)
    amp, scaler = _amp(prec, device)
    train = build_train_loader(train_data, batch_size=batch_size, info=info, seed=seed, num_workers=num_workers)
    val_loader = None
    if val_data is not None:
        val_loader = build_val_loader(val_data, batch_size=batch_size, info=info, num_workers=num_workers)
    metrics = dict(val_metrics or {})

    module.to(device)
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigError("The model has no trainable parameters.",
                          seen=f"{type(module).__name__}: {sum(1 for _ in module.parameters())} parameters, "
                               "none with requires_grad", hint="Unfreeze at least one parameter.")
    opt = _make_optimizer(optimizer, module)
    sched = _make_scheduler(scheduler, opt)
    run_dir = _run_dir(run_dir, info)
    ckpts, resumed = resume_mod.Checkpoints.open(checkpoint_dir or os.path.join(run_dir, "checkpoints"), info,
                                                 keep=keep_checkpoints, resume=resume)
    resume_mod.warn_no_periodic(info, checkpoint_every)
    ddp = module
    if info.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    is_ddp = ddp is not module

    loader, sampler = train.loader, train.sampler
    sized = sampler is not None or not isinstance(loader.dataset, torch.utils.data.IterableDataset)
    if epochs is None:
        epochs = 1 if max_steps is None else None
    total = _total_steps(len(loader) if sized else None, grad_accum, epochs, max_steps)
    pos = None
    if resumed is not None:  # after the model moved and the optimizer exists; before DDP's first step
        pos = resume_mod.restore(resumed, info, model=module, optimizer=opt, scheduler=sched, scaler=scaler,
                                 sampler=sampler, batch_size=train.batch_size, seed=seed)
        ckpts.last_saved = (pos.step, pos.epoch)

    log = MetricsLog(run_dir, ["val_loss", *(f"val_{n}" for n in metrics)], enabled=info.is_main)
    progress = Progress(total, enabled=info.is_main)
    non_blocking = device.type == "cuda"
    on_cpu = device.type == "cpu"
    params = [p for p in module.parameters() if p.requires_grad]

    step = epoch = batches_done = epoch_samples = 0
    per_batch = train.batch_size * info.world_size  # positions of an epoch's global order per micro-batch
    window_losses: list[torch.Tensor] = []  # each step's loss, detached; read (.item()) only when logging
    group_losses: list[torch.Tensor] = []
    null = contextlib.nullcontext()
    window_steps = window_samples = 0
    last_window = None
    val_result: dict[str, float] = {}
    history: list[dict[str, float]] = []
    val_step = -1
    if pos is not None:
        step, epoch, history = pos.step, pos.epoch, pos.history
        val_result = history[-1] if history else {}
    first_step = step + 1  # the training timeout starts after this process's first step
    done = max_steps is not None and step >= max_steps  # a finished run resumed: nothing left to do
    window_t0 = time.perf_counter()
    # step timing (train/timing.py): published by the job channel every 2 s, no collective
    clock = timing.install(module) if (is_ddp and step_timing) else None
    TIMER.detailed = True  # fit records its own steps (or none): the optimizer hook stays quiet
    t_prev_step = time.perf_counter()
    t_data = t_compute = t_reduce = 0.0

    def flush_window() -> None:
        nonlocal window_steps, window_samples, window_t0, last_window
        now = time.perf_counter()
        elapsed = max(now - window_t0, 1e-9)
        last_window = torch.stack(window_losses).mean()
        window_losses.clear()
        if info.is_main:  # the only read of the loss; other ranks keep theirs for the final mean
            loss_value = last_window.item()
            rate = window_samples * info.world_size / elapsed
            log.write(step, epoch, {"loss": loss_value, "samples_per_s": rate, "step_time_s": elapsed / window_steps})
            progress.log(step, epoch, loss_value, rate)
        window_steps = window_samples = 0
        window_t0 = now

    def validate(during_epoch: int) -> None:
        nonlocal val_result, val_step
        val_result = _validate(module, val_loader, info, loss_fn=loss_fn, training_step=training_step,
                               metrics=metrics, amp=amp)
        val_step = step
        history.append(val_result)
        log.write(step, during_epoch, val_result)
        progress.message(_format_val(step, during_epoch, val_result))

    def make_state(rngs: list[dict]) -> dict[str, Any]:
        return training_state(module, opt, sched, scaler, step=step, epoch=epoch, batches_done=batches_done,
                              samples_done=epoch_samples, seed=seed, world_size=info.world_size,
                              batch_size=train.batch_size, rng=rngs, history=history)

    try:
        if resumed is not None and is_ddp and not done and (epochs is None or epoch < epochs):
            _rebuild_ddp_buckets(ddp, module, opt, loader, sampler, resumed.state["model"], pos.epoch,
                                 lambda net, b: _loss(net, b, training_step, loss_fn), amp,
                                 None if on_cpu else (device, non_blocking))
        if resumed is not None:  # last before the first step: nothing after this may draw differently
            resume_mod.restore_rank_rng(resumed.state, info.rank)
        ddp.train()
        while not done and (epochs is None or epoch < epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            source, batches_done, epoch_samples = loader, 0, 0
            if pos is not None:  # the epoch the checkpoint was taken in: continue where it stopped
                batches_done, epoch_samples = pos.batches, pos.samples
                if sampler is None:
                    source = _Skipped(loader, pos.batches)
                pos = None
            taken = 0
            t_asked = time.perf_counter()
            for batch, divisor, last, group_len in _micro_batches(source, sized, grad_accum):
                if not on_cpu:
                    batch = _to_device(batch, device, non_blocking)
                t_fwd = time.perf_counter()
                t_data += t_fwd - t_asked
                window_samples += _batch_len(batch)
                if clock is not None:
                    clock.ready = None
                with null if (last or not is_ddp) else ddp.no_sync():
                    with amp():
                        loss = _loss(ddp, batch, training_step, loss_fn)
                    if divisor > 1:
                        loss = loss / divisor
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                t_bwd = time.perf_counter()
                compute_s, reduce_s = timing.split_backward(t_fwd, t_bwd, clock, synced=last)
                t_compute += compute_s
                t_reduce += reduce_s
                t_asked = t_bwd
                batches_done += 1
                taken += 1
                epoch_samples += per_batch
                if grad_accum == 1:
                    window_losses.append(loss.detach())
                else:
                    group_losses.append(loss.detach())
                    if not last:
                        continue
                    group_loss = torch.stack(group_losses).sum()
                    group_losses.clear()
                    if group_len < divisor:  # an unsized epoch's short last group: undo part of 1/divisor
                        for p in params:
                            if p.grad is not None:
                                p.grad.mul_(divisor / group_len)
                        group_loss = group_loss * (divisor / group_len)
                    window_losses.append(group_loss)
                _optimizer_step(opt, sched, scaler, params, grad_clip)
                t_end = time.perf_counter()
                if step_timing:
                    TIMER.record(t_end - t_prev_step, t_data, t_compute, t_reduce, t_end - t_asked)
                t_prev_step = t_asked = t_end
                t_data = t_compute = t_reduce = 0.0
                step += 1
                window_steps += 1
                if step == first_step:
                    runtime.use_training_timeout()
                progress.advance(step)
                if step % log_every == 0:
                    flush_window()
                if checkpoint_every is not None and step % checkpoint_every == 0:
                    saved = ckpts.save(step, epoch, make_state)
                    if saved:
                        progress.message(f"checkpoint: {saved}")
                    if on_checkpoint is not None:
                        on_checkpoint(CheckpointSaved(saved, step, epoch, False, dict(history[-1] if history else {})))
                if max_steps is not None and step >= max_steps:
                    done = True
                    break
            if batches_done == 0:
                raise ConfigError("An epoch of train_data gave no batches.", seen=f"epoch {epoch}, rank {info.rank}",
                                  hint="Check the dataset, or that an IterableDataset yields data on every rank.")
            if not done or (sized and taken == len(source)):  # the epoch ran to its end
                epoch += 1
                batches_done = epoch_samples = 0
                if val_loader is not None:
                    validate(epoch - 1)
        if window_steps:
            flush_window()
        if val_loader is not None and val_step != step:
            validate(epoch if batches_done else epoch - 1)
        train_loss = _mean_over_ranks(last_window, info)

        if ckpts.last_saved != (step, epoch):  # a save at the last step, before its epoch was counted: again
            path = ckpts.save(step, epoch, make_state, final=True)
            if path:
                progress.message(f"checkpoint: {path}")
        else:  # saved at this step already (or resumed a finished run): that file is the final one
            path = ckpt.latest(ckpts.directory) if info.is_main else None
            runtime.barrier()
        if on_checkpoint is not None:
            results = {"train_loss": train_loss, **val_result} if train_loss is not None else dict(val_result)
            on_checkpoint(CheckpointSaved(path, step, epoch, True, results))
        resume_mod.mark_finished(ckpts.directory)
    finally:
        TIMER.detailed = False
        progress.close()
        log.close()
    return FitResult(train_loss=train_loss, val_metrics=val_result, steps=step, epochs=epoch, model=module,
                     run_dir=run_dir, checkpoint=path, history=history)


def _mean_over_ranks(value: torch.Tensor | None, info: RankInfo) -> float | None:
    if value is None:
        return None
    if info.distributed and info.world_size > 1:
        import torch.distributed as dist

        value = value.detach().clone()
        dist.all_reduce(value)
        value /= info.world_size
    return float(value.item())


def _format_val(step: int, epoch: int, result: Mapping[str, float]) -> str:
    return f"validation at step {step} (epoch {epoch}): " + "  ".join(f"{k} {v:.4f}" for k, v in result.items())
