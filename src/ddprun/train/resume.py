"""fit's checkpoints across ranks: which ranks write, what a (re)started run resumes from, and how.

Each fit() of a process into one checkpoint directory has its own checkpoints there (its slot: the
directory itself for the first, ``fit-<n>/`` for the n-th after it; :func:`slot`), so a fine-tune
after a pretrain neither overwrites, prunes nor falls back to the pretrain's, and a restarted script
resumes each fit from its own. A fit that starts a new run where its slot has checkpoints
(resume=False, or "auto" with none usable) moves them, and the later fits' slots, into
``previous-<k>/`` (never deleted); one that continues a run (a path, True) leaves them to pruning.

At fit start, :meth:`Checkpoints.open` (every rank, two collectives, once; a third, below):
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
  3. unless "auto" found a checkpoint, the writers move an earlier run's files aside
     (:func:`set_aside`); one ``all_gather_object`` makes a writer's failure every rank's.

Saving (:meth:`Checkpoints.save`, every ``checkpoint_every`` steps and at the end, every rank):
one ``all_gather_object`` of every rank's RNG states, then the writers write (atomic, see
:mod:`ddprun.train.checkpoint`) and keep the newest ``keep``. The other ranks wait with the long
timeout (:func:`ddprun.runtime.use_phase_timeout`: init's, or under ``ddprun run`` as long as the
stall watch lets the write run, 4 x --stall-timeout, where longer), so a slow write does not trip
the short training timeout.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddprun import runtime
from ddprun.errors import CheckpointError, ConfigError
from ddprun.protocol.atomic import fsync_dir
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


_FINISHED_IN_THIS_PROCESS: set[tuple[str, int]] = set()
"""(checkpoint directory, ordinal) of each fit() of this process that ran to its end there."""
_LATER = re.compile(r"^fit-(\d+)$")
ASIDE = "previous-"


def ordinal(directory: str) -> int:
    """Which fit() of this process into ``directory`` this one is: how many ran to their end there
    before it (0: the first; a pretrain, then a fine-tune: 1). A restarted script's fits get the same
    numbers (a fit resumed at its end runs to its end), so it names the same fit in every attempt;
    a fit that raised keeps its number, so calling it again in the process continues it."""
    path = os.path.abspath(directory)
    return sum(1 for d, _ in _FINISHED_IN_THIS_PROCESS if d == path)


def slot(directory: str, n: int) -> str:
    """Where fit ``n`` of a process keeps its checkpoints: ``directory`` itself for the first (where
    an older ddprun left them, which it resumes), ``directory/fit-<n>`` for a later one; so one fit
    never overwrites, prunes or resumes another's."""
    return directory if n == 0 else os.path.join(directory, f"fit-{n}")


def mark_finished(directory: str, n: int) -> None:
    _FINISHED_IN_THIS_PROCESS.add((os.path.abspath(directory), n))


def warn_anew(directory: str, own: str, info: RankInfo, stacklevel: int) -> None:
    """Rank 0: fit ``n`` > 0 of this process found no checkpoint of its own and starts anew (after a
    pretrain, a fine-tune; a benchmark's blocks), at the user's fit() line (``stacklevel`` as the
    caller would give it to warnings.warn). Every rank finished the same fits: every rank decides alike."""
    if info.is_main:
        warnings.warn(f"ddprun: fit() already ran in this process with checkpoints in {directory}; this fit() "
                      f"starts anew, with its checkpoints in {own} (resume=True or a path continues from the "
                      "earlier fit's).", stacklevel=stacklevel + 1)


def _sources(directory: str, n: int, resume: Any) -> list[str]:
    """Where fit ``n`` looks for a checkpoint, in order: its own slot ("auto"); then, resume=True, the
    slot of the fit before it; nowhere (False); the path given."""
    if resume is False:
        return []
    if resume == "auto" or resume is True:
        return [slot(directory, n)] + ([slot(directory, n - 1)] if resume is True and n else [])
    return [os.path.abspath(os.fspath(resume))]


def _names(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []


def set_aside(directory: str, n: int, ours: Callable[[str], bool], keep: str | None = None) -> str | None:
    """Move what fit ``n`` finds in its slot (the names ``ours`` accepts) and the slots of the fits
    after it into a new ``directory/previous-<k>/``, in the same layout; its path, None when there
    was nothing to move or ``keep`` (the checkpoint resumed from) lies among it. For a fit that does
    not continue from them (resume=False, "auto" with none usable): they are an earlier run's, and so
    are the later fits', whose restart must not resume them; never deleted, pruned or resumed by this
    run. CheckpointError when the file system refuses."""
    own = slot(directory, n)
    moves = [os.path.join(own, name) for name in _names(own) if ours(name)]
    moves += [os.path.join(directory, name) for name in _names(directory) if (m := _LATER.match(name))
              and int(m.group(1)) > n and os.path.isdir(os.path.join(directory, name))]
    if not moves or (keep is not None and _lies_in(keep, own, moves)):
        return None
    src, dest = directory, None
    try:
        dest = _new_aside(directory)
        for src in moves:
            target = os.path.join(dest, os.path.relpath(src, directory))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                os.rename(src, target)
            except FileNotFoundError:  # another writer moved it first (a directory not known to be shared)
                pass
        for d in {own, directory}:
            fsync_dir(d)  # not back in place after a power loss, mixed with this run's
    except OSError as e:
        if dest is not None:
            with contextlib.suppress(OSError):
                os.rmdir(dest)  # only if nothing was moved into it
        raise CheckpointError("The checkpoints of an earlier run could not be moved out of this fit's way.",
                              seen=f"{src}: {e.strerror or e}",
                              hint=f"Move them out of {own} yourself (this fit starts anew and would overwrite "
                                   "them), or give fit() another checkpoint_dir (or run_dir).") from e
    return dest


def set_aside_on_writers(info: RankInfo, writer: bool, directory: str, n: int, ours: Callable[[str], bool],
                         keep: str | None) -> None:
    """Every rank: the writers :func:`set_aside` fit ``n``'s slot (unless ``keep`` lies there), each
    saying so; CheckpointError on every rank (one all_gather_object) when a writer could not."""
    error = None
    if writer:
        try:
            moved = set_aside(directory, n, ours, keep)
        except CheckpointError as e:
            error = (e.what, e.seen, e.hint)
        else:
            if moved:
                print(f"ddprun: this fit() starts anew; the checkpoints of an earlier run in {slot(directory, n)} "
                      f"were moved to {moved} (not deleted).", flush=True)
    if _distributed(info):
        import torch.distributed as dist

        errors: list[Any] = [None] * info.world_size
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        what, seen, hint = error
        raise CheckpointError(what, seen=seen, hint=hint)


def _lies_in(keep: str, own: str, moves: list[str]) -> bool:
    """Whether checkpoint ``keep`` lies in the slot ``own`` (by its directory: the file may be another
    node's copy) or in a later fit's slot about to be moved."""
    real = os.path.realpath(keep)
    return os.path.dirname(real) == os.path.realpath(own) or any(
        real.startswith(os.path.realpath(m) + os.sep) for m in moves)


def _new_aside(directory: str) -> str:
    """A new, empty ``directory/previous-<k>`` (k: one more than any there)."""
    taken = [int(name[len(ASIDE):]) for name in _names(directory) if name[len(ASIDE):].isdigit()
             and name.startswith(ASIDE)]
    k = max(taken, default=0) + 1
    while True:
        try:
            os.mkdir(os.path.join(directory, f"{ASIDE}{k}"))
            return os.path.join(directory, f"{ASIDE}{k}")
        except FileExistsError:
            k += 1


class Checkpoints:
    """Where fit's checkpoints go and whether this rank writes them (module docstring)."""

    def __init__(self, directory: str, info: RankInfo, keep: int, shared: bool = True, writer: bool | None = None):
        self.directory = directory
        self.info = info
        self.keep = keep
        self.shared = shared
        self.writer = info.is_main if writer is None else writer
        self.base = directory
        """The checkpoint directory given to fit; ``directory`` is this fit's slot in it (:func:`slot`)."""
        self.ordinal = 0
        """Which fit() of this process into ``base`` this is (:func:`ordinal`)."""
        self.last_saved: tuple[int, int] | None = None
        """(step, epoch) of the last save (or of the checkpoint resumed from)."""
        self.checked = False
        """Whether a save of this fit was checked to load back (checkpoint.save ``check_loadable``)."""

    # -- open / resume ---------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str, info: RankInfo, *, keep: int, resume: Any,
             run: str | None = None) -> tuple[Checkpoints, Resumed | None]:
        """The checkpoint set of this fit, in its slot of ``directory`` (:func:`slot`), and what to
        resume from (every rank); a fit that does not continue from its slot's checkpoints moves
        them aside (:func:`set_aside`). ``run``: the run's directory, its identity for the writer's
        lock on ``directory`` (None: ``directory``'s parent)."""
        run = run or os.path.dirname(os.path.abspath(directory))
        check_resume(resume)
        n = ordinal(directory)
        own, sources = slot(directory, n), _sources(directory, n, resume)
        if not _distributed(info):
            self = cls(own, info, keep)
            cls._prepare(own, lock=(directory, run))
            found = cls._find(sources)
            resumed = Resumed(*found) if found else None
        else:
            self, resumed = cls._open_distributed(own, sources, info, keep, (directory, run))
        self.base, self.ordinal = directory, n
        if resumed is None and (resume is True or resume not in ("auto", True, False)):
            raise ConfigError("There is no checkpoint to resume from.", seen=f"resume={resume!r}: no usable checkpoint "
                              f"in {' or '.join(sources)}", hint="Give a directory fit() saved into (run dir/checkpoints) "
                              "or a .pt file, or resume='auto' to start anew when there is none.")
        if resumed is None and n and resume == "auto":
            # stacklevel: the user's ddprun.fit line (open <- _setup <- fit_module <- ddprun.api.fit)
            warn_anew(directory, own, info, stacklevel=5)
        if resume is False or (resume == "auto" and resumed is None):  # a new run where an earlier one's are
            self._set_aside(resumed)  # (not a path's or True's: a run that continues, whose restarts resume)
        return self, resumed

    @staticmethod
    def _prepare(directory: str, lock: tuple[str, str] | None = None) -> None:
        """Create the directory and remove what a killed writer left; ``lock``: the main writer's
        checkpoint directory and run directory: it takes that directory's lock first
        (train/dirlock.py: CheckpointError when another job writes there)."""
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise CheckpointError("The checkpoint directory cannot be created.", seen=f"{directory}: {e.strerror}",
                                  hint="Give fit() a checkpoint_dir (or run_dir) this process may write to.") from e
        if lock:
            dirlock.acquire(*lock)
        ckpt.remove_temp_files(directory)
        for name in os.listdir(directory):  # a marker of a fit killed during its own check
            if name.startswith(MARKER):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass

    @staticmethod
    def _find(sources: list[str]) -> tuple[str, dict] | None:
        """The newest usable checkpoint of the first of ``sources`` (files or directories) that has one."""
        for source in sources:
            if os.path.isfile(source):
                return source, ckpt.load(source)
            found = ckpt.newest_valid(source) if os.path.isdir(source) else None
            if found is not None:
                return found
        return None

    def _set_aside(self, resumed: Resumed | None) -> None:
        """:func:`set_aside_on_writers` for this fit's files (unless it resumed from them)."""
        set_aside_on_writers(self.info, self.writer, self.base, self.ordinal, ckpt.is_checkpoint_file,
                             resumed.path if resumed else None)

    @classmethod
    def _open_distributed(cls, directory: str, sources: list[str], info: RankInfo, keep: int,
                          lock: tuple[str, str]) -> tuple[Checkpoints, Resumed | None]:
        """Steps 1 and 2 of the module docstring, on every rank: a broadcast and an all_gather_object
        (and one more broadcast when only some nodes have the newest checkpoint)."""
        marker = cls._shared_marker(directory, info, lock)
        head = info.local_rank == 0
        saw = info.is_main or (head and _exists_soon(marker))
        # 2. who has what: rank 0 and the heads of nodes that do not share its directory look
        looks = bool(sources) and (info.is_main or (head and (not saw or sources != [directory])))
        if head and not saw:
            cls._prepare(directory)
        found, table = _gather_found(sources, info, head=head, saw=saw, looks=looks)
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
        if not sources:
            return self, None
        return self, _newest(table, heads, found, info)

    @classmethod
    def _shared_marker(cls, directory: str, info: RankInfo, lock: tuple[str, str]) -> str:
        """1. rank 0's marker file, named by a nonce every rank learns after it exists (a broadcast);
        its path. CheckpointError on every rank when rank 0 cannot write it."""
        import torch.distributed as dist

        said: list[Any] = [None, None]
        if info.is_main:
            try:
                cls._prepare(directory, lock=lock)
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


def _gather_found(sources: list[str], info: RankInfo, *, head: bool, saw: bool,
                  looks: bool) -> tuple[tuple[str, dict] | None, list[dict]]:
    """(this rank's find, if it looked; every rank's entry) after one all_gather_object. A rank that
    failed to read raises on every rank, after the gather (no rank is left waiting in it)."""
    import torch.distributed as dist

    found: tuple[str, dict] | None = None
    error = None
    if looks:
        try:
            found = Checkpoints._find(sources)
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
