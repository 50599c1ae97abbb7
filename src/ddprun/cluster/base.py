"""The small contract every cluster environment implements, and the values they produce.

An environment is a pure reader: ``detect(environ)`` says whether its variables are present,
``read(environ, node)`` turns them into :class:`Fact` values that each carry their source, so that
``ddprun plan --explain`` can say where every number came from. Nothing here reads ``os.environ``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class NodeFacts:
    """What the launcher probed on this node (the only I/O behind detection, done in cli.py)."""

    hostname: str
    cpus: int
    cuda_devices: int = 0
    """CUDA devices visible to this process (after CUDA_VISIBLE_DEVICES)."""
    addresses: tuple[str, ...] = ()
    """IP addresses of this node (its name resolved, its interfaces), to find it in a hostfile."""
    cpus_note: str = ""
    """Why ``cpus`` is less than the cores this process may run on (a container's CPU limit), else ''."""
    unused_gpus: str = ""
    """Why torch sees no CUDA device on a node with an NVIDIA driver (a CPU-only torch build, a driver
    torch's CUDA cannot use), else ''."""

    def cpus_text(self) -> str:
        """``4 CPUs``, with the note when there is one."""
        return f"{self.cpus} CPU{'' if self.cpus == 1 else 's'}" + (f": {self.cpus_note}" if self.cpus_note else "")


@dataclass(frozen=True)
class Fact:
    """A value and where it came from, e.g. ``Fact(2, "SLURM_JOB_NUM_NODES=2")``."""

    value: Any
    source: str


Reading = dict[str, Fact]
"""Keys: min_nodes, max_nodes, nproc_per_node, node_rank, master_addr, master_port, rdzv_backend,
run_id, and for one-process-per-rank launches (srun/mpirun tasks) rank, local_rank, world_size.
Extra keys (e.g. ``ifname``) are kept in ClusterSpec.sources and shown by ``plan --explain``."""


class ClusterEnvironment(ABC):
    """One way a cluster states the topology. Subclasses are small and stateless."""

    name: ClassVar[str]
    master_hint: ClassVar[str] = ""
    """What to do when this environment cannot name the rendezvous host of a multi-node job."""

    @staticmethod
    @abstractmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """True when this environment's variables are present in ``environ``."""

    @abstractmethod
    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        """The facts this environment states; raise ClusterError on contradictory input. ``launcher``:
        this process starts the node's workers (``ddprun run``), else it is one of them."""


@dataclass(frozen=True)
class ClusterSpec:
    """The resolved topology of one launch, as this node sees it before rendezvous."""

    environment: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    node_rank: int | None
    """None when the rendezvous assigns node ranks (c10d, in order of arrival)."""
    master_addr: str | None
    """None only in a dry run (``ddprun plan``) when nothing names the rendezvous host; see
    ``sources["master_addr"]`` for what is missing. ``ddprun run`` never gets None (resolve raises)."""
    master_port: int
    rdzv_backend: str
    run_id: str
    device: str
    """``cuda`` or ``cpu``: what each process's ``LOCAL_RANK`` indexes."""
    sources: Mapping[str, str] = field(default_factory=dict)
    rank: int | None = None
    """Set only when the cluster started one process per rank (srun tasks, mpirun), or when a script a
    multi-node job starts once per node is the node's one rank (detect.one_rank_per_node)."""
    local_rank: int | None = None
    world_size: int | None = None
    notes: tuple[str, ...] = ()
    ifname: str | None = None
    """The network interface the cluster names for this job (SageMaker), else None; see netaddr.py."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Values of the environment's extra facts (e.g. ``allocated_gpus``), keyed like ``sources``."""

    @property
    def rdzv_endpoint(self) -> str | None:
        """``HOST:PORT`` (IPv6 hosts bracketed); None when the host is unresolved (dry run)."""
        if self.master_addr is None:
            return None
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes
