"""Atomic checkpoints: how one is written, verified, found, read back and pruned (one directory).

Layout of a checkpoint directory::

    step-00000120.pt         torch.save of a dict of tensors and plain values
    step-00000120.meta.json  {"file", "step", "bytes", "sha256"} of that file, as it was written
    latest                   the file name of the newest complete checkpoint, written last
    .ddprun-writer.lock      held by the writing fit while it runs (train/dirlock.py)
    fit-1/ ...               the same files of the 2nd, 3rd ... fit() of one process (train/resume.py)
    previous-1/ ...          an earlier run's files, moved there (never deleted) by a fit that starts anew

Writing: a temp file in the same directory (hashed while written), flushed and fsynced, then
``os.replace`` (atomic on POSIX), then the directory fsynced; the meta file the same way; ``latest``
only after both. A crash at any point leaves the previous checkpoint whole and ``latest`` naming it.
A failed write (disk full) removes its temp file and raises :class:`~ddprun.errors.CheckpointError`.

Reading: :func:`newest_valid` tries ``latest``, then the others newest first; a file whose size or
SHA-256 differs from its meta (truncated, corrupted) or that torch cannot read is skipped with a
warning naming it. ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain values
only, never arbitrary pickled objects (numpy RNG state is stored as a tensor for that reason).
Verifying reads the whole file once (SHA-256, about 1 GB/s).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from typing import IO, Any, cast

import torch

from ddprun.errors import CheckpointError, ConfigError
from ddprun.protocol.atomic import remove_durably, write_atomic

FORMAT_VERSION = 2
"""Bumped when the state's keys change meaning; :func:`load` refuses newer versions. 2: ``rng`` is a
list with one entry per rank, ``sampler`` has ``samples_done``; a meta file per checkpoint."""
LATEST = "latest"
_NAME = re.compile(r"^step-(\d+)\.pt$")
_META = re.compile(r"^step-(\d+)\.meta\.json$")
_TEMP = re.compile(r"^\.(step-\d+\.(pt|meta\.json)|latest)\..+\.tmp$")
"""A temp file of :func:`~ddprun.protocol.atomic.write_atomic` for one of this module's files."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def meta_path(path: str) -> str:
    """The meta file of checkpoint ``path`` (``step-N.pt`` -> ``step-N.meta.json``)."""
    return path[:-3] + ".meta.json" if path.endswith(".pt") else path + ".meta.json"


def is_checkpoint_file(name: str) -> bool:
    """Whether a file name in a checkpoint directory is one of a checkpoint set's: ``step-N.pt``, its
    meta file, ``latest``."""
    return bool(_NAME.match(name) or _META.match(name)) or name == LATEST


def step_of(path: str) -> int | None:
    m = _NAME.match(os.path.basename(path))
    return int(m.group(1)) if m else None


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through to ``f``."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0
        self.error: OSError | None = None
        """The file system's error, kept: torch's zip writer reports it only as "unexpected pos"."""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            self._f.write(view)
        except OSError as e:
            self.error = e
            raise
        self.sha256.update(view)
        self.bytes += len(view)
        return len(view)

    def flush(self) -> None:
        self._f.flush()


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# -- RNG ------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """RNG states of torch (CPU, and the CUDA device this rank computes on: ``cuda_device``), python
    ``random`` and numpy if importable."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # this rank's device only: a resume on nodes with another GPU count gives the rank another index
        state["cuda_device"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return state
    # the legacy tuple (the stubs also allow a dict, returned only for a bit generator other than the global MT19937)
    kind, keys, pos, has_gauss, cached = cast("tuple[str, Any, int, int, float]", np.random.get_state())
    state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state` (the parts this process can restore)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if torch.cuda.is_available():
        if "cuda_device" in state:
            torch.cuda.set_rng_state(state["cuda_device"])
        elif "cuda" in state:  # checkpoints before cuda_device: every device the writer saw, perhaps more than here
            for index, device_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(device_state, index)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))


# -- writing --------------------------------------------------------------------------------------

def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f" ({e.filename})" if e.filename else "")
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


def _writing(data: bytes) -> Callable[[IO[bytes]], None]:
    """A ``write_atomic`` callback that writes ``data``."""
    def write(f: IO[bytes]) -> None:
        f.write(data)
    return write


def _free_bytes(directory: str) -> str:
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB free there"
    except OSError:
        return "free space unknown"


def _check_loadable(path: str, step: int) -> None:
    """Raise CheckpointError (``path`` removed) when ``torch.load(weights_only=True)`` would refuse a
    class in ``path``: found at the first save, not at the restart that needs it. A static scan of the
    pickle in Python: milliseconds for a small job, seconds at thousands of ranks (each rank's RNG
    state is in it), so fit makes it at its first save only (its state's classes do not change)."""
    try:
        refused = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (ValueError, RuntimeError, OSError):  # not torch's zip format: torch.load's own check at resume
        return
    if refused:
        remove_durably(path)
        raise CheckpointError(f"The checkpoint of step {step} could not be loaded back, so it was not kept.",
                              seen=f"{os.path.basename(path)} holds {', '.join(sorted(refused))}, which "
                                   "torch.load(weights_only=True) refuses",
                              hint="A checkpoint holds tensors and plain values: find what holds that object (a "
                                   "module's get_extra_state, an optimizer's or scheduler's state), or allow its class "
                                   "with torch.serialization.add_safe_globals([...]) in the script before fit().")


def save(directory: str, state: dict[str, Any], keep: int | None = None, check_loadable: bool = True) -> str:
    """Write ``state`` as ``step-N.pt`` with its meta file, then ``latest``; keep the newest ``keep``.

    Returns the checkpoint's path. ``state`` must hold tensors and plain values only, and ``step``.
    Raises CheckpointError when the file system refuses (disk full, permissions): the previous
    checkpoint and ``latest`` are then unchanged and no temp file is left; and, ``check_loadable``,
    when the file holds a class ``torch.load(weights_only=True)`` refuses (the file is then removed).
    """
    state = {"format_version": FORMAT_VERSION, **state}
    step = int(state["step"])
    path = os.path.join(directory, checkpoint_name(step))
    previous = latest(directory) if os.path.isdir(directory) else None
    try:
        os.makedirs(directory, exist_ok=True)
        written: dict[str, Any] = {}

        def write(f: IO[bytes]) -> None:
            w = _HashingWriter(f)
            try:
                torch.save(state, cast(IO[bytes], w))  # a buffer to torch: it calls only write() and flush()
            except RuntimeError as e:
                raise (w.error or e) from e
            written.update(bytes=w.bytes, sha256=w.sha256.hexdigest())

        # a re-save of this step (fit's last save, once its epoch counted): the old meta goes first, so
        # a crash between the renames below leaves a whole file without one, never one it contradicts
        remove_durably(meta_path(path))
        write_atomic(path, write)
        if check_loadable:
            _check_loadable(path, step)
        meta = {"file": os.path.basename(path), "step": step, **written}
        write_atomic(meta_path(path), _writing(json.dumps(meta).encode() + b"\n"))
        write_atomic(os.path.join(directory, LATEST), _writing(os.path.basename(path).encode() + b"\n"))
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as a RuntimeError
        if previous == path:
            kept = f"the checkpoint of this step on disk ({os.path.basename(path)}) is whole"
        elif previous:
            kept = f"the previous checkpoint {os.path.basename(previous)} is intact"
        else:
            kept = "there is no earlier checkpoint"
        raise CheckpointError(f"Saving the checkpoint of step {step} failed.",
                              seen=f"{path}: {_why(e)}; {_free_bytes(directory)}",
                              hint=f"Free space, or give fit() a checkpoint_dir on a larger file system, or fewer "
                                   f"keep_checkpoints; {kept}.") from e
    if keep is not None:
        prune(directory, keep)
    return path


def checkpoints(directory: str) -> list[str]:
    """Paths of the ``step-N.pt`` files in ``directory``, newest (highest step) first."""
    try:
        names = [n for n in os.listdir(directory) if _NAME.match(n)]
    except FileNotFoundError:
        return []
    return [os.path.join(directory, n) for n in sorted(names, key=lambda n: step_of(n) or 0, reverse=True)]  # matched: never None


_PRUNE_FAILED: set[tuple[str, int | None]] = set()
"""(path, errno) of each old checkpoint this process could not delete and said so (once each)."""


def prune(directory: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints (never the one ``latest`` names); the deleted.
    One the file system refuses to delete (EACCES, EIO, ...) stays, with one warning naming it: the
    save that pruned is whole, and a job is not stopped for a file it no longer needs."""
    current = latest(directory)
    removed = []
    for path in checkpoints(directory)[max(1, keep):]:
        if path == current:
            continue
        try:
            for p in (path, meta_path(path)):  # the file first: its meta stays while it does
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        except OSError as e:
            if (p, e.errno) not in _PRUNE_FAILED:
                _PRUNE_FAILED.add((p, e.errno))
                why = e.strerror or type(e).__name__
                warnings.warn(f"ddprun: the old checkpoint {p} could not be deleted ({why}); it stays, and training "
                              f"goes on. Delete it yourself to keep {max(1, keep)} checkpoint(s).", stacklevel=2)
            continue
        removed.append(path)
    return removed


def remove_temp_files(directory: str) -> None:
    """Remove temp files a killed checkpoint writer left (``.step-N.pt.XXXX.tmp``, a meta's, ``latest``'s);
    call before writing starts. Only those: a checkpoint_dir may be the run dir, whose other files
    another writer (the agent) may be writing now."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for n in names:
        if _TEMP.match(n):
            try:
                os.unlink(os.path.join(directory, n))
            except OSError:
                pass


# -- reading --------------------------------------------------------------------------------------

def latest(directory: str) -> str | None:
    """Path ``latest`` names in ``directory`` if that file exists (not verified), else None."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            name = f.read().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    path = os.path.join(directory, name)
    return path if name and "/" not in name and os.path.isfile(path) else None


def verify(path: str) -> str | None:
    """None when ``path`` is the file its meta describes; else what is wrong with it. A checkpoint
    without a meta file (ddprun before format 2) passes: torch's reader is its only check."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        return _why(e)
    try:
        with open(meta_path(path)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"its meta file is unreadable ({_why(e)})"
    if size != meta.get("bytes"):
        return f"{size} bytes on disk, {meta.get('bytes')} were written (truncated?)"
    if file_sha256(path) != meta.get("sha256"):
        return "its SHA-256 differs from the one written (corrupted)"
    return None


def read(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` plus the format check (no checksum: see :func:`verify`)."""
    state = torch.load(path, map_location=map_location, weights_only=True)
    version = state.get("format_version") if isinstance(state, dict) else None
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigError("This checkpoint's format is not one this ddprun reads.",
                          seen=f"{path}: format_version={version!r}, this ddprun reads up to {FORMAT_VERSION}",
                          hint="Load it with the ddprun version that wrote it, or upgrade ddprun.")
    return state


def newest_valid(directory: str, map_location: str | torch.device = "cpu",
                 warn: bool = True) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` that verifies and loads, as (path, state), or None.

    Tries ``latest`` first, then every ``step-N.pt`` newest first. Each one skipped is named in a
    warning with the reason, and so is the one used instead.
    """
    order = checkpoints(directory)
    named = latest(directory)
    if named in order:
        order.remove(named)
        order.insert(0, named)
    skipped: list[str] = []
    for path in order:
        problem = verify(path)
        if problem is None:
            try:
                state = read(path, map_location)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - a damaged zip, a truncated pickle, a non-checkpoint
                problem = f"torch.load failed: {_why(e)}"
            else:
                if skipped and warn:
                    warnings.warn(f"ddprun: {'; '.join(skipped)}; using {os.path.basename(path)} instead.",
                                  stacklevel=2)
                return path, state
        skipped.append(f"checkpoint {os.path.basename(path)} is unusable: {problem}")
    if skipped and warn:
        warnings.warn(f"ddprun: {'; '.join(skipped)}; no usable checkpoint left in {directory}.", stacklevel=2)
    return None


def load(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint file (verified), or the newest usable one of a directory (:func:`newest_valid`)."""
    if os.path.isdir(path):
        found = newest_valid(path, map_location)
        if found is None:
            raise ConfigError("The checkpoint directory has no complete checkpoint.",
                              seen=f"{path}: no usable step-N.pt (see the warnings above, if any)",
                              hint="Point at a directory fit() saved into (run dir/checkpoints), or at a .pt file.")
        return found[1]
    problem = verify(path)
    if problem is not None:
        raise CheckpointError("The checkpoint file is damaged.", seen=f"{path}: {problem}",
                              hint="Use an earlier checkpoint of the same directory (give the directory to pick the "
                                   "newest usable one).")
    return read(path, map_location)


def match_model(saved: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """Raise ConfigError when a saved model state does not fit the model being trained."""
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    shapes = [f"{k}: {tuple(saved[k].shape)} saved, {tuple(current[k].shape)} now" for k in current
              if k in saved and isinstance(saved[k], torch.Tensor) and isinstance(current[k], torch.Tensor)
              and saved[k].shape != current[k].shape]
    if not (missing or unexpected or shapes):
        return

    def few(items: list[str]) -> str:
        return ", ".join(items[:4]) + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")

    seen = [f"{where}"]
    if missing:
        seen.append(f"missing from the checkpoint: {few(missing)}")
    if unexpected:
        seen.append(f"not in this model: {few(unexpected)}")
    if shapes:
        seen.append(f"shapes differ: {few(shapes)}")
    raise ConfigError("The checkpoint to resume from is of a different model.", seen="; ".join(seen),
                      hint="Resume with the model that wrote it, or start anew: another checkpoint_dir (or run dir), "
                           "or fit(..., resume=False).")
