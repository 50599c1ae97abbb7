"""``ddprun.ray.fit``: the same ``ddprun.fit`` run on a Ray cluster through Ray Train's TorchTrainer.

    import ddprun.ray
    result = ddprun.ray.fit(model, train_dataset, num_workers=8, max_failures=2, storage_path="/shared/ray",
                            loss_fn=F.cross_entropy, max_steps=10_000, checkpoint_every=500)

Why a function of its own rather than ``ddprun.fit(..., backend="ray")``: ``ddprun.fit`` is called
by every rank of a job that already runs; this one is called once, by the driver, and starts the
ranks (Ray actors). In each actor, Ray's TorchTrainer has already created the process group and set
torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR,
MASTER_PORT), so ``ddprun.fit`` (through :func:`ddprun.init`) joins that group as it would one of its
own: a plain ``nn.Module`` or a LightningModule, unchanged.

Checkpoints go through Ray: every checkpoint ddprun.fit saves (``checkpoint_every`` steps and at the
end) is reported with ``ray.train.report(metrics, checkpoint=Checkpoint.from_directory(...))`` from
rank 0 (the other ranks report the same metrics without one: Ray's report is a barrier). When a
worker fails and Ray restarts the worker group (``max_failures``), or a driver starts again with the
same ``name`` and ``storage_path``, ``ray.train.get_checkpoint()`` names the last reported
checkpoint and fit resumes from it (``resume=<that directory>``; Lightning: ``ckpt_path``). Across
several machines ``storage_path`` must be storage every node reaches (NFS, S3): Ray's rule.

This module imports ray (the ``ddprun[ray]`` extra); ``import ddprun`` does not import it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

try:
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("ddprun.ray needs Ray Train: pip install 'ddprun[ray]'") from e

from ddprun.errors import ConfigError, LaunchError, WorkerFailed
from ddprun.protocol.failure import looks_like_echo

__all__ = ["RayFitResult", "fit"]

MARK = "ddprun.json"
"""Written into every reported checkpoint: ``{"step": N, "epoch": E, "kind": "module"|"lightning"}``."""
LIGHTNING_CKPT = "last.ckpt"


@dataclass
class RayFitResult:
    """What :func:`fit` returns on the driver."""

    metrics: dict[str, Any]
    """Rank 0's last report: ``step``, ``epoch``, ``train_loss``, ``val_*``, ``resumed_from_step``
    (the step the last worker group started from: 0 when it started anew)."""
    checkpoint: Any
    """The last reported ``ray.train.Checkpoint`` (None if none was)."""
    model: Any
    """The model given to fit, with the final checkpoint's weights loaded (on the CPU); None when a
    model factory was given."""
    path: str
    """The Ray run's directory in ``storage_path`` (checkpoints, Ray's state)."""
    run_dir: str
    """ddprun's run directory (metrics.csv, local checkpoints) on the workers' machines."""
    result: Any
    """Ray's own ``ray.train.Result``."""
    wall_s: float
    """Seconds from the call until fit returned on the driver, Ray start included."""


def _is_lightning(model: Any) -> bool:
    return _lightning_package(model) is not None


def _lightning_package(model: Any) -> str | None:
    """``lightning.pytorch`` / ``pytorch_lightning`` / None (ddprun.api.lightning_package)."""
    from ddprun.api import lightning_package

    return lightning_package(model)


def _check(model: Any, num_workers: Any, max_failures: Any, after_fit: Any, fit_kwargs: Mapping[str, Any]) -> None:
    """ConfigError for what the driver reads itself, before ray.init starts or joins a cluster."""
    from torch import nn

    from ddprun.train.options import int_at_least

    if not isinstance(model, nn.Module) and not callable(model):
        raise ConfigError("ddprun.ray.fit trains an nn.Module or a LightningModule.",
                          seen=f"model: {type(model).__name__}",
                          hint="Pass the model, or a function that builds it in every worker (lambda: Net()).")
    if num_workers is not None and (isinstance(num_workers, bool) or not isinstance(num_workers, int)
                                    or num_workers < 1):
        raise ConfigError("num_workers must be an integer >= 1 or None.", seen=f"num_workers={num_workers!r}",
                          hint="One worker per GPU (the default on a GPU cluster); on CPU give e.g. num_workers=2.")
    if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < -1:
        raise ConfigError("max_failures must be an integer >= 0 (or -1: retry forever).",
                          seen=f"max_failures={max_failures!r}", hint="e.g. max_failures=2.")
    if after_fit is not None and not callable(after_fit):
        raise ConfigError("after_fit must be a callable (FitResult) -> None.",
                          seen=f"after_fit: {type(after_fit).__name__}",
                          hint="e.g. after_fit=lambda result: torch.save(result.model.state_dict(), path).")
    for key in ("resume", "on_checkpoint"):
        if key in fit_kwargs:
            raise ConfigError(f"ddprun.ray.fit sets {key} itself.", seen=f"{key}={fit_kwargs[key]!r}",
                              hint="Ray's checkpoint decides where a run resumes: give the same name= and "
                                   "storage_path= to continue a run, or another name to start anew.")
    # read here by Ray's CheckpointConfig, on the driver, before any worker's fit would check it
    int_at_least("keep_checkpoints", fit_kwargs.get("keep_checkpoints", 3), 1)


def _resources(use_gpu: bool | None, num_workers: int | None) -> tuple[bool, int]:
    """(use_gpu, num_workers): None = whatever the cluster has (every GPU), else CPU with 1 worker."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = gpus > 0 if use_gpu is None else use_gpu
    if num_workers is None:
        num_workers = gpus if use_gpu and gpus else 1
    return use_gpu, num_workers


def fit(model: Any, train_data: Any = None, *, num_workers: int | None = None, use_gpu: bool | None = None,
        resources_per_worker: Mapping[str, float] | None = None, max_failures: int = 0,
        storage_path: str | None = None, name: str | None = None, address: str | None = None,
        after_fit: Callable[[Any], None] | None = None, **fit_kwargs: Any) -> RayFitResult:
    """Run ``ddprun.fit(model, train_data, **fit_kwargs)`` on ``num_workers`` Ray workers; return on the driver.

    ``model``, ``train_data`` and the data in ``fit_kwargs`` (val_data, datamodule) are sent to
    every worker pickled (Ray's cloudpickle), or, when given as zero-argument functions (not
    modules/datasets), called in every worker to build them there (for what is large or not
    picklable). Every other keyword is ``ddprun.fit``'s, with its meaning; ``resume`` is Ray's to
    decide (module docstring). ``run_dir`` defaults to ``runs/<name>`` under the driver's cwd.

    Ray: ``ray.init(address=address)`` when Ray is not initialised yet (None: RAY_ADDRESS or a
    cluster already running here, else a new local one). ``num_workers``: None = every GPU of the
    cluster, else 1; ``use_gpu``: None = whether the cluster has GPUs (one per worker).
    ``resources_per_worker``: Ray's (e.g. ``{"CPU": 4, "GPU": 1}``). ``max_failures``: worker-group
    restarts after a failure (Ray's FailureConfig; each resumes from the last checkpoint: give
    ``checkpoint_every``). ``storage_path``/``name``: where Ray keeps the run (Ray's default:
    ~/ray_results; name: a new run id). ``after_fit(result)``: called in every worker with its
    FitResult (write per-rank outputs, evaluate); its return value is not kept.

    Raises :class:`~ddprun.errors.WorkerFailed` (``.rank``, ``.message``, ``.traceback``, ``.error``) when
    training failed after the retries: the lowest failed rank whose error is not an echo of another's,
    raised from Ray's error; or ConfigError/LaunchError before it starts.
    """
    t0 = time.monotonic()
    _check(model, num_workers, max_failures, after_fit, fit_kwargs)
    from ddprun.protocol.rundir import new_run_id
    from ddprun.runtime import DEFAULT_INIT_TIMEOUT_S

    if not ray.is_initialized():
        ray.init(address=address)
    use_gpu, num_workers = _resources(use_gpu, num_workers)
    name = name or new_run_id()
    run_dir = os.path.abspath(fit_kwargs.pop("run_dir", None) or os.path.join("runs", name))
    lightning = _is_module(model) and _is_lightning(model)  # a factory: only the workers know
    config = {"model": model, "train_data": train_data, "fit_kwargs": fit_kwargs, "run_dir": run_dir,
              "use_gpu": use_gpu, "after_fit": after_fit}
    scaling = ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                      resources_per_worker=dict(resources_per_worker) if resources_per_worker else None)
    run_config = ray.train.RunConfig(
        name=name, storage_path=storage_path,
        failure_config=ray.train.FailureConfig(max_failures=max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=fit_kwargs.get("keep_checkpoints", 3)),
    )
    # The process group's timeout before ddprun's first step: ddprun's init timeout (Ray: 30 min).
    trainer = TorchTrainer(_worker, train_loop_config=config, scaling_config=scaling, run_config=run_config,
                           torch_config=TorchConfig(timeout_s=int(DEFAULT_INIT_TIMEOUT_S)))
    try:  # raised from Ray's own error, whose text has every failed worker's traceback (.error: the rank's own)
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        raise _failure(e) from e
    error = getattr(result, "error", None)
    if error is not None:  # Ray versions that return the error instead of raising it
        raise _failure(error) from error
    trained = _load_final(model, result.checkpoint, lightning) if _is_module(model) else None
    return RayFitResult(metrics=dict(result.metrics or {}), checkpoint=result.checkpoint, model=trained,
                        path=str(result.path), run_dir=run_dir, result=result, wall_s=time.monotonic() - t0)


def _is_module(obj: Any) -> bool:
    from torch import nn

    return isinstance(obj, nn.Module)


def _failure(e: BaseException) -> LaunchError:
    """One exception for a failed Ray run: the error of the lowest failed rank whose failure is not only an
    echo of another's (protocol/failure.py ECHOES: "Connection closed by peer" when a peer died), with its
    traceback text."""
    failures = getattr(e, "worker_failures", None) or {}
    if not failures:
        return LaunchError("Ray Train failed before or outside the training workers.",
                           seen=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}",
                           hint="See Ray's output above (and `ray status`): resources, the cluster, the storage path.")
    errors = {rank: _unwrapped(err) for rank, err in failures.items()}
    own = [rank for rank, err in errors.items() if not looks_like_echo(f"{type(err).__name__}: {err}")]
    rank = min(own or errors)
    original = errors[rank]
    tb = (getattr(failures[rank], "_traceback_str", None) or _snippets(str(e)).get(rank)
          or "".join(traceback.format_exception(type(original), original, original.__traceback__)
                     if original.__traceback__ else []))
    others = sorted(r for r in failures if r != rank)
    first = (str(original).splitlines() or [""])[0][:300]
    return WorkerFailed(rank, f"{type(original).__name__}: {first}", traceback=tb, error=original,
                        others=f"ranks {others} failed too" if others else "",
                        hint="Fix the error above (ranks are Ray Train's world ranks); Ray's (RayTrainWorker ...) "
                             "lines above have each worker's output.")


def _unwrapped(err: BaseException) -> BaseException:
    """A worker's own exception. Ray Train V2 hands it over unwrapped; earlier versions wrapped it with its
    traceback text (UserExceptionWithTraceback: _base_exc, _traceback_str; Ray's private names)."""
    original = getattr(err, "_base_exc", None) or getattr(err, "cause", None)
    return original if isinstance(original, BaseException) else err


def _snippets(text: str) -> dict[int, str]:
    """Each rank's traceback text in Ray Train V2's WorkerGroupError message, which alone keeps it (the
    exceptions come back without their traceback): ``[Rank 0,2 Error Snippet]:`` then the text, for each
    group of like errors (ray/train/v2/_internal/execution/worker_group/poll.py ``get_error_string``; Ray
    shortens a long one to its first and last 500 characters)."""
    heads = list(re.finditer(r"^\[Rank ([\d,]+) Error Snippet\]:\n", text, re.M))
    out: dict[int, str] = {}
    for i, head in enumerate(heads):
        body = text[head.end():heads[i + 1].start() if i + 1 < len(heads) else len(text)].rstrip("\n")
        out.update((int(r), body) for r in head[1].split(",") if r.isdigit())
    return out


def _load_final(model: Any, checkpoint: Any, lightning: bool) -> Any:
    """The driver's ``model`` with the last reported checkpoint's weights (weights_only loads)."""
    if checkpoint is None:
        return model
    import torch

    from ddprun.train import checkpoint as ckpt

    with checkpoint.as_directory() as d:
        if lightning:
            state = torch.load(os.path.join(d, LIGHTNING_CKPT), map_location="cpu", weights_only=True)["state_dict"]
        else:
            state = ckpt.load(d)["model"]
    model.load_state_dict(state)
    return model


# -- in every Ray worker ---------------------------------------------------------------------------

def _build(obj: Any) -> Any:
    """``obj``, or ``obj()`` when it is a factory (a callable that is not a module or dataset)."""
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    if obj is None or isinstance(obj, (nn.Module, Dataset, DataLoader)) or not callable(obj):
        return obj
    return obj()


def _stage(files: list[str], step: int, epoch: int, kind: str) -> str:
    """A new directory with ``files`` (hard links where possible) and the MARK file."""
    stage = tempfile.mkdtemp(prefix="ddprun-ray-ckpt-")
    for path in files:
        target = os.path.join(stage, os.path.basename(path))
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
    with open(os.path.join(stage, MARK), "w") as fp:
        json.dump({"step": step, "epoch": epoch, "kind": kind}, fp)
    return stage


def _report(stage: str | None, metrics: dict[str, Any]) -> None:
    """ray.train.report on every rank (a barrier); rank 0 hands its staged checkpoint over."""
    try:
        checkpoint = ray.train.Checkpoint.from_directory(stage) if stage else None
        ray.train.report(metrics, checkpoint=checkpoint)
    finally:
        if stage:
            shutil.rmtree(stage, ignore_errors=True)  # Ray copied it to storage (synchronous upload)


def _module_reporter(resumed_from: int) -> Callable[[Any], None]:
    """fit's on_checkpoint: every checkpoint to Ray, with the results on the final one (Ray keeps the
    metrics of the latest checkpoint as the run's: Result.metrics)."""
    from ddprun.train.checkpoint import meta_path

    def on_checkpoint(saved: Any) -> None:
        stage = None
        if saved.path is not None:
            meta = meta_path(saved.path)
            stage = _stage([saved.path, *([meta] if os.path.exists(meta) else [])], saved.step, saved.epoch,
                           "module")
        _report(stage, {**saved.metrics, "step": saved.step, "epoch": saved.epoch, "resumed_from_step": resumed_from})

    return on_checkpoint


def _lightning_reporter(every: int | None, resumed_from: int, package: str = "lightning.pytorch") -> Any:
    """A Lightning callback that saves (``trainer.save_checkpoint``: every rank, rank 0 writes) and
    reports every ``every`` optimizer steps and at the end of training. ``package``: the model's
    Lightning package (its Trainer takes only that package's callbacks)."""
    import importlib

    Callback: Any = importlib.import_module(f"{package}.callbacks").Callback  # the model's package, known at run time

    class RayReport(Callback):
        def __init__(self) -> None:
            self.last = -1

        def _save(self, trainer: Any) -> None:
            step = trainer.global_step
            if step == self.last:
                return
            self.last = step
            scratch = tempfile.mkdtemp(prefix="ddprun-ray-lightning-")
            try:
                path = os.path.join(scratch, LIGHTNING_CKPT)
                trainer.save_checkpoint(path)  # a barrier inside; only global rank 0 writes
                stage = _stage([path], step, trainer.current_epoch, "lightning") if trainer.is_global_zero else None
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                       if getattr(v, "numel", lambda: 1)() == 1}
            _report(stage, {**metrics, "step": step, "epoch": trainer.current_epoch, "resumed_from_step": resumed_from})

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if every and trainer.global_step > 0 and trainer.global_step % every == 0:
                self._save(trainer)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._save(trainer)

    return RayReport()


def _restored_step(directory: str | None) -> int:
    if directory is None:
        return 0
    try:
        with open(os.path.join(directory, MARK)) as fp:
            return int(json.load(fp)["step"])
    except (OSError, ValueError, KeyError):
        return 0


def _check_rank(info: Any, use_gpu: bool) -> None:
    """ddprun's view of this worker must be Ray's: same rank, world size and device."""
    ctx = ray.train.get_context()
    ray_view = (ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank())
    if (info.rank, info.world_size, info.local_rank) != ray_view:
        raise LaunchError("ddprun and Ray Train disagree about this worker's place in the job.",
                          seen=f"ddprun rank {info.rank}/{info.world_size} local {info.local_rank}; Ray rank "
                               f"{ray_view[0]}/{ray_view[1]} local {ray_view[2]}",
                          hint="Do not set RANK/WORLD_SIZE/LOCAL_RANK in Ray's runtime_env.")
    if use_gpu:
        from ray.train.torch import get_device

        if get_device() != info.device:
            raise LaunchError("ddprun would train on another GPU than Ray gave this worker.",
                              seen=f"ddprun {info.device}, Ray {get_device()} (CUDA_VISIBLE_DEVICES="
                                   f"{os.environ.get('CUDA_VISIBLE_DEVICES')})",
                              hint="Give every worker one whole GPU (resources_per_worker={'GPU': 1}).")


def _worker(config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker: ddprun.fit in the process group Ray made."""
    from ddprun import runtime
    from ddprun.api import fit as ddp_fit

    # This actor's device kind is the job's choice, not what torch sees (ddprun.runtime reads it).
    from ddprun.protocol.env import DEVICE_KIND

    os.environ[DEVICE_KIND] = "cuda" if config["use_gpu"] else "cpu"
    runtime._reset()  # a reused worker process must not keep a previous run's RankInfo
    info = runtime.init()
    _check_rank(info, config["use_gpu"])
    model = _build(config["model"])
    kwargs = dict(config["fit_kwargs"])
    for key in ("val_data", "datamodule"):
        if key in kwargs:
            kwargs[key] = _build(kwargs[key])
    kwargs["run_dir"] = config["run_dir"]
    checkpoint = ray.train.get_checkpoint()
    with checkpoint.as_directory() if checkpoint is not None else nullcontext(None) as restored:
        resumed_from = _restored_step(restored)
        package = _lightning_package(model)
        if package is not None:
            kwargs["resume"] = os.path.join(restored, LIGHTNING_CKPT) if restored else False
            tk = dict(kwargs.get("trainer_kwargs") or {})
            callbacks = tk.get("callbacks") or []
            callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            tk["callbacks"] = [*callbacks, _lightning_reporter(kwargs.get("checkpoint_every"), resumed_from, package)]
            kwargs["trainer_kwargs"] = tk
        else:
            kwargs["resume"] = restored if restored else False
            kwargs["on_checkpoint"] = _module_reporter(resumed_from)
        result = ddp_fit(model, _build(config["train_data"]), **kwargs)
    if config["after_fit"] is not None:
        config["after_fit"](result)
