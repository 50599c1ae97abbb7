"""ddprun: multi-node PyTorch DDP that starts everywhere, uses every GPU, and names what is wrong.

Importing ddprun is cheap: it imports neither torch's distributed stack eagerly nor lightning. The
training API is loaded on first use (module ``__getattr__``):

    ddprun.init()       join the process group, pick this rank's device -> RankInfo
    ddprun.rank_info()  who this process is, without initialising anything
    ddprun.fit(...)     train an nn.Module (or a LightningModule: ddprun.lightning) data-parallel -> FitResult
    ddprun.heartbeat()  tell the stall watchdog this process is alive (a phase without steps or collectives)
    ddprun.on_preempt(fn)  call fn(step) at the job's agreed preemption stop step (``ddprun run``; fit needs none)
    ddprun.Preempted    what ends a script there (a SystemExit)
    ddprun.launch(fn, *args, nproc_per_node=N, **kwargs)
                        run fn on every device of this machine (script, notebook, REPL) -> rank 0's value

``ddprun.lightning`` (the ``ddprun[lightning]`` extra) imports lightning; import it yourself for
``trainer_kwargs()``. ``ddprun.ray`` (the ``ddprun[ray]`` extra: ``ddprun.ray.fit`` on a Ray cluster)
imports ray; import it yourself too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddprun._version import __version__

_LAZY: dict[str, tuple[str, str]] = {
    "init": ("ddprun.runtime", "init"),
    "heartbeat": ("ddprun.telemetry", "heartbeat"),
    "rank_info": ("ddprun.runtime", "rank_info"),
    "RankInfo": ("ddprun.runtime", "RankInfo"),
    "fit": ("ddprun.api", "fit"),
    "FitResult": ("ddprun.api", "FitResult"),
    "launch": ("ddprun.agent.fnlaunch", "launch"),
    "on_preempt": ("ddprun.preempt", "on_preempt"),
    "Preempted": ("ddprun.preempt", "Preempted"),
    "safe_worker_init": ("ddprun.train.data", "safe_worker_init"),
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:
    from ddprun.agent.fnlaunch import launch  # noqa: F401 - names for type checkers and IDEs
    from ddprun.api import FitResult, fit  # noqa: F401 - names for type checkers and IDEs
    from ddprun.preempt import Preempted, on_preempt  # noqa: F401 - names for type checkers and IDEs
    from ddprun.runtime import RankInfo, init, rank_info  # noqa: F401 - names for type checkers and IDEs
    from ddprun.telemetry import heartbeat  # noqa: F401 - names for type checkers and IDEs
    from ddprun.train.data import safe_worker_init  # noqa: F401 - names for type checkers and IDEs


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ddprun' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
