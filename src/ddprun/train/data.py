"""Samplers and DataLoader defaults for :func:`ddprun.fit` that shard correctly and don't hang.

Training data is split with :class:`~torch.utils.data.DistributedSampler` (shuffle, the shared
``seed``, ``drop_last=False``: DDP's default, which pads the last round by repeating the first
samples so that every rank runs the same number of steps). It is used with one process too, so that
one process with batch 4b sees the same global batches as 4 ranks with batch b. Its subclass
:class:`ResumableSampler` (the same order) can also start an epoch part-way, for a resumed run.

Validation data is split without padding (:class:`ShardSampler`): shards may differ by one sample,
and the metrics are reduced as sums and counts, so nothing is counted twice.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import warnings
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
)

from ddprun import loaderworkers
from ddprun._util import die_with_parent
from ddprun.cpus import cpu_count
from ddprun.errors import ConfigError
from ddprun.preempt import PREEMPT
from ddprun.runtime import RankInfo
from ddprun.train import mainguard

DEFAULT_MAX_WORKERS = 2


class ShardSampler(Sampler[int]):
    """Indices ``rank, rank + world, ...`` in order: every sample exactly once over all ranks."""

    def __init__(self, n: int, rank: int, world_size: int):
        self.n, self.rank, self.world_size = n, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.n, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world_size))


class ResumableSampler(DistributedSampler):
    """torch's DistributedSampler (the same order, bit for bit) that can start one epoch part-way.

    :meth:`resume_at` ``(epoch, samples_done)``: in that epoch, the first ``samples_done`` positions
    of the epoch's global order (the shuffled, padded index list every rank takes its share of)
    count as taken; the rest is shared out as usual. With the world size and batch size of the run
    that saved ``samples_done = batches * batch_size * world_size``, every rank continues with
    exactly the batches it would have had. With another world size (a node lost under ``--nnodes
    MIN:MAX``) the rest of the epoch is split over the ranks there are (padded by repeating its
    first samples so that every rank has as many): no sample of the epoch is skipped, a few repeat.
    Other epochs are untouched.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, samples_done: int) -> None:
        self._resume = (epoch, samples_done) if samples_done > 0 else None

    def _order(self) -> list[int]:
        """The epoch's padded global order, built as DistributedSampler.__iter__ builds it before each
        rank takes every num_replicas-th index (tests compare the two)."""
        size = len(cast(Sized, self.dataset))  # map-style: DistributedSampler takes len() too
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(size, generator=g).tolist()
        else:
            indices = list(range(size))
        if self.drop_last:
            return indices[:self.total_size]
        pad = self.total_size - len(indices)
        return indices + (indices * math.ceil(pad / len(indices)))[:pad]

    def _rest(self) -> list[int] | None:
        """The rest of the resumed epoch's order, padded to a multiple of the world size; None in other epochs."""
        if self._resume is None or self._resume[0] != self.epoch:
            return None
        rest = self._order()[self._resume[1]:]
        pad = (-len(rest)) % self.num_replicas
        if rest and pad:
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        rest = self._rest()
        if rest is None:
            return super().__iter__()
        return iter(rest[self.rank::self.num_replicas])

    def __len__(self) -> int:
        rest = self._rest()
        return super().__len__() if rest is None else len(rest) // self.num_replicas


def worker_bound(local_world_size: int, cpus: int | None = None) -> int:
    """Most DataLoader workers per rank: this node's CPUs shared by its ranks (may be 0)."""
    cpus = cpu_count() if cpus is None else cpus
    return max(0, cpus // max(1, local_world_size))


def choose_num_workers(requested: int | None, dataset: Any, local_world_size: int, cpus: int | None = None,
                       warn: bool = True) -> int:
    """``requested`` capped at :func:`worker_bound`; None = ``min(2, bound)``, or 0 for a TensorDataset
    or an IterableDataset. 0, said once with ``warn``, where each worker would run the script again
    (train/mainguard.py).

    A TensorDataset's items are slices of tensors already in memory: worker processes would only add
    their start-up (an import of torch each) and a copy of every batch through shared memory. An
    IterableDataset is iterated whole by every worker unless its ``__iter__`` splits the stream by
    ``torch.utils.data.get_worker_info()``, which cannot be seen from outside: by default it gets
    none, and workers asked for are given with a warning (:func:`warn_unsplit`).
    """
    workers = _capped(requested, dataset, local_world_size, cpus, warn)
    if workers == 0:
        return 0
    if (unguarded := mainguard.find()) is None:
        if warn and isinstance(dataset, IterableDataset):
            warn_unsplit("train_data", workers, stacklevel=6)  # the user's fit line
        return workers
    if warn:
        warnings.warn(f"ddprun: fit loads the data in the training process (num_workers=0, not {workers}): "
                      f"{unguarded.where()} runs at the top level of the script, outside "
                      f'`if __name__ == "__main__":`, and each DataLoader worker ({start_method()}: fork is unsafe '
                      "once the process group runs) would run the script again. HINT: put the script's top-level "
                      'code under `if __name__ == "__main__":` to get the workers back.', stacklevel=3)
    return 0


def _capped(requested: int | None, dataset: Any, local_world_size: int, cpus: int | None, warn: bool) -> int:
    bound = worker_bound(local_world_size, cpus)
    if requested is None:
        return 0 if isinstance(dataset, (TensorDataset, IterableDataset)) else min(DEFAULT_MAX_WORKERS, bound)
    if requested < 0:
        raise ConfigError("num_workers must be 0 or more.", seen=f"num_workers={requested}",
                          hint="Give 0 (load in the training process) or a small positive number, or leave it out.")
    if requested > bound:
        if warn:
            warnings.warn(f"ddprun: num_workers={requested} per rank is more than this node's CPUs allow "
                          f"({cpus if cpus is not None else cpu_count()} CPUs / {local_world_size} ranks); "
                          f"using {bound}.", stacklevel=4)
        return bound
    return requested


def warn_unsplit(name: str, workers: int, stacklevel: int = 3) -> None:
    """Say that ``name``, an IterableDataset, is read by ``workers`` DataLoader workers per rank, each
    of which iterates it from its start unless it splits the stream itself."""
    warnings.warn(f"ddprun: {name} is an IterableDataset read by {workers} DataLoader worker(s) per rank: each "
                  "worker iterates it from the start, so unless its __iter__ splits the stream by "
                  "torch.utils.data.get_worker_info() (id, num_workers), every sample is taken "
                  f"{workers} times per epoch. HINT: split it by get_worker_info() in __iter__, or give "
                  "num_workers=0.", stacklevel=stacklevel + 1)


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``.

    Never ``fork``: once the process group exists the process holds gloo/NCCL threads (and maybe a
    CUDA context); a forked worker inherits their locks in whatever state they were and can hang or
    crash. forkserver/spawn workers start from a clean interpreter (datasets must be picklable).
    """
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def loader_options(num_workers: int, device_type: str) -> dict[str, Any]:
    """DataLoader keyword arguments for ``num_workers`` on a ``device_type`` ("cuda" or "cpu") rank."""
    opts: dict[str, Any] = {"num_workers": num_workers, "pin_memory": device_type == "cuda"}
    if num_workers > 0:
        opts["persistent_workers"] = True  # no worker start-up (an import of torch) every epoch
        opts["multiprocessing_context"] = start_method()
    return opts


class LoaderWorkerInit:
    """``worker_init_fn`` of fit's DataLoader workers under ``ddprun run``: they ignore the job's
    preemption signals, answer a hang report with where they are (ddprun/loaderworkers.py: a worker
    started by a forkserver does not inherit its rank's answer), then the user's own runs.
    A scheduler signals every process of a node (SLURM every process of a step:
    ``scancel --signal``, the SIGTERM before a preemption or the time limit; a terminal's Ctrl-C its
    process group): a worker would die of it (SIGUSR1's default, torch's SIGTERM handler) and fail its
    rank, which instead stops at the agreed step and ends its workers itself (:func:`close_workers`).
    Picklable (forkserver/spawn) when the user's function is."""

    def __init__(self, signals: tuple[int, ...], user: Callable[[int], Any] | None = None, answer: bool = False):
        self.signals, self.user, self.answer = tuple(signals), user, answer

    def __call__(self, worker_id: int) -> None:
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        if self.answer:
            loaderworkers.answer_requests(worker_id)
            if _forkserver_started():
                # its parent, the rank's forkserver, ends with the rank: so does a worker blocked in its
                # dataset, which torch's check of its parent (between batches) would never end. Not a
                # worker the rank started itself: the tie is to the starting thread, which may end first
                die_with_parent()
        if self.user is not None:
            self.user(worker_id)


def _forkserver_started() -> bool:
    """In a worker: whether a forkserver forked it (its parent is not the rank that started it)."""
    parent = multiprocessing.parent_process()
    return parent is not None and parent.pid != os.getppid()


def safe_worker_init(user: Callable[[int], Any] | None = None) -> Callable[[int], Any] | None:
    """``worker_init_fn`` for a DataLoader of your own, outside fit: its workers ignore ``ddprun run``'s
    preemption signals and answer its hang report (:class:`LoaderWorkerInit`), then ``user`` runs.
    Outside ``ddprun run`` (no preemption signals): ``user`` itself. For start method ``fork``
    (Linux's default up to Python 3.13; else pass ``multiprocessing_context="fork"``): a forkserver
    would die of the signal, and its workers with it. Call it in the worker process of ``ddprun run``,
    whose bootstrap has set the signals."""
    if not PREEMPT.signals and not loaderworkers.SERVING:
        return user
    return LoaderWorkerInit(PREEMPT.signals, user, loaderworkers.SERVING)


def worker_init(num_workers: int, user: Callable[[int], Any] | None) -> Callable[[int], Any] | None:
    """The ``worker_init_fn`` for a loader of fit: :class:`LoaderWorkerInit` under ``ddprun run``
    (the forkserver started as :func:`start_forkserver` says), else the user's."""
    if num_workers == 0:
        return user
    if PREEMPT.signals and start_method() == "forkserver":
        start_forkserver(PREEMPT.signals)
    return safe_worker_init(user)


FORKSERVER_GUARD = "ddprun.train.forkserver_guard"


def start_forkserver(signals: tuple[int, ...]) -> None:
    """Start multiprocessing's forkserver guarded against ``signals`` (train/forkserver_guard.py: it
    outlives them, the processes it forks do not inherit that), and its resource tracker with them
    blocked (it has no children). A signal to every process of the node would otherwise kill the
    forkserver, and with it every DataLoader worker it started: torch's worker watchdog takes its
    parent's end for its rank's. This thread blocks them meanwhile: a signal for the process goes to
    another thread, none is lost. Main thread; a forkserver already running is left as it is."""
    import threading
    from multiprocessing import forkserver, resource_tracker

    if threading.current_thread() is not threading.main_thread():
        return
    preload = list(getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or ["__main__"])
    if FORKSERVER_GUARD not in preload:
        forkserver.set_forkserver_preload([*preload, FORKSERVER_GUARD])
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        resource_tracker.ensure_running()  # unblocks SIGINT and SIGTERM on its way (it ignores them itself)
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def close_workers(loader: Any, graceful: bool = True, join_s: float = 5.0) -> None:
    """End a DataLoader's persistent worker processes now, by torch's own shutdown (a None to each, a
    bounded join); one still running after ``join_s`` is killed: it ignores SIGTERM, which
    multiprocessing's exit would send it before waiting for it without a bound. ``graceful=False``
    (fit failed: its rank's record must not wait) kills them first. No-op without workers."""
    it = getattr(loader, "_iterator", None)
    if it is None:
        return
    workers = list(getattr(it, "_workers", []))
    if not graceful:
        for w in workers:
            if w.is_alive():
                w.kill()
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    for w in workers:
        if w.is_alive():
            w.kill()
            w.join(join_s)
    loader._iterator = None


@dataclass
class Loader:
    """A DataLoader and the sampler whose ``set_epoch`` must be called every epoch (or None)."""

    loader: DataLoader
    sampler: ResumableSampler | None
    batch_size: int


def _check_data(data: Any, name: str) -> None:
    if not isinstance(data, (Dataset, DataLoader)):
        raise ConfigError(f"{name} is neither a torch Dataset nor a DataLoader.", seen=f"{name}: {type(data).__name__}",
                          hint="Wrap tensors in torch.utils.data.TensorDataset(x, y), or pass a DataLoader.")


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def default_order(loader: DataLoader) -> bool:
    """Whether ``loader`` orders its data by torch's default sampler (``shuffle=True`` or False, each
    sample once an epoch), in batches of ``batch_size`` or with automatic batching off
    (``batch_size=None``: each item a batch), not by a batch sampler of its own: fit's sampler means
    the same, and resumes."""
    sampler = loader.sampler
    if type(sampler) is RandomSampler:
        plain = not sampler.replacement and sampler._num_samples is None
    else:
        plain = type(sampler) is SequentialSampler
    return plain and (loader.batch_size is not None or loader.batch_sampler is None)


def _unbatched(loader: DataLoader | None) -> bool:
    """Whether ``loader`` has automatic batching off (``batch_size=None``, no batch sampler): its
    dataset's items are whole batches, collated by ``default_convert``."""
    return loader is not None and loader.batch_sampler is None


def build_train_loader(data: Dataset | DataLoader, *, batch_size: int, info: RankInfo, seed: int,
                       num_workers: int | None) -> Loader:
    """The training DataLoader of this rank (module docstring).

    A Dataset gets a new loader. A DataLoader with torch's default sampler (shuffle or not) is
    rebuilt around fit's sampler, in one process too, so that an epoch resumes part-way exactly
    (keeping its batch size, collate_fn, workers and worker_init_fn; with automatic batching off,
    ``batch_size=None``, each item is a batch, and counts as one sample). One with a sampler of its own
    is kept in one process (the loop calls its ``set_epoch``: :func:`set_epoch`) and replaced, with a
    warning, when world_size > 1. An IterableDataset is used as
    it is: it must shard itself by :func:`ddprun.rank_info` and give every rank as many batches. It
    gets no DataLoader workers unless asked (each would iterate the whole stream); asked for, they
    come with a warning that each must take its own part (:func:`warn_unsplit`).
    """
    _check_data(data, "train_data")
    warn = info.is_main
    user_loader = data if isinstance(data, DataLoader) else None
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if user_loader is not None and user_loader.batch_size is not None:
        batch_size = user_loader.batch_size
    unbatched = _unbatched(user_loader)
    if unbatched:
        batch_size = 1  # one item a batch: the resume position counts items
    if _length(dataset) == 0:
        raise ConfigError("train_data is empty.", seen=f"len(train_data) = 0 ({type(dataset).__name__})",
                          hint="Check the data path and any filtering that built the dataset.")

    if isinstance(dataset, IterableDataset):
        if user_loader is not None:
            if warn and user_loader.num_workers > 0:
                warn_unsplit("train_data's dataset", user_loader.num_workers, stacklevel=5)
            return Loader(user_loader, None, batch_size)
        workers = choose_num_workers(num_workers, dataset, info.local_world_size, warn=warn)
        return Loader(DataLoader(dataset, batch_size=batch_size, worker_init_fn=worker_init(workers, None),
                                 **loader_options(workers, info.device.type)), None, batch_size)

    shuffle = True
    kwargs: dict[str, Any] = {}
    if user_loader is not None:
        if info.world_size == 1 and not default_order(user_loader):
            return Loader(user_loader, None, batch_size)
        shuffle, kwargs = _user_settings(user_loader, seed, warn)
        if info.world_size == 1:
            sampler = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=False)
            generator = user_loader.generator or torch.Generator().manual_seed(seed)  # not the global RNG: resumes bitwise
            return Loader(_with_sampler(user_loader, sampler, None if unbatched else batch_size, generator), sampler,
                          batch_size)
        if num_workers is None:
            num_workers = user_loader.num_workers
    sampler = ResumableSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=shuffle, seed=seed,
                               drop_last=False)
    workers = choose_num_workers(num_workers, dataset, info.local_world_size, warn=warn)
    # The loader's generator only seeds worker processes (the sampler has its own seed): seed + rank,
    # so that random augmentation differs between ranks but is reproducible.
    generator = torch.Generator().manual_seed(seed + info.rank)
    kwargs["worker_init_fn"] = worker_init(workers, kwargs.get("worker_init_fn"))
    loader = DataLoader(dataset, batch_size=None if unbatched else batch_size, sampler=sampler, generator=generator,
                        **loader_options(workers, info.device.type), **kwargs)
    return Loader(loader, sampler, batch_size)


def _with_sampler(user: DataLoader, sampler: ResumableSampler, batch_size: int | None,
                  generator: torch.Generator) -> DataLoader:
    """``user``'s loader with fit's resumable ``sampler`` in place of torch's default one, every other
    setting kept (its workers and their start method, so a dataset or collate_fn that does not pickle
    still loads under fork; pin_memory, prefetch), as the loader it replaces in one process.
    ``generator`` seeds its workers (a loader without one draws that seed from the global RNG at each
    epoch, which a resume mid-epoch would draw at another point)."""
    workers = user.num_workers
    opts: dict[str, Any] = {
        "num_workers": workers, "collate_fn": user.collate_fn, "pin_memory": user.pin_memory,
        "drop_last": user.drop_last, "timeout": user.timeout, "generator": generator,
        "worker_init_fn": worker_init(workers, user.worker_init_fn),
        "multiprocessing_context": user.multiprocessing_context, "persistent_workers": user.persistent_workers,
        "pin_memory_device": user.pin_memory_device}
    if workers > 0:
        opts["prefetch_factor"] = user.prefetch_factor
    return DataLoader(user.dataset, batch_size=batch_size, sampler=sampler, **opts)


def _user_settings(user_loader: DataLoader, seed: int, warn: bool) -> tuple[bool, dict[str, Any]]:
    """(shuffle, DataLoader keyword arguments) of fit's loader in place of ``user_loader``; a sampler
    of its own replaced is said (``warn``)."""
    if not default_order(user_loader) and warn:
        own = type(user_loader.batch_sampler or user_loader.sampler).__name__
        warnings.warn(f"ddprun: train_data's own sampler ({own}) is replaced by a DistributedSampler "
                      f"(shuffle, seed={seed}) so that every rank sees its own part of the data.", stacklevel=4)
    shuffle = type(user_loader.sampler) is not SequentialSampler
    return shuffle, {"collate_fn": user_loader.collate_fn, "worker_init_fn": user_loader.worker_init_fn,
                     "drop_last": user_loader.drop_last, "timeout": user_loader.timeout}


def set_epoch(loader: Any, sampler: ResumableSampler | None, epoch: int) -> None:
    """Tell this epoch to fit's ``sampler``; without one (a DataLoader kept as given, an
    IterableDataset), to the loader's sampler, batch sampler and dataset, each that has ``set_epoch``
    (a DistributedSampler of the user's, a streaming dataset that reshuffles by epoch)."""
    if sampler is not None:
        sampler.set_epoch(epoch)
        return
    for part in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                 getattr(loader, "dataset", None)):
        method = getattr(part, "set_epoch", None)
        if callable(method):
            method(epoch)


def build_val_loader(data: Dataset | DataLoader, *, batch_size: int, info: RankInfo,
                     num_workers: int | None) -> DataLoader:
    """The validation DataLoader of this rank: every sample once over all ranks, in order."""
    _check_data(data, "val_data")
    user_loader = data if isinstance(data, DataLoader) else None
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if user_loader is not None and (info.world_size == 1 or isinstance(dataset, IterableDataset)):
        if info.is_main and isinstance(dataset, IterableDataset) and user_loader.num_workers > 0:
            warn_unsplit("val_data's dataset", user_loader.num_workers, stacklevel=5)
        return user_loader
    kwargs: dict[str, Any]
    batch: int | None = batch_size
    if user_loader is not None:
        batch = None if _unbatched(user_loader) else (user_loader.batch_size or batch_size)
        kwargs = {"collate_fn": user_loader.collate_fn, "worker_init_fn": user_loader.worker_init_fn}
        if num_workers is None:
            num_workers = user_loader.num_workers
    else:
        kwargs = {}
    workers = choose_num_workers(num_workers, dataset, info.local_world_size, warn=False)
    if info.is_main and isinstance(dataset, IterableDataset) and workers > 0:
        warn_unsplit("val_data", workers, stacklevel=5)
    kwargs["worker_init_fn"] = worker_init(workers, kwargs.get("worker_init_fn"))
    sampler = None
    if not isinstance(dataset, IterableDataset):
        sampler = ShardSampler(len(cast(Sized, dataset)), info.rank, info.world_size)  # map-style: sized
    return DataLoader(dataset, batch_size=batch, sampler=sampler, **loader_options(workers, info.device.type),
                      **kwargs)
