"""The rank plan: which process on which node gets which global rank and device.

The rule, the same one torch's elastic agent applies (``_assign_worker_ranks``) for a homogeneous job:

1. Nodes are numbered ``0 .. nnodes-1`` (the node rank, torch's GROUP_RANK). Under c10d rendezvous
   the number is the node's arrival order, so the plan printed before launch is a prediction and the
   table gathered from the workers after rendezvous (``runs/<id>/plan.json``) is the fact.
2. On each node, processes are numbered ``0 .. nproc_per_node-1`` (LOCAL_RANK).
3. ``global rank = node_rank * nproc_per_node + local_rank``; ``world size = nnodes * nproc_per_node``.
4. The device of a process is ``cuda:<local_rank>`` on GPU nodes (one process per device), else ``cpu``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ddprun.errors import ConfigError


@dataclass(frozen=True)
class RankSlot:
    node_rank: int
    local_rank: int
    rank: int
    device: str


@dataclass(frozen=True)
class RankPlan:
    nnodes: int
    nproc_per_node: int
    slots: tuple[RankSlot, ...]

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def to_json(self) -> dict:
        return {"nnodes": self.nnodes, "nproc_per_node": self.nproc_per_node, "world_size": self.world_size,
                "ranks": [asdict(s) for s in self.slots]}


def device_for(device_kind: str, local_rank: int) -> str:
    return f"cuda:{local_rank}" if device_kind == "cuda" else "cpu"


def make_plan(nnodes: int, nproc_per_node: int, device_kind: str = "cpu") -> RankPlan:
    """The plan for ``nnodes`` × ``nproc_per_node`` processes (rule in the module docstring)."""
    if nnodes < 1 or nproc_per_node < 1:
        raise ConfigError("A plan needs at least one node and one process per node.",
                          seen=f"nnodes={nnodes}, nproc_per_node={nproc_per_node}", hint="Give positive counts.")
    slots = tuple(
        RankSlot(node_rank=n, local_rank=lr, rank=n * nproc_per_node + lr, device=device_for(device_kind, lr))
        for n in range(nnodes) for lr in range(nproc_per_node)
    )
    return RankPlan(nnodes=nnodes, nproc_per_node=nproc_per_node, slots=slots)
