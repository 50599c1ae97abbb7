"""``fit_module``: data-parallel training of a plain ``nn.Module``, the loop nanoGPT writes by hand.

``ddprun.fit`` (:mod:`ddprun.api`) calls it for every model that is not a LightningModule. What
happens on every rank, in order:
  1. arguments checked (:meth:`FitOptions.build <ddprun.train.options.FitOptions.build>`: ConfigError
     with a HINT, on every rank, before any collective);
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

Steps 2-4 are :func:`_setup`; the rest is :class:`_Loop`, which holds the loop's state.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ddprun import runtime
from ddprun.errors import ConfigError
from ddprun.preempt import PREEMPT, Preempted
from ddprun.protocol.env import WorkerEnv
from ddprun.runtime import RankInfo
from ddprun.telemetry import PROGRESS, TIMER, busy, heartbeat, setup_phase
from ddprun.train import checkpoint as ckpt
from ddprun.train import dirlock, timing
from ddprun.train import resume as resume_mod
from ddprun.train.data import build_train_loader, build_val_loader, close_workers, set_epoch
from ddprun.train.metrics import MetricsLog
from ddprun.train.options import FitOptions
from ddprun.train.progress import Progress

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

# Frames from a warning's caller in this module up to the user's ``ddprun.fit(...)`` line:
# _unwrap <- _setup <- fit_module <- ddprun.api.fit <- the user.
_USER_FRAME = 5


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



# -- setup --------------------------------------------------------------------------------------

def _unwrap(model: nn.Module, info: RankInfo) -> nn.Module:
    if isinstance(model, nn.DataParallel):
        if info.is_main:
            warnings.warn("ddprun: the model is wrapped in nn.DataParallel; fit() unwraps it and trains "
                          "model.module with DDP, one process per device (DataParallel is never used).",
                          stacklevel=_USER_FRAME)
        return model.module
    return model


def _check_trainable(module: nn.Module) -> None:
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigError("The model has no trainable parameters.",
                          seen=f"{type(module).__name__}: {sum(1 for _ in module.parameters())} parameters, "
                               "none with requires_grad", hint="Unfreeze at least one parameter.")


_NULL = contextlib.nullcontext()


def _no_amp() -> contextlib.nullcontext:
    """precision='32': no autocast (the training step skips the context altogether)."""
    return _NULL


def _amp(precision: str, device: torch.device) -> tuple[Callable[[], Any], Any]:
    """(autocast context factory, GradScaler or None) for ``precision`` on ``device``."""
    if precision == "32":
        return _no_amp, None
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


def launcher_run_dir() -> str | None:
    """The run dir ``ddprun run`` gave this worker (protocol/env.py), if any: fit's one read of it."""
    wenv = WorkerEnv.from_environ(os.environ)
    return wenv.run_dir if wenv is not None else None


def resolve_run_dir(run_dir: str | None, info: RankInfo, environ: Mapping[str, str] | None = None) -> str:
    """``run_dir``, else DDPRUN_RUN_DIR, else under torch's agent with restarts
    ``runs/<TORCHELASTIC_RUN_ID>`` (a restarted worker group resumes there: torchrun's --rdzv-id, a
    fresh uuid with --standalone), else ``runs/<timestamp>``; rank 0's choice, for every rank."""
    if run_dir:
        return os.path.abspath(run_dir)
    env_dir = launcher_run_dir()
    if env_dir:
        return env_dir
    environ = os.environ if environ is None else environ
    chosen = [os.path.abspath(_run_dir_here(info, environ))]
    if info.distributed and info.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(chosen, src=0)  # once, at setup: clocks and working directories differ
    return chosen[0]


def _run_dir_here(info: RankInfo, environ: Mapping[str, str]) -> str:
    """This rank's proposal (rank 0's is taken): a name that outlives a restart only where torch's
    agent restarts the workers, so that a launch without restarts is never taken for a relaunch."""
    from ddprun.config import DEFAULT_RUNS_ROOT, run_id_problem
    from ddprun.protocol.rundir import new_run_id

    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if environ.get("TORCHELASTIC_MAX_RESTARTS", "0") in ("", "0"):
        return os.path.join(DEFAULT_RUNS_ROOT, new_run_id())
    if run_id and run_id != "none" and not run_id_problem(run_id):  # "none": torchrun's default, every job's
        return os.path.join(DEFAULT_RUNS_ROOT, run_id)
    if info.is_main:
        print("ddprun: torch's agent may restart the workers, but this launch names no run "
              f"(TORCHELASTIC_RUN_ID={run_id or '(unset)'}): each start of fit() picks a new run directory, so a "
              "restart trains from step 0. HINT: give torchrun --rdzv-id (a job id), or fit(..., run_dir=...).",
              file=sys.stderr, flush=True)
    return os.path.join(DEFAULT_RUNS_ROOT, new_run_id())


def _wrap(module: nn.Module, info: RankInfo) -> nn.Module:
    """``module`` in DDP when world_size > 1 (its constructor broadcasts rank 0's state), else itself."""
    if info.world_size <= 1:
        return module
    from torch.nn.parallel import DistributedDataParallel

    device = info.device
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


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
    """Samples in ``batch``: the leading size of its first tensor (depth first), else the length of
    its first list of plain values (text: a list of strings), else 1."""
    first = _first_tensor(batch)
    if first is not None:
        return int(first.shape[0]) if first.ndim > 0 else 1
    return _first_list_len(batch) or 1


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):  # first: the Mapping check below is an ABC's (slower, every step)
        return batch
    if isinstance(batch, (list, tuple)):
        parts: Any = batch
    elif isinstance(batch, Mapping):
        parts = batch.values()
    else:
        return None
    for part in parts:
        found = _first_tensor(part)
        if found is not None:
            return found
    return None


def _first_list_len(batch: Any) -> int | None:
    """The length of the first list (or tuple) in ``batch`` whose items are not lists, tuples or mappings."""
    parts = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    if isinstance(batch, (list, tuple)) and batch and not isinstance(batch[0], (list, tuple, Mapping)):
        return len(batch)
    for part in parts:
        found = _first_list_len(part)
        if found:
            return found
    return None


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


def _loss_of(training_step: Callable | None, loss_fn: Callable | None) -> Callable[[Any, Any], torch.Tensor]:
    """``(net, batch) -> the scalar loss of one micro-batch``: ``training_step(net, batch)``, or
    ``loss_fn(net(x), y)``; a batch or loss of another shape raises ConfigError. Chosen once per fit:
    the function runs every micro-batch, so its checks are inline (one call a step, not three)."""
    if training_step is not None:
        return lambda net, batch: _scalar(training_step(net, batch), "training_step")
    if loss_fn is None:  # options._check_args refuses this first
        raise ConfigError("fit() needs a way to compute the loss.", seen="loss_fn=None, training_step=None")

    def loss_of(net: Any, batch: Any) -> torch.Tensor:
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            _pair(batch)  # raises, naming the batch
        loss = loss_fn(net(batch[0]), batch[1])
        return loss if isinstance(loss, torch.Tensor) and loss.ndim == 0 else _scalar(loss, "loss_fn")
    return loss_of


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
    set_epoch(loader, sampler, epoch + 1)  # fit's loop sets the epoch again before its first batch
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
            heartbeat()  # each batch is progress: a long pass is not a stall, one that stops is
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


_END = object()


class _Skipped:
    """``loader`` without its first ``n`` batches, which are still loaded (resuming where no sampler can skip).

    A DataLoader without a generator of its own draws a seed from the global torch RNG when its
    iterator is made; the interrupted run made that draw before the checkpoint (its RNG state is
    after it), so here the global state is put back after the iterator exists. A random order of
    a sampler of the user's is drawn anew, so only an order that does not depend on the RNG resumes
    exactly (fit's own sampler does: it is used for every Dataset, for every DataLoader with torch's
    default sampler, and whenever world > 1; a sampler with ``set_epoch`` is told the epoch first).

    Each batch skipped is a heartbeat (telemetry.py, one integer increment) inside a setup phase: a
    skip deep into a long epoch is progress for the stall watch, which keeps its first-step bound
    until the first batch trained; a phase named in the hang report should one batch hang.
    """

    def __init__(self, loader: Any, n: int):
        self.loader, self.n = loader, n

    def __iter__(self) -> Iterator[Any]:
        state = torch.get_rng_state()
        it = iter(self.loader)
        torch.set_rng_state(state)
        return self._rest(it)

    def _rest(self, it: Iterator[Any]) -> Iterator[Any]:
        previous = PROGRESS.phase
        try:
            with setup_phase():
                for _ in range(self.n):
                    if next(it, _END) is _END:
                        return
                    heartbeat(f"resume: skipping the {self.n} batches the checkpoint had taken")
        finally:
            PROGRESS.phase = previous
        yield from it

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.n)


# -- the run ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Parts:
    """What :func:`_setup` made; fixed for the whole run (the objects themselves change as they train)."""

    info: RankInfo
    module: nn.Module
    """The plain module, on this rank's device."""
    ddp: nn.Module
    """``module`` in DDP when world_size > 1, else ``module`` itself."""
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any
    amp: Callable[[], Any]
    loader: Any
    sampler: Any
    """The loader's ResumableSampler, or None (a DataLoader kept as given, in one process)."""
    sized: bool
    """Whether an epoch's length is known (no IterableDataset without a sampler)."""
    batch_size: int
    val_loader: Any
    run_dir: str
    ckpts: resume_mod.Checkpoints
    resumed: resume_mod.Resumed | None
    total: int | None
    """Optimizer steps of the run, when known (the progress bar)."""

    @property
    def is_ddp(self) -> bool:
        return self.ddp is not self.module


def _setup(model: nn.Module, train_data: Any, val_data: Any, o: FitOptions) -> _Parts:
    """Steps 2-4 of the module docstring; the checkpoint to resume from is found, not yet loaded."""
    info = runtime.init()
    device = info.device
    module = _unwrap(model, info)
    amp, scaler = _amp(o.precision, device)
    train = build_train_loader(train_data, batch_size=o.batch_size, info=info, seed=o.seed, num_workers=o.num_workers)
    val_loader = None
    if val_data is not None:
        val_loader = build_val_loader(val_data, batch_size=o.batch_size, info=info, num_workers=o.num_workers)
    module.to(device)
    _check_trainable(module)
    opt = _make_optimizer(o.optimizer, module)
    sched = _make_scheduler(o.scheduler, opt)
    run_dir = resolve_run_dir(o.run_dir, info)
    ckpts, resumed = resume_mod.Checkpoints.open(o.checkpoint_dir or os.path.join(run_dir, "checkpoints"), info,
                                                 keep=o.keep_checkpoints, resume=o.resume, run=run_dir)
    resume_mod.warn_no_periodic(info, o.checkpoint_every)
    ddp = _wrap(module, info)
    loader, sampler = train.loader, train.sampler
    sized = sampler is not None or not isinstance(loader.dataset, torch.utils.data.IterableDataset)
    total = _total_steps(len(loader) if sized else None, o.grad_accum, o.epochs, o.max_steps)
    return _Parts(info=info, module=module, ddp=ddp, opt=opt, sched=sched, scaler=scaler, amp=amp, loader=loader,
                  sampler=sampler, sized=sized, batch_size=train.batch_size, val_loader=val_loader, run_dir=run_dir,
                  ckpts=ckpts, resumed=resumed, total=total)


@dataclass
class _Window:
    """The logging window: each step's loss (detached; read with ``.item()`` only when logging),
    steps and samples since the last row, and when it started."""

    t0: float
    losses: list[torch.Tensor] = field(default_factory=list)
    steps: int = 0
    samples: int = 0
    last: torch.Tensor | None = None
    """The mean loss of the last flushed window (FitResult.train_loss, averaged over ranks)."""


@dataclass
class _StepTimes:
    """The parts of the current step so far (train/timing.py), and when the last step ended."""

    prev: float
    """When the previous step ended (or setup did)."""
    asked: float = 0.0
    """When the next batch was asked for."""
    data: float = 0.0
    compute: float = 0.0
    reduce: float = 0.0


class _Loop:
    """One fit's loop state, held explicitly: the position (step, epoch, in-epoch counters), the
    logging window, step timing, validation results. ``run`` once, then ``close`` (always)."""

    def __init__(self, parts: _Parts, o: FitOptions):
        """Load the checkpoint found at setup (after the model moved and the optimizer exists; before
        DDP's first step), open the metrics log and progress, install step timing."""
        p, info = parts, parts.info
        self.p, self.o = p, o
        self.pos = None
        if p.resumed is not None:
            self.pos = resume_mod.restore(p.resumed, info, model=p.module, optimizer=p.opt, scheduler=p.sched,
                                          scaler=p.scaler, sampler=p.sampler, batch_size=p.batch_size, seed=o.seed)
            p.ckpts.last_saved = (self.pos.step, self.pos.epoch)
        self.metrics = dict(o.val_metrics or {})
        self.log = MetricsLog(p.run_dir, ["val_loss", *(f"val_{n}" for n in self.metrics)], enabled=info.is_main)
        self.progress = Progress(p.total, enabled=info.is_main)
        self.non_blocking = info.device.type == "cuda"
        self.loss_of = _loss_of(o.training_step, o.loss_fn)
        self.bare = p.amp is _no_amp and p.scaler is None  # a micro-batch that ends a group needs no context
        self.on_cpu = info.device.type == "cpu"
        self.params = [q for q in p.module.parameters() if q.requires_grad]
        self.per_batch = p.batch_size * info.world_size  # positions of an epoch's global order per micro-batch
        self.step = self.epoch = self.batches_done = self.epoch_samples = 0
        self.group_losses: list[torch.Tensor] = []
        self.val_result: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self.val_step = -1
        if self.pos is not None:
            self.step, self.epoch, self.history = self.pos.step, self.pos.epoch, self.pos.history
            self.val_result = self.history[-1] if self.history else {}
        self.first_step = self.step + 1  # the training timeout starts after this process's first step
        self.done = o.max_steps is not None and self.step >= o.max_steps  # a finished run resumed: nothing to do
        self.window = _Window(t0=time.perf_counter())
        # step timing (train/timing.py): published by the job channel every 2 s, no collective
        self.clock = timing.install(p.module) if (p.is_ddp and o.step_timing) else None
        TIMER.detailed = True  # fit records its own steps (or none): the optimizer hook stays quiet
        self.times = _StepTimes(prev=time.perf_counter())
        if p.resumed is not None and not self._more():
            self._say_finished(p.resumed.path)

    def _say_finished(self, path: str) -> None:
        """The run resumed is complete for these options: one line, and no validation again."""
        self.val_step = self.step
        try:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(path)))
        except OSError:  # the file is on another node (a broadcast resume)
            when = "an earlier launch"
        self.progress.message(f"ddprun: run {os.path.basename(self.p.run_dir)} finished at step {self.step} "
                              f"(checkpoint of {when}: {path}); nothing to do. Give a new --rdzv-id (or run_dir), "
                              "or resume=False to train again.")

    def close(self, graceful: bool = True) -> None:
        """``graceful=False``: fit raised (a failure, a preemption): its DataLoader workers are killed."""
        TIMER.detailed = False
        PREEMPT.fit_active = False
        dirlock.release()
        for loader in (self.p.loader, self.p.val_loader):  # their workers ignore SIGTERM: ended here
            close_workers(loader, graceful=graceful)
        self.progress.close()
        self.log.close()

    def run(self) -> FitResult:
        """Train to the end (epochs or max_steps), validate and checkpoint a last time."""
        p = self.p
        if p.resumed is not None and self.pos is not None and p.is_ddp and self._more():  # pos: set from resumed
            _rebuild_ddp_buckets(p.ddp, p.module, p.opt, p.loader, p.sampler, p.resumed.state["model"],
                                 self.pos.epoch, self.loss_of,
                                 p.amp, None if self.on_cpu else (p.info.device, self.non_blocking))
        if p.resumed is not None:  # last before the first step: nothing after this may draw differently
            resume_mod.restore_rank_rng(p.resumed.state, p.info.rank)
        p.ddp.train()
        while self._more():
            self._epoch()
        return self._finish()

    def _more(self) -> bool:
        return not self.done and (self.o.epochs is None or self.epoch < self.o.epochs)

    def _epoch(self) -> None:
        """One epoch (or the rest of the one a checkpoint was taken in); validation when it ran to its end."""
        p = self.p
        set_epoch(p.loader, p.sampler, self.epoch)
        source, self.batches_done, self.epoch_samples = p.loader, 0, 0
        if self.pos is not None:  # the epoch the checkpoint was taken in: continue where it stopped
            self.batches_done, self.epoch_samples = self.pos.batches, self.pos.samples
            if p.sampler is None:
                source = _Skipped(p.loader, self.pos.batches)
            self.pos = None
        taken = 0
        self.times.asked = time.perf_counter()
        for batch, divisor, last, group_len in _micro_batches(source, p.sized, self.o.grad_accum):
            stepped = self._micro_batch(batch, divisor, last, group_len)
            taken += 1
            if stepped and self._step():
                break
        if self.batches_done == 0:
            raise ConfigError("An epoch of train_data gave no batches.", seen=f"epoch {self.epoch}, rank {p.info.rank}",
                              hint="Check the dataset, or that an IterableDataset yields data on every rank.")
        if not self.done or (p.sized and taken == len(source)):  # the epoch ran to its end
            self.epoch += 1
            self.batches_done = self.epoch_samples = 0
            if p.val_loader is not None:
                self._validation(self.epoch - 1)

    def _micro_batch(self, batch: Any, divisor: int, last: bool, group_len: int) -> bool:
        """Forward and backward of one micro-batch (gradients all-reduced on the last of a group only);
        True when it completes a group, i.e. an optimizer step is due."""
        p, t = self.p, self.times
        if not self.on_cpu:
            batch = _to_device(batch, p.info.device, self.non_blocking)
        t_fwd = time.perf_counter()
        t.data += t_fwd - t.asked
        self.window.samples += _batch_len(batch)
        if self.clock is not None:
            self.clock.ready = None
        if last and self.bare:  # what a hand-written loop does: no autocast, no scaler, no no_sync
            loss = self.loss_of(p.ddp, batch)
            if divisor > 1:
                loss = loss / divisor
            loss.backward()
        else:
            loss = self._backward_in_context(batch, divisor, last)
        t_bwd = time.perf_counter()
        compute_s, reduce_s = timing.split_backward(t_fwd, t_bwd, self.clock, synced=last)
        t.compute += compute_s
        t.reduce += reduce_s
        t.asked = t_bwd
        self.batches_done += 1
        self.epoch_samples += self.per_batch
        if self.o.grad_accum == 1:  # every micro-batch is a step
            self.window.losses.append(loss.detach())
            return True
        return self._add_loss(loss.detach(), divisor, last, group_len)

    def _backward_in_context(self, batch: Any, divisor: int, last: bool) -> torch.Tensor:
        """Forward (under autocast) and backward (scaled; under no_sync unless ``last``); the loss."""
        p = self.p
        with contextlib.nullcontext() if (last or not p.is_ddp) else cast("DistributedDataParallel", p.ddp).no_sync():
            with p.amp():
                loss = self.loss_of(p.ddp, batch)
            if divisor > 1:
                loss = loss / divisor
            (p.scaler.scale(loss) if p.scaler is not None else loss).backward()
        return loss

    def _add_loss(self, loss: torch.Tensor, divisor: int, last: bool, group_len: int) -> bool:
        """Keep a micro-batch's loss (grad_accum > 1); at the end of a group, the group's loss goes
        to the window."""
        self.group_losses.append(loss)
        if not last:
            return False
        group_loss = torch.stack(self.group_losses).sum()
        self.group_losses.clear()
        if group_len < divisor:  # an unsized epoch's short last group: undo part of 1/divisor
            for q in self.params:
                if q.grad is not None:
                    q.grad.mul_(divisor / group_len)
            group_loss = group_loss * (divisor / group_len)
        self.window.losses.append(group_loss)
        return True

    def _step(self) -> bool:
        """The optimizer step, then logging and checkpoints; True when max_steps is reached."""
        p, o, t = self.p, self.o, self.times
        _optimizer_step(p.opt, p.sched, p.scaler, self.params, o.grad_clip)
        t_end = time.perf_counter()
        if o.step_timing:
            TIMER.record(t_end - t.prev, t.data, t.compute, t.reduce, t_end - t.asked)
        t.prev = t.asked = t_end
        t.data = t.compute = t.reduce = 0.0
        self.step += 1
        self.window.steps += 1
        if self.step == self.first_step:
            runtime.use_training_timeout()
        self.progress.advance(self.step)
        if self.step % o.log_every == 0:
            self._flush_window()
        if o.checkpoint_every is not None and self.step % o.checkpoint_every == 0:
            with busy("checkpoint"):
                saved = p.ckpts.save(self.step, self.epoch, self._state)
            if saved:
                self.progress.message(f"checkpoint: {saved}")
            self._on_checkpoint(CheckpointSaved(saved, self.step, self.epoch, False,
                                                dict(self.history[-1] if self.history else {})))
        if o.max_steps is not None and self.step >= o.max_steps:
            self.done = True
        if PREEMPT.due(PROGRESS.steps) and not self.done:
            self._preempted()
        return self.done

    def _preempted(self) -> None:
        """The job's agreed preemption step (every rank is here): checkpoint, then stop (Preempted)."""
        t0 = time.monotonic()
        if self.window.steps:
            self._flush_window()

        def written(path: str) -> None:  # said before the save's barrier: a peer whose grace ended fails it
            PREEMPT.checkpoint_written((PROGRESS.steps, self.step, path, time.monotonic() - t0, "fit"))

        PREEMPT.saving = True  # an agent's stop meanwhile waits for it (bounded): worker/signals.py
        try:
            path, now = self._checkpoint_here(written)
        finally:
            PREEMPT.saving = False
        seconds = time.monotonic() - t0
        if path and not now:  # this position's file existed already: nothing was written, nothing said
            PREEMPT.checkpoint_written((PROGRESS.steps, self.step, path, seconds, "fit"))
        self._on_checkpoint(CheckpointSaved(path, self.step, self.epoch, False,
                                            dict(self.history[-1] if self.history else {})))
        PREEMPT.saved = (PROGRESS.steps, self.step, path or "", seconds, "fit")
        self.progress.message(f"ddprun: preempted ({PREEMPT.signame}): checkpoint at step {self.step} saved in "
                              f"{seconds:.1f} s" + (f": {path}" if path else ""))
        raise Preempted(PREEMPT.signame, self.step, path or "", seconds)

    def _on_checkpoint(self, saved: CheckpointSaved) -> None:
        """The user's on_checkpoint (an upload, say): a declared phase for the stall watchdog, and the
        other ranks wait for it with the generous timeout, as for a checkpoint write; then (every rank
        is here at the same step) a barrier and the training timeout again."""
        if self.o.on_checkpoint is None:
            return
        runtime.use_phase_timeout()
        with busy("on_checkpoint"):
            self.o.on_checkpoint(saved)
        if not saved.final:
            runtime.use_training_timeout()

    def _flush_window(self) -> None:
        info, w = self.p.info, self.window
        now = time.perf_counter()
        elapsed = max(now - w.t0, 1e-9)
        w.last = torch.stack(w.losses).mean()
        w.losses.clear()
        if info.is_main:  # the only read of the loss; other ranks keep theirs for the final mean
            loss_value = w.last.item()
            rate = w.samples * info.world_size / elapsed
            self.log.write(self.step, self.epoch, {"loss": loss_value, "samples_per_s": rate,
                                                   "step_time_s": elapsed / w.steps})
            self.progress.log(self.step, self.epoch, loss_value, rate)
        w.steps = w.samples = 0
        w.t0 = now

    def _validation(self, during_epoch: int) -> None:
        p = self.p
        with busy("validation"):
            self.val_result = _validate(p.module, p.val_loader, p.info, loss_fn=self.o.loss_fn,
                                        training_step=self.o.training_step, metrics=self.metrics, amp=p.amp)
        self.val_step = self.step
        self.history.append(self.val_result)
        self.log.write(self.step, during_epoch, self.val_result)
        self.progress.message(_format_val(self.step, during_epoch, self.val_result))

    def _state(self, rngs: list[dict]) -> dict[str, Any]:
        """The checkpoint's content now (``Checkpoints.save`` calls it on the writers)."""
        p = self.p
        return training_state(p.module, p.opt, p.sched, p.scaler, step=self.step, epoch=self.epoch,
                              batches_done=self.batches_done, samples_done=self.epoch_samples, seed=self.o.seed,
                              world_size=p.info.world_size, batch_size=p.batch_size, rng=rngs, history=self.history)

    def _checkpoint_here(self, written: Callable[[str], None] | None = None) -> tuple[str | None, bool]:
        """A checkpoint of this position, every rank together, no rank past it before it exists:
        (its path on rank 0, whether it was written now; ``written(path)`` on rank 0 as soon as it
        is). A position saved already (at this step, or a finished run resumed) keeps that file; one
        saved before its epoch counted is saved again."""
        p = self.p
        if p.ckpts.last_saved != (self.step, self.epoch):
            with busy("checkpoint"):
                return p.ckpts.save(self.step, self.epoch, self._state, final=True, written=written), True
        path = ckpt.latest(p.ckpts.directory) if p.info.is_main else None
        runtime.barrier()
        return path, False

    def _finish(self) -> FitResult:
        """The last log row, validation and checkpoint; the results, the same on every rank."""
        p, o, info = self.p, self.o, self.p.info
        if self.window.steps:
            self._flush_window()
        if p.val_loader is not None and self.val_step != self.step:
            self._validation(self.epoch if self.batches_done else self.epoch - 1)
        train_loss = _mean_over_ranks(self.window.last, info)
        path, written = self._checkpoint_here()
        if written and path:
            self.progress.message(f"checkpoint: {path}")
        if o.on_checkpoint is not None:
            results = {"train_loss": train_loss, **self.val_result} if train_loss is not None else dict(self.val_result)
            self._on_checkpoint(CheckpointSaved(path, self.step, self.epoch, True, results))
        resume_mod.mark_finished(p.ckpts.base, p.ckpts.ordinal)
        return FitResult(train_loss=train_loss, val_metrics=self.val_result, steps=self.step, epochs=self.epoch,
                         model=p.module, run_dir=p.run_dir, checkpoint=path, history=self.history)


def fit_module(model: nn.Module, train_data: Any, *, val_data: Any = None, **options: Any) -> FitResult:
    """Train a plain ``nn.Module`` data-parallel over every rank of the job; ``ddprun.fit`` documents
    the arguments (``options``: the fields of :class:`~ddprun.train.options.FitOptions`).

    Every rank calls it with the same arguments and gets the same :class:`FitResult` (``checkpoint``:
    rank 0 only). Raises ConfigError before any collective for a bad argument.
    """
    o = FitOptions.build(model, **options)
    # from here a preemption stops at one of this fit's steps, with its checkpoint: also one asked
    # during setup (a large checkpoint's load, DDP's init), which would otherwise stop the job at once
    PREEMPT.fit_active = True
    try:
        with setup_phase():  # its collectives do not start the stall watch's short bound: the first batch does
            loop = _Loop(_setup(model, train_data, val_data, o), o)
    except BaseException:
        PREEMPT.fit_active = False
        dirlock.release()
        raise
    ended = False
    try:
        result = loop.run()
        ended = True
        return result
    finally:
        loop.close(graceful=ended)


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
