"""Atomic checkpoints: what a training state is, how it is written, found and read back.

Layout of a checkpoint directory::

    step-00000120.pt   one file per saved step (torch.save of a dict of tensors and plain values)
    latest             the file name of the newest complete checkpoint, written last

Writing: a temp file in the same directory, flushed and fsynced, then ``os.replace`` (atomic on
POSIX), then the directory fsynced; ``latest`` is updated the same way only after that. A crash at
any point leaves either the old or the new checkpoint whole, and ``latest`` never names a partial
file. Reading uses ``torch.load(weights_only=True)``: a checkpoint can hold tensors and plain Python
values only, never arbitrary pickled objects (numpy RNG state is stored as a tensor for that reason).

One rank saves (rank 0: DDP keeps every rank's model identical); the caller puts a barrier after it.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable
from typing import IO, Any

import torch

from ddprun.errors import ConfigError

FORMAT_VERSION = 1
"""Bumped when the state's keys change meaning; :func:`load` refuses newer versions."""
LATEST = "latest"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms/filesystems cannot open a directory; the rename stands anyway
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Create or replace ``path`` with what ``write(fileobj)`` writes, atomically (module docstring)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def rng_state() -> dict[str, Any]:
    """RNG states of torch (CPU and every CUDA device), python ``random`` and numpy if importable."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state` (the parts this process can restore)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))


def save(directory: str, state: dict[str, Any]) -> str:
    """Write ``state`` (see :func:`ddprun.train.loop.training_state`) as ``step-N.pt``, then ``latest``.

    Returns the checkpoint's path. ``state`` must hold tensors and plain values only.
    """
    state = {"format_version": FORMAT_VERSION, **state}
    path = os.path.join(directory, checkpoint_name(int(state["step"])))
    write_atomic(path, lambda f: torch.save(state, f))
    name = os.path.basename(path).encode()
    write_atomic(os.path.join(directory, LATEST), lambda f: f.write(name + b"\n"))
    return path


def latest(directory: str) -> str | None:
    """Path of the newest complete checkpoint in ``directory``, or None when there is none."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(directory, name)
    return path if name and os.path.isfile(path) else None


def load(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint file, or the ``latest`` one of a directory, with ``weights_only=True``."""
    if os.path.isdir(path):
        found = latest(path)
        if found is None:
            raise ConfigError("The checkpoint directory has no complete checkpoint.",
                              seen=f"{path}: no '{LATEST}' file naming an existing checkpoint",
                              hint="Point at a directory fit() saved into (run dir/checkpoints), or at a .pt file.")
        path = found
    state = torch.load(path, map_location=map_location, weights_only=True)
    version = state.get("format_version") if isinstance(state, dict) else None
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigError("This checkpoint's format is not one this ddprun reads.",
                          seen=f"{path}: format_version={version!r}, this ddprun reads up to {FORMAT_VERSION}",
                          hint="Load it with the ddprun version that wrote it, or upgrade ddprun.")
    return state
