"""LightningModule on many nodes: a Trainer configured from the live launch.

Three ways in:

    ddprun.fit(lit_module, train_loader, max_steps=1000)          # ddprun builds and drives the Trainer
    Trainer(**ddprun.lightning.trainer_kwargs(), max_steps=1000)  # your own Trainer, launch's topology
    Trainer(devices=4, num_nodes=5, ...)                           # unmodified script under ``ddprun run``

The third works because ``ddprun run`` gives workers torchrun's environment, which Lightning reads
through its TorchElasticEnvironment; when its devices x num_nodes disagree with the launch, every rank
fails at once with one line naming both sides (:mod:`ddprun.mismatch`, and the
:class:`LaunchCheck` callback for the case Lightning lets through: a single-device Trainer, no
process group, under a multi-rank launch, i.e. every rank silently training its own copy).

Which cluster environment: :class:`DdprunEnvironment`, reading ddprun's resolved
:class:`~ddprun.runtime.RankInfo`. Lightning's TorchElasticEnvironment would do under ``ddprun run``
and torchrun, but under srun/mpirun (one process per rank) Lightning would pick SLURMEnvironment
(which checks srun's own variables and derives another port) or MPIEnvironment (needs mpi4py),
while ddprun has already resolved the ranks and master address from those launchers' variables. One
environment that reports what ddprun resolved keeps ddprun and Lightning agreeing everywhere.

This module imports lightning (the optional extra ``ddprun[lightning]``); ``import ddprun`` does not
import this module.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import pathlib
import pickle
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any, cast

PACKAGE: str = globals().get("PACKAGE", "lightning.pytorch")
"""The Lightning package this module drives. ddprun.pytorch_lightning runs this same source with
``PACKAGE = "pytorch_lightning"`` (the standalone package, whose classes are distinct from these)."""

if TYPE_CHECKING:  # mypy checks against lightning.pytorch; at run time the classes are PACKAGE's
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import DDPStrategy
else:
    try:
        pl = import_module(PACKAGE)
        Callback = import_module(f"{PACKAGE}.callbacks").Callback
        ModelCheckpoint = import_module(f"{PACKAGE}.callbacks").ModelCheckpoint
        CSVLogger = import_module(f"{PACKAGE}.loggers").CSVLogger
        ClusterEnvironment = import_module(f"{PACKAGE}.plugins.environments").ClusterEnvironment
        DDPStrategy = import_module(f"{PACKAGE}.strategies").DDPStrategy
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        extra = "lightning" if PACKAGE == "lightning.pytorch" else "pytorch-lightning"
        raise ImportError(f"{__name__} needs {PACKAGE}: pip install 'ddprun[{extra}]'") from e

from ddprun import runtime, telemetry
from ddprun.errors import CheckpointError, ConfigError
from ddprun.mismatch import TrainerMismatch, launch_shape
from ddprun.runtime import RankInfo
from ddprun.telemetry import SetupPhase, setup_phase
from ddprun.train import resume as resume_mod
from ddprun.train.loop import FitResult, resolve_run_dir
from ddprun.train.options import PRECISIONS, check_seed, int_at_least

__all__ = ["DdprunEnvironment", "LaunchCheck", "LightningFitResult", "LoopStart", "fit_lightning", "trainer_kwargs"]

LIGHTNING_PRECISION = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}

TRUSTED_TYPES: tuple[type, ...] = (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath,
                                   pathlib.WindowsPath, argparse.Namespace)
"""What a LightningModule's ``save_hyperparameters()`` commonly holds besides plain values (a data
directory, a script's parsed arguments), allowed to ``torch.load(weights_only=True)`` when fit resumes
(``torch.serialization.safe_globals``, for the resume only): each is rebuilt from plain values by its
own class, so a file still chooses no code to run. Any other class is named at fit's first save."""


class DdprunEnvironment(ClusterEnvironment):
    """Lightning's view of the ranks ddprun resolved (torchrun, ``ddprun run``, srun, mpirun, ...).

    The ranks are the launcher's: the setters Lightning calls are ignored. ``validate_settings``
    refuses a Trainer whose devices or devices x num_nodes differ from the launch."""

    def __init__(self, info: RankInfo | None = None):
        super().__init__()
        self._info = info or runtime.rank_info()

    @property
    def creates_processes_externally(self) -> bool:
        return True  # every rank is already running; Lightning must not start more

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR") or str(runtime._from_environ(os.environ)[0].master_addr)

    @property
    def main_port(self) -> int:
        port = os.environ.get("MASTER_PORT")
        return int(port) if port else int(runtime._from_environ(os.environ)[0].master_port)

    @staticmethod
    def detect() -> bool:
        return False  # chosen explicitly (trainer_kwargs / fit), never by Lightning's auto-detection

    def world_size(self) -> int:
        return self._info.world_size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self._info.rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._info.local_rank

    def node_rank(self) -> int:
        return self._info.node_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        info = self._info
        if num_devices != info.local_world_size or num_devices * num_nodes != info.world_size:
            raise TrainerMismatch(num_devices, num_nodes, _shape_environ(info), module=__name__)


def _shape_environ(info: RankInfo) -> dict[str, str]:
    """The launch's shape as TrainerMismatch reads it, from a RankInfo (srun/mpirun set no torchrun vars)."""
    return {"WORLD_SIZE": str(info.world_size), "LOCAL_WORLD_SIZE": str(info.local_world_size)}


def _nodes(info: RankInfo, environ: Mapping[str, str] | None = None) -> int:
    """WORLD_SIZE / LOCAL_WORLD_SIZE; ConfigError when nodes run different counts (Lightning assumes
    the same devices on every node), seen also where the division comes out whole (4 + 2 = 6 / 2 = 3
    "nodes"): torch's agent's GROUP_WORLD_SIZE, when set, must agree."""
    environ = os.environ if environ is None else environ
    group = environ.get("GROUP_WORLD_SIZE", "")
    nodes = info.world_size // info.local_world_size
    if info.world_size % info.local_world_size or (group.isdigit() and int(group) != nodes):
        raise ConfigError("Lightning needs the same number of processes on every node.",
                          seen=f"WORLD_SIZE={info.world_size}, this node's LOCAL_WORLD_SIZE={info.local_world_size}, "
                               f"GROUP_WORLD_SIZE={group or '<unset>'}",
                          hint="Start as many processes on every node (--nproc-per-node, or srun --ntasks-per-node), "
                               "without --allow-uneven-nodes.")
    return nodes


def trainer_kwargs(info: RankInfo | None = None, *, backend: str | None = None) -> dict[str, Any]:
    """``accelerator``, ``devices``, ``num_nodes`` and ``strategy`` for ``lightning.pytorch.Trainer``.

    From the live launch: devices = processes on this node (LOCAL_WORLD_SIZE), num_nodes =
    WORLD_SIZE / LOCAL_WORLD_SIZE, accelerator "gpu" when this rank's device is CUDA else "cpu",
    strategy a ``DDPStrategy`` over :class:`DdprunEnvironment` with process-group ``backend``
    (None: nccl on CUDA, gloo on CPU). A rank bound to a GPU of its own (``srun --gpus-per-task=1``:
    its device is cuda:0 whatever its local rank) gets devices=1 and a strategy whose devices are all
    that one, so that Lightning trains on it. One process (plain ``python``): devices=1, strategy "auto".
    ``info``: default :func:`ddprun.rank_info` (creates nothing; the Trainer makes the process group
    unless :func:`ddprun.init` ran first, which also applies ddprun's network settings across hosts
    under srun/mpirun).
    """
    info = info or runtime.rank_info()
    accelerator = "gpu" if info.device.type == "cuda" else "cpu"
    if info.world_size == 1:
        return {"accelerator": accelerator, "devices": 1, "num_nodes": 1, "strategy": "auto"}
    backend = backend or ("nccl" if accelerator == "gpu" else "gloo")
    env = DdprunEnvironment(info)
    if info.device.type == "cuda" and (info.bound or info.device.index != info.local_rank):
        # a GPU of its own (srun --gpus-per-task=1: cuda:0 at every local rank): Lightning's root device is
        # parallel_devices[local_rank], so every entry is this rank's device; devices=1 is what it sees
        strategy = DDPStrategy(parallel_devices=[info.device] * info.local_world_size, cluster_environment=env,
                               process_group_backend=backend)
        return {"accelerator": accelerator, "devices": 1, "num_nodes": _nodes(info), "strategy": strategy}
    return {"accelerator": accelerator, "devices": info.local_world_size, "num_nodes": _nodes(info),
            "strategy": DDPStrategy(cluster_environment=env, process_group_backend=backend)}


# -- callbacks ----------------------------------------------------------------------------------

class LaunchCheck(Callback):
    """Fails ``fit`` on every rank when the Trainer's world size is not the launch's.

    Lightning checks devices x num_nodes only in its DDP launcher; a Trainer that resolves to one
    device (``Trainer(devices=1)`` with the default strategy) under a multi-rank launch makes no
    process group and every rank trains alone. Added to every Trainer inside a ``ddprun run`` worker
    by Lightning's ``lightning.pytorch.callbacks_factory`` entry point
    (:func:`callbacks_factory` below). Only ``fit``: a single-device
    ``Trainer.test`` on one rank is common and fine."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        shape = launch_shape(os.environ)
        if stage != "fit" or shape is None or trainer.world_size == shape[2]:
            return
        note = "no process group: every rank would train its own copy" if trainer.world_size == 1 else ""
        raise TrainerMismatch(trainer.num_devices, trainer.num_nodes, os.environ, note, module=__name__)


class LoopStart(Callback):
    """Lightning's setup is not the training loop's start, for ddprun's stall watch: its barriers and
    broadcasts, the sanity check's DDP forwards and metric all-reduces run in a setup phase
    (:class:`ddprun.telemetry.SetupPhase`), so every rank keeps the longer first-step bound
    (max(2 x --stall-timeout, 30 s)) until its first training batch is in hand. Otherwise a first
    batch slower than ``--stall-timeout`` (a lazily opened dataset, DataLoader workers starting) was
    reported as a stall, and a healthy job ended by ``--stall-end-after``.

    The phase opens when the Trainer is built (its ``log_dir`` broadcast and first barrier, and a
    datamodule's ``setup``, come before any callback hook) and ends at its first training batch, at
    a stage other than ``fit``, at teardown or an exception, or when the Trainer is collected. At the
    ``fit`` setup hook the loop starts over (``Progress.restart``): a fit after ``trainer.validate``
    or another loop has not begun either. Added with :class:`LaunchCheck` by :func:`callbacks_factory`."""

    def __init__(self) -> None:
        self._open_phase()

    def _open_phase(self) -> None:
        self._phase = SetupPhase()
        weakref.finalize(self, self._phase.end)  # a Trainer dropped before its first batch

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            self._phase.end()
            return
        if self._phase.ended:  # this Trainer's second fit, or its fit after a validate
            self._open_phase()
        telemetry.PROGRESS.restart()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._phase.end()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._phase.end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._phase.end()

    # each evaluation batch is progress, as in ddprun.fit's own validation: trainer.validate, test and
    # predict make no collective per batch (no sync_dist), and the stall watch saw a healthy pass as a hang
    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        telemetry.heartbeat()

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        telemetry.heartbeat()

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        telemetry.heartbeat()


class _TrainingTimeout(Callback):
    """After the first optimizer step: ddprun's training timeout for collectives (one barrier on every
    rank: :func:`ddprun.runtime.use_training_timeout`); again after each checkpoint save, which
    returns to the long timeout (:class:`_Saves`), at the end of the next step."""

    def __init__(self) -> None:
        self.done = False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.done and trainer.global_step >= 1:
            self.done = True
            runtime.use_training_timeout()


class _PreemptAtStep(Callback):
    """``ddprun run``'s preemption (:mod:`ddprun.preempt`) in fit_lightning: right after the job's
    agreed optimizer step every rank saves ``last.ckpt`` (``trainer.save_checkpoint``: rank 0
    writes, every rank waits) and raises :class:`~ddprun.preempt.Preempted`, which ends
    ``trainer.fit`` without the validation a ``should_stop`` would run first. Lightning's own
    signal handlers are not installed meanwhile (:func:`_preemption_by_ddprun`): they would stop
    each rank at its own batch (lightning#21406)."""

    def __init__(self, ckpt_dir: str) -> None:
        self.ckpt_dir = ckpt_dir

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        from ddprun.preempt import PREEMPT, Preempted
        from ddprun.telemetry import PROGRESS

        if not PREEMPT.due(PROGRESS.steps):
            return
        t0 = time.monotonic()
        path = os.path.join(self.ckpt_dir, "last.ckpt")
        strategy = trainer.strategy
        barrier, own = strategy.barrier, vars(strategy).get("barrier")

        def said_first(*args: Any, **kwargs: Any) -> Any:
            # Lightning writes on rank 0, then every rank waits in this barrier: the file is said
            # before it, as a peer stopped meanwhile (its node's grace ended) fails it
            name = args[0] if args else kwargs.get("name")
            if name == "Trainer.save_checkpoint" and os.path.exists(path):
                PREEMPT.checkpoint_written((PROGRESS.steps, trainer.global_step, path, time.monotonic() - t0, "fit"))
            return barrier(*args, **kwargs)

        strategy.barrier = said_first  # type: ignore[method-assign]
        _chain_last(trainer, path)
        try:
            trainer.save_checkpoint(path)
        finally:
            if own is None:
                del strategy.barrier  # the class's own again
            else:
                strategy.barrier = own  # type: ignore[method-assign]
        seconds = time.monotonic() - t0
        PREEMPT.saved = (PROGRESS.steps, trainer.global_step, path, seconds, "fit")
        raise Preempted(PREEMPT.signame, trainer.global_step, path, seconds)


def _chain_last(trainer: pl.Trainer, path: str) -> None:
    """Each ModelCheckpoint whose last checkpoint is ``path`` takes it as its own (``last_model_path``)
    before the preemption's save, whose state then holds it: after the resume its next save replaces
    ``path``, where with an empty ``last_model_path`` (no save of its own before the preemption)
    Lightning's version counter would write ``last-v1.ckpt`` and leave ``path``, what every restart
    resumes from, at the preemption's step."""
    target = os.path.realpath(path)
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.save_last and cb.dirpath:
            own = os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
            if os.path.realpath(own) == target:
                cb.last_model_path = own


class _Saves:
    """``trainer.save_checkpoint`` of fit_lightning's Trainer (ModelCheckpoint's saves and the
    preemption's go through it), as ``ddprun.fit`` of an nn.Module saves (train/resume.py
    ``Checkpoints.save``): the long (init) timeout while rank 0 writes and the others wait in
    Lightning's barrier, the training timeout again after the next step (``timeout``), and a declared
    ``checkpoint`` phase for the stall watch (``telemetry.busy``). After the first save, rank 0 checks
    that the file loads back with ``torch.load(weights_only=True)`` (what the resume does) and raises
    CheckpointError naming what it would refuse, file removed: found when it is written, not at the
    restart that needs it (a crash loop under --max-restarts)."""

    def __init__(self, trainer: pl.Trainer, timeout: _TrainingTimeout) -> None:
        self.checked = False
        self.timeout = timeout
        self._save = trainer.save_checkpoint
        trainer.save_checkpoint = self.save  # type: ignore[method-assign]
        self._trainer = weakref.ref(trainer)

    def save(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        runtime.use_phase_timeout()  # no collective: each rank's own waits
        self.timeout.done = False
        with telemetry.busy("checkpoint"):
            self._save(filepath, *args, **kwargs)
        trainer = self._trainer()
        if not self.checked and trainer is not None and trainer.is_global_zero and os.path.isfile(filepath):
            self.checked = True
            _check_loadable(os.fspath(filepath), trainer.global_step)


def _refused(path: str) -> list[str]:
    """The classes in ``path`` that ``torch.load(weights_only=True)`` refuses, TRUSTED_TYPES allowed."""
    import torch

    with torch.serialization.safe_globals(list(TRUSTED_TYPES)):
        try:
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except (ValueError, RuntimeError, OSError):  # not torch's zip format: torch.load's own check at resume
            return []


def _check_hparams(*owners: Any) -> None:
    """Before training: the hyperparameters every checkpoint will hold (``save_hyperparameters()`` of
    the module and the datamodule) load back with ``torch.load(weights_only=True)``, TRUSTED_TYPES
    allowed; else a ConfigError naming the classes now, not at the first save, an epoch or hours in
    (:class:`_Saves` checks the rest of a checkpoint there)."""
    import io

    import torch

    values = {str(i): dict(getattr(o, "hparams", None) or {}) for i, o in enumerate(owners) if o is not None}
    buf = io.BytesIO()
    try:
        torch.save(values, buf)
        buf.seek(0)
        with torch.serialization.safe_globals(list(TRUSTED_TYPES)):
            refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(buf))
    except Exception:  # noqa: BLE001 - not picklable at all, say: Lightning's own save names it
        return
    if refused:
        raise ConfigError("The module's hyperparameters hold a class that a resume could not load.",
                          seen=f"save_hyperparameters() holds {', '.join(refused)}, which "
                               "torch.load(weights_only=True) refuses (every checkpoint holds them)",
                          hint=_ALLOW_HINT)


def _check_loadable(path: str, step: int) -> None:
    refused = _refused(path)
    if refused:
        from ddprun.protocol.atomic import remove_durably

        remove_durably(path)
        raise CheckpointError(f"The checkpoint of step {step} could not be loaded back, so it was not kept.",
                              seen=f"{os.path.basename(path)} holds {', '.join(refused)}, which "
                                   "torch.load(weights_only=True) refuses",
                              hint=_ALLOW_HINT)


_ALLOW_HINT = ("A Lightning checkpoint holds the module's save_hyperparameters() values: keep them plain (str, "
               "numbers, lists, dicts; a Path or an argparse.Namespace is allowed), or allow the class with "
               "torch.serialization.add_safe_globals([...]) in the script before fit().")


@contextlib.contextmanager
def _loading_trusted(path: str | None) -> Iterator[None]:
    """Around ``trainer.fit(ckpt_path=path, weights_only=True)``: TRUSTED_TYPES allowed, and a load
    that torch refuses for a class is a ConfigError naming it."""
    import torch

    try:
        with torch.serialization.safe_globals(list(TRUSTED_TYPES)):
            yield
    except pickle.UnpicklingError as e:
        refused = _refused(path) if path is not None else []  # none: another unpickling error, as it is
        if not refused:
            raise
        raise ConfigError("The checkpoint to resume from holds a class that torch.load(weights_only=True) refuses.",
                          seen=f"{path} holds {', '.join(refused)}", hint=_ALLOW_HINT) from e


@contextlib.contextmanager
def _preemption_by_ddprun(trainer: pl.Trainer) -> Iterator[None]:
    """Inside a ``ddprun run`` worker that catches preemption signals: the agreed step is fit's (the
    monitor proposes one) and Lightning installs no signal handler of its own."""
    from ddprun.preempt import PREEMPT

    connector = getattr(trainer, "_signal_connector", None)
    if not PREEMPT.signals or connector is None:
        yield
        return
    connector.register_signal_handlers = lambda: None  # private in Lightning; absent: its handlers run
    PREEMPT.fit_active = True
    try:
        yield
    finally:
        PREEMPT.fit_active = False


# -- fit ----------------------------------------------------------------------------------------

@dataclass
class LightningFitResult(FitResult):
    """:class:`~ddprun.FitResult` of a LightningModule; ``history`` stays empty (see the CSV log)."""

    trainer: Any = None
    """The ``lightning.pytorch.Trainer`` that ran."""


_FIT_ARGS = {"ckpt_path": "resume", "max_epochs": "epochs", "max_steps": "max_steps", "precision": "precision",
             "accumulate_grad_batches": "grad_accum", "gradient_clip_val": "grad_clip",
             "log_every_n_steps": "log_every", "default_root_dir": "run_dir"}
_NOT_FOR_LIGHTNING = ("loss_fn", "training_step", "optimizer", "scheduler", "val_metrics")


def _check(model: Any, train_data: Any, val_data: Any, datamodule: Any, trainer_kw: Any, unused: Mapping[str, Any],
           numbers: Mapping[str, Any]) -> None:
    """Every check that needs no process group (ConfigError with a HINT, on every rank alike)."""
    given = [name for name in _NOT_FOR_LIGHTNING if unused.get(name) is not None]
    if given:
        raise ConfigError("fit() got arguments for a plain nn.Module with a LightningModule.",
                          seen=f"{', '.join(given)} given for {type(model).__name__}",
                          hint="The LightningModule's training_step, validation_step and configure_optimizers "
                               "define them: leave these out.")
    if datamodule is not None and not isinstance(datamodule, pl.LightningDataModule):
        raise ConfigError("datamodule must be a LightningDataModule.", seen=f"datamodule: {type(datamodule).__name__}",
                          hint="Pass train_data/val_data (Datasets or DataLoaders) instead, or a LightningDataModule.")
    if (train_data is None) == (datamodule is None) or (datamodule is not None and val_data is not None):
        raise ConfigError("fit() with a LightningModule needs either train_data (and maybe val_data) or a datamodule.",
                          seen=f"train_data={'given' if train_data is not None else None}, "
                               f"val_data={'given' if val_data is not None else None}, "
                               f"datamodule={type(datamodule).__name__ if datamodule is not None else None}",
                          hint="ddprun.fit(model, train_loader, val_data=val_loader), or "
                               "ddprun.fit(model, datamodule=dm).")
    if trainer_kw is not None and not isinstance(trainer_kw, Mapping):
        raise ConfigError("trainer_kwargs must be a dict of lightning.pytorch.Trainer arguments.",
                          seen=f"trainer_kwargs: {type(trainer_kw).__name__}",
                          hint="e.g. trainer_kwargs={'max_time': '00:01:00'}.")
    clash = sorted(k for k in (trainer_kw or {}) if k in _FIT_ARGS)
    if clash:
        raise ConfigError("trainer_kwargs repeats arguments fit() has itself.", seen=f"trainer_kwargs keys {clash}",
                          hint="Give them to fit: " + ", ".join(f"{k} -> {_FIT_ARGS[k]}=" for k in clash) + ".")
    int_at_least("epochs", numbers["epochs"], 1, optional=True)
    int_at_least("max_steps", numbers["max_steps"], 1, optional=True)
    int_at_least("batch_size", numbers["batch_size"], 1)
    int_at_least("grad_accum", numbers["grad_accum"], 1)
    int_at_least("log_every", numbers["log_every"], 1)
    check_seed(numbers["seed"])
    int_at_least("num_workers", numbers["num_workers"], 0, optional=True)
    int_at_least("checkpoint_every", numbers["checkpoint_every"], 1, optional=True)
    if str(numbers["precision"]) not in PRECISIONS:
        raise ConfigError("Unknown precision.", seen=f"precision={numbers['precision']!r}",
                          hint="Use '32' (default), 'bf16' or '16' (CUDA only); Lightning's '32-true', "
                               "'bf16-mixed', '16-mixed' are accepted.")


def _launch_args(info: RankInfo, trainer_kw: dict[str, Any]) -> dict[str, Any]:
    """trainer_kwargs() of the live launch. The user's accelerator/devices/num_nodes must agree with it
    (any of Lightning's spellings: "cuda" or "gpu", devices "auto", -1, a count, or the GPU indices
    0..n-1); they are taken out of ``trainer_kw``, so the Trainer gets the launch's own values (on
    CPU Lightning reads devices="auto" as 1)."""
    launch = trainer_kwargs(info)
    devices = _device_count(trainer_kw.pop("devices", info.local_world_size), info)
    nodes = trainer_kw.pop("num_nodes", launch["num_nodes"])
    if (devices, nodes) != (info.local_world_size, launch["num_nodes"]):
        raise TrainerMismatch(devices, nodes, _shape_environ(info), module=__name__)
    accelerator = trainer_kw.get("accelerator", "auto")
    if isinstance(accelerator, str):
        if {"cuda": "gpu"}.get(accelerator.lower(), accelerator.lower()) not in (launch["accelerator"], "auto"):
            raise ConfigError("trainer_kwargs' accelerator differs from the device this rank was given.",
                              seen=f"accelerator={accelerator!r}, rank device {info.device}",
                              hint="Leave accelerator out; ddprun run --device cpu|cuda chooses it for the job.")
        trainer_kw.pop("accelerator", None)
    return launch


def _device_count(devices: Any, info: RankInfo) -> int:
    """How many devices a Trainer's ``devices`` asks for on this node: "auto" and -1 mean every one
    the launch gave it (one process each); GPU indices must be 0..n-1 (each rank is on its own)."""
    n = info.local_world_size
    if devices in ("auto", -1, "-1"):
        return n
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, str) and "," in devices:
        parts = [p.strip() for p in devices.split(",") if p.strip()]
        devices = [int(p) for p in parts] if all(p.isdigit() for p in parts) else devices
    if isinstance(devices, (list, tuple)) and sorted(devices) == list(range(len(devices))):
        return len(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return devices
    raise ConfigError("trainer_kwargs' devices is not this launch's devices.",
                      seen=f"devices={devices!r}; this node runs {n} process(es), each on its own device "
                           f"(this rank: {info.device})",
                      hint=f"Leave devices out (the launch gives each rank its device), or give devices={n}.")


def fit_lightning(model: pl.LightningModule, train_data: Any = None, *, val_data: Any = None, datamodule: Any = None,
                  epochs: int | None = None, max_steps: int | None = None, batch_size: int = 32, grad_accum: int = 1,
                  precision: str = "32", grad_clip: float | None = None, seed: int = 0, num_workers: int | None = None,
                  checkpoint_dir: str | None = None, run_dir: str | None = None, log_every: int = 50,
                  checkpoint_every: int | None = None, resume: bool | str = "auto",
                  trainer_kwargs: Mapping[str, Any] | None = None, **nn_module_only: Any) -> LightningFitResult:
    """What ``ddprun.fit`` does with a LightningModule: build a ``lightning.pytorch.Trainer`` for the
    live launch and run ``trainer.fit``. Arguments mean what they mean for ``ddprun.fit``, mapped:

      epochs -> max_epochs (None: 1, or unbounded with max_steps), max_steps, grad_accum ->
      accumulate_grad_batches, grad_clip -> gradient_clip_val, log_every -> log_every_n_steps,
      precision "32"/"bf16"/"16" -> "32-true"/"bf16-mixed"/"16-mixed", run_dir -> default_root_dir.

    Data: train_data/val_data are Datasets or DataLoaders. Training batches are sharded by ddprun
    as in ``ddprun.fit`` (DistributedSampler seeded with ``seed``, batch_size and num_workers as
    there), which Lightning keeps. Validation is sharded by Lightning (DistributedSampler without
    shuffling, padded so that every rank runs as many validation steps: ``self.log(...,
    sync_dist=True)`` per step must not hang). Or a ``datamodule`` (LightningDataModule): its loaders
    are Lightning's, sharded by Lightning.

    Defaults (each replaced by the same key in ``trainer_kwargs``): a DDPStrategy over
    :class:`DdprunEnvironment` (gloo on CPU, nccl on CUDA) when world_size > 1; ``logger``
    CSVLogger(run_dir, name="lightning_logs"); a ModelCheckpoint(run_dir/checkpoints or
    ``checkpoint_dir``, save_last=True) unless ``callbacks`` has one or enable_checkpointing=False; a
    ModelCheckpoint in ``callbacks`` without a dirpath saves into that directory too (a restart resumes
    from its ``last.ckpt``: give it save_last=True).
    ``trainer_kwargs``: any other Trainer arguments (callbacks are added to ddprun's). accelerator,
    devices and num_nodes come from the launch; given there, they must agree with it ("cuda" or "gpu",
    devices "auto", -1, the count or the indices 0..n-1).

    Checkpoints and restarts: ``checkpoint_every`` N also saves every N optimizer steps (default:
    Lightning's, at every epoch end); ``resume`` "auto" continues from ``last.ckpt`` in the
    checkpoint directory when there is one (what a worker group restarted by ``--max-restarts``
    finds), True requires it, False starts anew, a path is passed to ``trainer.fit(ckpt_path=...)``.
    As for an nn.Module (train/resume.py), each fit() of the process into one checkpoint directory
    has its own (the n-th after the first in ``fit-<n>/``), and one that starts anew moves the
    ``.ckpt`` files there to ``previous-<k>/``.

    The process group is :func:`ddprun.init`'s (two-phase timeouts; Lightning reuses it). ``seed``
    does not reseed the global RNG (call ``lightning.seed_everything`` before building the model).
    Returns a :class:`LightningFitResult`; ``checkpoint`` is the last checkpoint's path on rank 0.
    """
    _check(model, train_data, val_data, datamodule, trainer_kwargs, nn_module_only,
           {"epochs": epochs, "max_steps": max_steps, "batch_size": batch_size, "grad_accum": grad_accum,
            "log_every": log_every, "seed": seed, "num_workers": num_workers, "precision": precision,
            "checkpoint_every": checkpoint_every})
    unknown = sorted(set(nn_module_only) - set(_NOT_FOR_LIGHTNING))
    if unknown:
        raise TypeError(f"fit_lightning() got unexpected keyword arguments {unknown}")
    user = dict(trainer_kwargs or {})
    _check_hparams(model, datamodule)
    info = runtime.init()
    settings = _launch_args(info, user)
    run_dir = resolve_run_dir(run_dir, info)
    train_loader, val_loader = _loaders(train_data, val_data, batch_size, info, seed, num_workers)
    ckpt_dir = checkpoint_dir or os.path.join(run_dir, "checkpoints")
    n = resume_mod.ordinal(ckpt_dir)  # as for an nn.Module: each fit() of the process its own last.ckpt
    own = resume_mod.slot(ckpt_dir, n)
    # the user's callbacks are added to ddprun's, not given to the Trainer in place of them
    callbacks = _callbacks(user.pop("callbacks", None), user.get("enable_checkpointing", True), own,
                           checkpoint_every, info)
    timeout = _TrainingTimeout()
    callbacks += [timeout, _PreemptAtStep(own)]
    if epochs is None:
        epochs = 1 if max_steps is None else -1  # -1: Lightning's "unbounded"
    settings.update(
        max_epochs=epochs, max_steps=max_steps if max_steps is not None else -1,
        precision=LIGHTNING_PRECISION[PRECISIONS[str(precision)]], accumulate_grad_batches=grad_accum,
        gradient_clip_val=grad_clip, log_every_n_steps=log_every, default_root_dir=run_dir,
        logger=CSVLogger(run_dir, name="lightning_logs"),
    )
    trainer = pl.Trainer(**{**settings, **user, "callbacks": callbacks})
    _Saves(trainer, timeout)
    safe = {"weights_only": True} if "weights_only" in inspect.signature(trainer.fit).parameters else {}
    ckpt_path = _start(ckpt_dir, n, resume, info)
    with _preemption_by_ddprun(trainer), _loading_trusted(ckpt_path):
        trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader, datamodule=datamodule,
                    ckpt_path=ckpt_path, **safe)  # no code runs on resume: TRUSTED_TYPES only
    resume_mod.mark_finished(ckpt_dir, n)  # not after a preemption (Preempted): the next start continues
    return _result(trainer, model, run_dir, info)


def _loaders(train_data: Any, val_data: Any, batch_size: int, info: RankInfo, seed: int,
             num_workers: int | None) -> tuple[Any, Any]:
    """(train, val) loaders for ``trainer.fit``; (None, None) with a datamodule. Training batches are
    sharded by ddprun (as in ``ddprun.fit``), validation by Lightning."""
    if train_data is None:
        return None, None
    from ddprun.train.data import build_train_loader

    train_loader = build_train_loader(train_data, batch_size=batch_size, info=info, seed=seed,
                                      num_workers=num_workers).loader
    val_loader = _val_loader(val_data, batch_size, info, num_workers) if val_data is not None else None
    return train_loader, val_loader


def _callbacks(given: Any, checkpointing: bool, ckpt_dir: str, every: int | None, info: RankInfo) -> list:
    """The user's callbacks (one or a list), and a ModelCheckpoint unless they have one or checkpointing
    is off. A ModelCheckpoint of the user's without a dirpath
    saves into ``ckpt_dir`` (Lightning's default, the logger's version directory, is not where a
    restart looks); one warning when none of them writes ``ckpt_dir/last.ckpt``, what it resumes from."""
    callbacks = given or []
    callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    own = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    for cb in own:
        if cb.dirpath is None:
            cb.dirpath = os.path.realpath(os.path.expanduser(ckpt_dir))  # as ModelCheckpoint(dirpath=) keeps it
    last = os.path.realpath(os.path.join(ckpt_dir, "last.ckpt"))
    if checkpointing and own and info.is_main and not any(
            cb.save_last and os.path.realpath(os.path.join(cb.dirpath or "", cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION))
            == last for cb in own):
        warnings.warn(f"ddprun: no ModelCheckpoint in trainer_kwargs' callbacks writes {last}, which a restarted "
                      "fit resumes from: a restart starts anew unless it was a preemption. HINT: "
                      "ModelCheckpoint(save_last=True), without a dirpath (fit's checkpoint directory).", stacklevel=4)
    if checkpointing and not own:
        # no version counter: a last.ckpt there is this run's (a restart resumed from it), never another's
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=every,
                                         enable_version_counter=False))
    return callbacks


def _start(ckpt_dir: str, n: int, resume: Any, info: RankInfo) -> str | None:
    """The nn.Module path's rules (train/resume.py) for fit ``n`` of this process into ``ckpt_dir``:
    ``trainer.fit``'s ckpt_path (every rank agrees); a later fit that starts anew says so, and one
    that does not continue from its slot's checkpoints has rank 0 move them aside (never deleted)."""
    own = resume_mod.slot(ckpt_dir, n)
    ckpt_path = _agreed(_resume_path(resume, own, resume_mod.slot(ckpt_dir, n - 1) if n else None), info)
    if ckpt_path is None and n and resume == "auto":
        # stacklevel: the user's ddprun.fit line (_start <- fit_lightning <- ddprun.api.fit)
        resume_mod.warn_anew(ckpt_dir, own, info, stacklevel=4)
    if resume is False or (resume == "auto" and ckpt_path is None):  # a new run (train/resume.py Checkpoints.open)
        with setup_phase():
            resume_mod.set_aside_on_writers(info, info.is_main, ckpt_dir, n, lambda name: name.endswith(".ckpt"),
                                            ckpt_path)
    return ckpt_path


def _resume_path(resume: bool | str | os.PathLike, ckpt_dir: str, previous: str | None = None) -> str | None:
    """``trainer.fit``'s ckpt_path for fit's ``resume`` (the same value on every rank); resume=True
    falls back to ``previous``'s last.ckpt (the fit before this one in the process)."""
    if resume is False:
        return None
    if resume in ("auto", True):
        path = os.path.join(ckpt_dir, "last.ckpt")
        if resume is True and previous is not None and not os.path.exists(path):
            path = os.path.join(previous, "last.ckpt")
    elif isinstance(resume, (str, os.PathLike)):
        path = os.fspath(resume)
    else:
        raise ConfigError("resume must be 'auto', True, False, or a checkpoint file or directory.",
                          seen=f"resume={resume!r}", hint="Leave it at 'auto', give False to start anew, or a path.")
    if os.path.isdir(path):
        path = os.path.join(path, "last.ckpt")
    if os.path.exists(path):
        return path
    if resume == "auto":
        return None
    raise ConfigError("There is no checkpoint to resume from.", seen=f"resume={resume!r}: {path} does not exist",
                      hint="Give resume='auto' (start anew when there is none) or the path of a Lightning .ckpt file.")


def _agreed(path: str | None, info: RankInfo) -> str | None:
    """``path`` if every rank found its checkpoint, None if none did; else a ConfigError (on every
    rank: one all_gather_object at setup), since ranks resuming from different states would diverge."""
    if not (info.distributed and info.world_size > 1):
        return path
    import torch.distributed as dist

    found: list[Any] = [None] * info.world_size
    with setup_phase():
        dist.all_gather_object(found, path)
    if len(set(found)) == 1:
        return path
    if all(f is not None for f in found):  # resume=True's fallback to the fit before, seen by some ranks only
        raise ConfigError("The ranks found different checkpoints to resume from.",
                          seen=", ".join(f"rank {r}: {f}" for r, f in enumerate(found) if f != found[0])
                               + f" (rank 0: {found[0]})",
                          hint="Put checkpoint_dir (or the run dir) on storage every node shares, or give a path.")
    raise ConfigError("Only some ranks can see the checkpoint to resume from.",
                      seen=f"ranks with it: {[r for r, f in enumerate(found) if f]}, "
                           f"without: {[r for r, f in enumerate(found) if not f]}",
                      hint="Put checkpoint_dir (or the run dir) on storage every node shares, or give resume=False.")


def _val_loader(data: Any, batch_size: int, info: RankInfo, num_workers: int | None) -> Any:
    """A DataLoader as given; a Dataset in a new one with ddprun's worker defaults. Not sharded here."""
    from torch.utils.data import DataLoader, Dataset

    from ddprun.train.data import choose_num_workers, loader_options

    if isinstance(data, DataLoader):
        return data
    if not isinstance(data, Dataset):
        raise ConfigError("val_data is neither a torch Dataset nor a DataLoader.",
                          seen=f"val_data: {type(data).__name__}",
                          hint="Wrap tensors in torch.utils.data.TensorDataset(x, y), or pass a DataLoader.")
    workers = choose_num_workers(num_workers, data, info.local_world_size, warn=False)
    return DataLoader(data, batch_size=batch_size, **loader_options(workers, info.device.type))


def _result(trainer: pl.Trainer, model: pl.LightningModule, run_dir: str, info: RankInfo) -> LightningFitResult:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    train_loss = next((metrics[k] for k in ("train_loss", "loss", "train_loss_epoch") if k in metrics), None)
    # typed Checkpoint; only a ModelCheckpoint has these paths (a user's other Checkpoint, first, fails here)
    ckpt = cast("ModelCheckpoint | None", trainer.checkpoint_callback)
    path = (ckpt.last_model_path or ckpt.best_model_path or None) if ckpt is not None and info.is_main else None
    loop = trainer.fit_loop
    # Lightning counts an epoch stopped by max_steps as completed; FitResult.epochs does not.
    epochs = loop.epoch_progress.current.completed - (0 if loop.epoch_loop.batch_progress.is_last_batch else 1)
    return LightningFitResult(
        train_loss=train_loss, val_metrics={k: v for k, v in metrics.items() if k.startswith("val")},
        steps=trainer.global_step, epochs=max(0, epochs), model=model,
        run_dir=run_dir, checkpoint=path, trainer=trainer)


def callbacks_factory() -> list:
    """Lightning's ``lightning.pytorch.callbacks_factory`` entry point (pyproject.toml): Lightning calls
    it in every ``Trainer()`` wherever ddprun is installed. Inside a multi-rank ``ddprun run`` worker
    (DDPRUN_RUN_DIR set, WORLD_SIZE > 1) it returns ddprun.lightning's LaunchCheck and LoopStart;
    elsewhere nothing."""
    shape = launch_shape(os.environ)
    if not os.environ.get("DDPRUN_RUN_DIR") or shape is None or shape[2] <= 1:
        return []
    return [LaunchCheck(), LoopStart()]
