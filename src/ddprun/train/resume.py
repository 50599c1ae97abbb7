"""fit's checkpoints across ranks: which ranks write, what a (re)started run resumes from, and how.

At fit start, :meth:`Checkpoints.open` (every rank, two collectives, once):
  1. rank 0 creates the checkpoint directory and a marker file in it, named by a nonce it
     broadcasts; the local rank 0 of every node looks for the marker. Nodes that do not see it do
     not share rank 0's directory: rank 0 says so once, and each such node's local rank 0 writes
     its own copy of every checkpoint from then on (rank 0 writes in all cases). A directory shared
     by only some nodes is treated per node: a node that sees rank 0's marker leaves the writing
     to rank 0.
  2. unless ``resume=False``, rank 0 and the local rank 0 of every node that does not share rank
     0's directory find their newest usable checkpoint (``checkpoint.newest_valid``: verified by
     size and SHA-256, damaged ones skipped with a warning); one ``all_gather_object`` tells every
     rank every node's step. The newest step wins. If every node has it, each rank reads its
     node's file; else the lowest rank that has it reads it and broadcasts it to all.

Saving (:meth:`Checkpoints.save`, every ``checkpoint_every`` steps and at the end, every rank):
one ``all_gather_object`` of every rank's RNG states, then the writers write (atomic, see
:mod:`ddprun.train.checkpoint`) and keep the newest ``keep``. The other ranks wait with the long
timeout (:func:`ddprun.runtime.use_phase_timeout`: init's, or under ``ddprun run`` as long as the
stall watch lets the write run, 4 x --stall-timeout, where longer), so a slow write does not trip
the short training timeout.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddprun import runtime
from ddprun.errors import CheckpointError, ConfigError
from ddprun.runtime import RankInfo
from ddprun.train import checkpoint as ckpt
from ddprun.train import dirlock

MARKER = ".ddprun-shared-"


@dataclass
class Resumed:
    """What a run resumes from: the checkpoint's path (on the node that had it) and its state."""

    path: str
    state: dict[str, Any]


def _distributed(info: RankInfo) -> bool:
    return info.distributed and info.world_size > 1


def check_resume(resume: Any) -> None:
    """``resume`` must be "auto", True, False, or a path (str / os.PathLike)."""
    if resume in ("auto", True, False) or isinstance(resume, (str, os.PathLike)):
        return
    raise ConfigError("resume must be 'auto', True, False, or a checkpoint file or directory.",
                      seen=f"resume={resume!r}",
                      hint="Leave it at 'auto' (resume from checkpoint_dir when it has a checkpoint), False to start "
                           "anew, or give a path.")


_FINISHED_IN_THIS_PROCESS: set[str] = set()
"""Checkpoint directories in which a fit() of this process ran to its end (see Checkpoints.open)."""


def mark_finished(directory: str) -> None:
    _FINISHED_IN_THIS_PROCESS.add(os.path.abspath(directory))


def finished_here(directory: str, resume: Any, info: RankInfo, stacklevel: int) -> bool:
    """Whether ``resume="auto"`` must start anew in ``directory``: another fit() of this process
    finished there (pretrain, then fine-tune; a benchmark's blocks), which is a new run, not an
    interrupted one. Every rank finished the same fits, so every rank decides the same; rank 0 warns,
    at the user's fit() line (``stacklevel`` as the caller would give it to warnings.warn)."""
    if resume != "auto" or os.path.abspath(directory) not in _FINISHED_IN_THIS_PROCESS:
        return False
    if info.is_main:
        warnings.warn(f"ddprun: fit() already ran in this process with checkpoints in {directory}; this "
                      "fit() starts anew (resume=True or a path continues from them).", stacklevel=stacklevel + 1)
    return True


class Checkpoints:
    """Where fit's checkpoints go and whether this rank writes them (module docstring)."""

    def __init__(self, directory: str, info: RankInfo, keep: int, shared: bool = True, writer: bool | None = None):
        self.directory = directory
        self.info = info
        self.keep = keep
        self.shared = shared
        self.writer = info.is_main if writer is None else writer
        self.last_saved: tuple[int, int] | None = None
        """(step, epoch) of the last save (or of the checkpoint resumed from)."""
        self.checked = False
        """Whether a save of this fit was checked to load back (checkpoint.save ``check_loadable``)."""

    # -- open / resume ---------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str, info: RankInfo, *, keep: int, resume: Any,
             run: str | None = None) -> tuple[Checkpoints, Resumed | None]:
        """The checkpoint set of this run and, unless ``resume=False``, what to resume from (every rank).
        ``run``: the run's directory, its identity for the writer's lock (None: ``directory``'s parent)."""
        run = run or os.path.dirname(os.path.abspath(directory))
        check_resume(resume)
        source = directory if resume in ("auto", True, False) else os.path.abspath(os.fspath(resume))
        # stacklevel: the user's ddprun.fit line (open <- _setup <- fit_module <- ddprun.api.fit)
        wanted = resume is not False and not finished_here(directory, resume, info, stacklevel=5)
        if not _distributed(info):
            self = cls(directory, info, keep)
            cls._prepare(directory, lock=run)
            found = cls._find(source) if wanted else None
            resumed = Resumed(*found) if found else None
        else:
            self, resumed = cls._open_distributed(directory, source, info, keep, wanted, run)
        if resumed is None and (resume is True or resume not in ("auto", True, False)):
            raise ConfigError("There is no checkpoint to resume from.", seen=f"resume={resume!r}: no usable checkpoint "
                              f"in {source}", hint="Give a directory fit() saved into (run dir/checkpoints) or a .pt "
                                                   "file, or resume='auto' to start anew when there is none.")
        return self, resumed

    @staticmethod
    def _prepare(directory: str, lock: str | None = None) -> None:
        """Create the directory and remove what a killed writer left; ``lock``: the main writer's run
        directory, whose lock it takes first (train/dirlock.py: CheckpointError when another job
        writes there)."""
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise CheckpointError("The checkpoint directory cannot be created.", seen=f"{directory}: {e.strerror}",
                                  hint="Give fit() a checkpoint_dir (or run_dir) this process may write to.") from e
        if lock:
            dirlock.acquire(directory, lock)
        ckpt.remove_temp_files(directory)
        for name in os.listdir(directory):  # a marker of a fit killed during its own check
            if name.startswith(MARKER):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass

    @staticmethod
    def _find(source: str) -> tuple[str, dict] | None:
        if os.path.isfile(source):
            return source, ckpt.load(source)
        return ckpt.newest_valid(source) if os.path.isdir(source) else None

    @classmethod
    def _open_distributed(cls, directory: str, source: str, info: RankInfo, keep: int,
                          wanted: bool, run: str) -> tuple[Checkpoints, Resumed | None]:
        """Steps 1 and 2 of the module docstring, on every rank: a broadcast and an all_gather_object
        (and one more broadcast when only some nodes have the newest checkpoint)."""
        marker = cls._shared_marker(directory, info, run)
        head = info.local_rank == 0
        saw = info.is_main or (head and _exists_soon(marker))
        # 2. who has what: rank 0 and the heads of nodes that do not share its directory look
        looks = wanted and (info.is_main or (head and (not saw or source != directory)))
        if head and not saw:
            cls._prepare(directory)
        found, table = _gather_found(source, info, head=head, saw=saw, looks=looks)
        if info.is_main:
            try:
                os.unlink(marker)
            except OSError:
                pass
        heads = [e for e in table if e["head"]]
        apart = sorted(e["node"] for e in heads if not e["saw"])
        if apart and info.is_main:
            print(f"ddprun: the checkpoint directory {directory} is not shared with node(s) "
                  f"{', '.join(map(str, apart))} (they do not see rank 0's files): each of those nodes' local rank 0 "
                  f"writes its own copy, and a restart resumes from the newest copy any node has.", flush=True)
        writer = info.is_main or (head and not saw)
        self = cls(directory, info, keep, shared=not apart, writer=writer)
        if not wanted:
            return self, None
        return self, _newest(table, heads, found, info)

    @classmethod
    def _shared_marker(cls, directory: str, info: RankInfo, run: str) -> str:
        """1. rank 0's marker file, named by a nonce every rank learns after it exists (a broadcast);
        its path. CheckpointError on every rank when rank 0 cannot write it."""
        import torch.distributed as dist

        said: list[Any] = [None, None]
        if info.is_main:
            try:
                cls._prepare(directory, lock=run)
                said[0] = uuid.uuid4().hex
                with open(os.path.join(directory, MARKER + said[0]), "w") as f:
                    f.write("rank 0 of a fit() checks which nodes see this directory; removed after the check\n")
            except CheckpointError as e:
                said[1] = (e.what, e.seen, e.hint)
            except OSError as e:
                said[1] = ("Rank 0 cannot write to the checkpoint directory.", str(e),
                           "Give fit() a checkpoint_dir (or run_dir) rank 0 may write to.")
        dist.broadcast_object_list(said, src=0)
        if said[1] is not None:  # every rank raises, not only rank 0
            what, seen, hint = said[1]
            raise CheckpointError(what, seen=seen, hint=hint)
        return os.path.join(directory, MARKER + said[0])

    # -- save -----------------------------------------------------------------------------------
    def save(self, step: int, epoch: int, make_state: Callable[[list[dict]], dict[str, Any]], *,
             final: bool = False, written: Callable[[str], None] | None = None) -> str | None:
        """Gather every rank's RNG states, let the writers save ``make_state(rngs)``; every rank calls
        this at the same step. Returns the path on writers, None elsewhere. Raises CheckpointError
        on a writer whose file system refuses (the previous checkpoint stays intact). ``written(path)``
        runs on the main rank once the file exists, before the final barrier, which a peer stopped
        meanwhile fails."""
        runtime.use_phase_timeout()  # the others now wait for the writers: the long timeout
        rng = ckpt.rng_state()
        if _distributed(self.info):
            import torch.distributed as dist

            rngs: list[dict] = [None] * self.info.world_size  # type: ignore[list-item]
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        path = None
        if self.writer:
            path = ckpt.save(self.directory, make_state(rngs), keep=self.keep, check_loadable=not self.checked)
            self.checked = True
            if written is not None and self.info.is_main:
                written(path)
        self.last_saved = (step, epoch)
        if final:
            runtime.barrier()  # no rank returns (and maybe exits) before the checkpoint exists
        else:
            runtime.use_training_timeout()  # a barrier, then the short timeout again
        return path if self.info.is_main else None


def _gather_found(source: str, info: RankInfo, *, head: bool, saw: bool,
                  looks: bool) -> tuple[tuple[str, dict] | None, list[dict]]:
    """(this rank's find, if it looked; every rank's entry) after one all_gather_object. A rank that
    failed to read raises on every rank, after the gather (no rank is left waiting in it)."""
    import torch.distributed as dist

    found: tuple[str, dict] | None = None
    error = None
    if looks:
        try:
            found = Checkpoints._find(source)
        except Exception as e:  # noqa: BLE001 - raised on every rank after the gather, not on this one alone
            error = e
    step = int(found[1].get("step", -1)) if found else -1
    mine = {"rank": info.rank, "node": info.node_rank, "head": head, "saw": saw, "looked": looks,
            "step": step, "path": found[0] if found else None, "error": str(error) if error else None}
    table: list[dict] = [None] * info.world_size  # type: ignore[list-item]
    dist.all_gather_object(table, mine)
    if error is not None:
        raise error
    failed = [e for e in table if e["error"]]
    if failed:
        raise CheckpointError(f"Rank {failed[0]['rank']} could not read the checkpoint to resume from.",
                              seen=failed[0]["error"], hint="See that rank's log; or resume=False to start anew.")
    return found, table


def _newest(table: list[dict], heads: list[dict], found: tuple[str, dict] | None, info: RankInfo) -> Resumed | None:
    """The newest checkpoint any node has, for this rank: its node's own file when every node has it,
    else the lowest rank that has it broadcasts it to all (every rank calls this alike)."""
    import torch.distributed as dist

    # every node's answer: its head's, or rank 0's where the head shares rank 0's directory
    rank0 = table[0]
    per_node = {e["node"]: (e if e["looked"] else rank0) for e in heads}
    best = max(e["step"] for e in per_node.values())
    if best < 0:
        return None
    mine_node = per_node.get(info.node_rank, rank0)
    if all(e["step"] == best for e in per_node.values()):
        if found is not None and found[1].get("step") == best:
            return Resumed(*found)
        path = mine_node["path"]
        return Resumed(path, ckpt.read(path))
    src = min(e["rank"] for e in table if e["looked"] and e["step"] == best)
    box = [Resumed(*found) if info.rank == src and found is not None else None]  # src found it: its step is best
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _exists_soon(path: str, wait_s: float = 1.0) -> bool:
    """Whether ``path`` exists, looking again for ``wait_s`` (a network file system may be late)."""
    deadline = time.monotonic() + wait_s
    while True:
        if os.path.exists(path):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def restore_rank_rng(state: dict[str, Any], rank: int) -> bool:
    """Restore this rank's RNG states from a checkpoint (format 2: one entry per rank; format 1:
    rank 0's only). False when the checkpoint has none for this rank."""
    rngs = state.get("rng")
    if isinstance(rngs, dict):
        rngs = [rngs]
    if not isinstance(rngs, list) or rank >= len(rngs) or not rngs[rank]:
        return False
    ckpt.restore_rng(rngs[rank])
    return True


def warn_no_periodic(info: RankInfo, every: int | None, environ: Any = None) -> None:
    """Rank 0: one line when torch's agent may restart the workers but fit saves only at the end."""
    environ = os.environ if environ is None else environ
    if every is None and info.is_main and environ.get("TORCHELASTIC_MAX_RESTARTS", "0") not in ("", "0"):
        print(f"ddprun: torch's agent may restart the workers (TORCHELASTIC_MAX_RESTARTS="
              f"{environ['TORCHELASTIC_MAX_RESTARTS']}: --max-restarts or PET_MAX_RESTARTS) but fit() saves no "
              "periodic checkpoints: a restart starts from step 0. "
              "HINT: fit(..., checkpoint_every=N).", file=sys.stderr, flush=True)


@dataclass
class Position:
    """Where a resumed run continues: optimizer step, epoch, and how far into that epoch."""

    step: int
    epoch: int
    batches: int
    """Micro-batches of ``epoch`` that count as taken (this run's batch size)."""
    samples: int
    """Positions of ``epoch``'s global order taken (``batches * batch_size * world_size``)."""
    history: list


def restore(resumed: Resumed, info: RankInfo, *, model: Any, optimizer: Any, scheduler: Any, scaler: Any,
            sampler: Any, batch_size: int, seed: int) -> Position:
    """Load a checkpoint's state into the run's objects; set the sampler to continue its epoch.

    Refuses (ConfigError) a checkpoint of another model or optimizer. A checkpoint written with
    another world size, batch size or seed is used with a warning (rank 0): the rest of its epoch
    is then split anew (:class:`~ddprun.train.data.ResumableSampler`) and the result is not the
    uninterrupted run's. Without a ResumableSampler (a DataLoader kept as it is in one process, an
    IterableDataset) the taken batches are loaded again and dropped (each one a heartbeat). RNG states are restored
    separately, just before the first step (:func:`restore_rank_rng`).
    """
    state, where = resumed.state, resumed.path
    ckpt.match_model(state.get("model", {}), model.state_dict(), where)
    model.load_state_dict(state["model"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise ConfigError("The checkpoint's optimizer state does not fit this optimizer.",
                          seen=f"{where}: {(str(e).splitlines() or [''])[0]}",
                          hint="Resume with the optimizer (and parameter groups) that wrote it, or start anew: "
                               "fit(..., resume=False) or another checkpoint_dir.") from e
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("grad_scaler"):
        scaler.load_state_dict(state["grad_scaler"])
    s = state.get("sampler") or {}
    epoch = int(s.get("epoch", state.get("epoch", 0)))
    world_then = int(s.get("num_replicas", info.world_size))
    batch_then = int(s.get("batch_size", batch_size))
    per_batch = batch_size * info.world_size
    samples = int(s.get("samples_done", int(s.get("batches_done", 0)) * batch_then * world_then))
    if sampler is not None:
        sampler.resume_at(epoch, samples)
        batches = samples // per_batch
    else:
        batches = int(s.get("batches_done", 0))
        samples = batches * per_batch
    changed = [f"{name} {then} -> {now}" for name, then, now in (
        ("world size", world_then, info.world_size), ("batch size", batch_then, batch_size),
        ("seed", s.get("seed", seed), seed)) if then != now]
    if info.is_main:
        print(f"ddprun: resuming from {where}: step {state['step']}, epoch {epoch}, {batches} batch(es) into it",
              flush=True)
        if changed:
            print(f"ddprun: the checkpoint was written with another {', '.join(changed)}: the rest of epoch {epoch} "
                  f"is split anew over this run's ranks (no sample of it skipped, a few may repeat); training goes "
                  f"on with this run's settings and learning rate, and is not the uninterrupted run's.", flush=True)
    return Position(step=int(state["step"]), epoch=epoch, batches=batches, samples=samples,
                    history=list(state.get("history") or []))
