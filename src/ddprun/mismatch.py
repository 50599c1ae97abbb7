"""Launch-mismatch errors (a framework's process count vs the launch), as one line that names both sides.

Never imports lightning: the worker's failure path calls :func:`translate` on every exception that
leaves the user's script. Every rank of a job raises the same launch-mismatch error within the same
second; a traceback per rank would bury the cause, so each rank reports the same one line (what the
Trainer asked for, what the launch started, a HINT) and the launcher prints it once with its ranks.

The errors recognised:
  * :class:`TrainerMismatch`, which :mod:`ddprun.lightning` raises itself (also from the
    LaunchCheck callback that :func:`callbacks_factory` adds to every Trainer in a ddprun worker);
  * Lightning's ``ValueError`` from ``TorchElasticEnvironment.validate_settings`` ("You set
    `devices=D` and `num_nodes=N` in Lightning, but the product ... does not match the world size");
  * the ``IndexError`` of ``DDPStrategy.root_device`` when devices x num_nodes equals the world size
    but devices is smaller than the processes on this node (e.g. devices=1, num_nodes=4 under 2 x 2).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ddprun.errors import ConfigError

_PRODUCT = re.compile(r"You set `devices=(\d+)` and `num_nodes=(\d+)` in Lightning, but the product")


def launch_shape(environ: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(processes on this node, nodes, world size) of a torchrun/``ddprun run`` launch, else None."""
    try:
        world = int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_WORLD_SIZE", world))
    except (KeyError, ValueError):
        return None
    nodes = environ.get("GROUP_WORLD_SIZE")
    return local, int(nodes) if nodes and nodes.isdigit() else max(1, world // max(1, local)), world


class TrainerMismatch(ConfigError):
    """A Lightning Trainer whose devices x num_nodes disagree with the processes the launcher started."""

    def __init__(self, devices: int, num_nodes: int, environ: Mapping[str, str] | None = None, note: str = "",
                 module: str = "ddprun.lightning"):
        """``module``: the ddprun module whose trainer_kwargs() the HINT names (ddprun.pytorch_lightning
        for a pytorch_lightning Trainer)."""
        environ = os.environ if environ is None else environ
        local, nodes, world = launch_shape(environ) or (1, 1, 1)
        self.devices, self.num_nodes = devices, num_nodes
        super().__init__(
            "Lightning's Trainer and the launch disagree about the number of processes" + (f" ({note})" if note else "")
            + ".",
            seen=f"Trainer devices={devices} x num_nodes={num_nodes} = {devices * num_nodes}; launch "
                 f"LOCAL_WORLD_SIZE={local} x {nodes} node(s) = WORLD_SIZE={world}",
            hint=f"build the Trainer with Trainer(**{module}.trainer_kwargs(), ...), or pass "
                 f"devices={local}, num_nodes={nodes}.",
        )

    def one_line(self) -> str:
        return f"{self.what} Seen: {self.seen}. HINT: {self.hint}"


def _root_device_owner(exc: BaseException):
    """The strategy whose ``root_device`` raised ``exc`` (local rank >= its devices), else None."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None or last.tb_frame.f_code.co_name != "root_device":
        return None
    owner = last.tb_frame.f_locals.get("self")
    if "lightning" not in type(owner).__module__ or not hasattr(owner, "parallel_devices"):
        return None
    return owner


def _ddprun_module(exc: BaseException) -> str:
    """ddprun.pytorch_lightning when the standalone package (or its lightning_fabric) raised ``exc``."""
    tb = exc.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith(("pytorch_lightning", "lightning_fabric")):
            return "ddprun.pytorch_lightning"
        tb = tb.tb_next
    return "ddprun.lightning"


def translate(exc: BaseException, environ: Mapping[str, str] | None = None) -> str | None:
    """One line for a launch-mismatch error (module docstring), else None: print the traceback."""
    environ = os.environ if environ is None else environ
    if isinstance(exc, TrainerMismatch):
        return exc.one_line()
    if launch_shape(environ) is None:
        return None
    if isinstance(exc, ValueError):
        m = _PRODUCT.search(str(exc))
        if m:
            return TrainerMismatch(int(m[1]), int(m[2]), environ, module=_ddprun_module(exc)).one_line()
    if isinstance(exc, IndexError):
        strategy = _root_device_owner(exc)
        if strategy is not None:
            devices = len(strategy.parallel_devices or [])
            note = f"local rank {environ.get('LOCAL_RANK', '?')} has no device among the Trainer's {devices}"
            return TrainerMismatch(devices, int(getattr(strategy, "num_nodes", 1)), environ, note,
                                   module=_ddprun_module(exc)).one_line()
    return None
