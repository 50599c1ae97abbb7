"""MPI launchers: ``mpirun -np N ddprun run ...`` started one process per rank.

Flavours, tried in this order (the first whose rank and size are present is read):

* Open MPI: OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
* MVAPICH: MV2_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
* MPICH and Intel MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
* Cray PALS mpiexec (PBS on HPE Cray EX/Shasta systems, e.g. ALCF Polaris): PMI_RANK, PMI_SIZE,
  PMI_LOCAL_RANK, PMI_LOCAL_SIZE. Same rank and size as Hydra's: the local pair that is present decides.

nproc_per_node = local size, nodes = size / local size (uneven layouts are refused), and the node rank
is rank // local size, which holds only when ranks are placed node by node (``--map-by slot``, the
default): other placements are refused. OMPI_COMM_WORLD_NODE_RANK is deliberately not read: despite
its name it is the process's rank on its node across all jobs, not the index of the node.

MPI does not say where the rendezvous host is: MASTER_ADDR must be exported to every rank
(``mpirun -x MASTER_ADDR=$(hostname)``) unless the whole world is on one node (then 127.0.0.1); a
loopback MASTER_ADDR in a world of several nodes is refused, as under SLURM.
The port is MASTER_PORT, else 29500; a blank MASTER_ADDR or MASTER_PORT (``-x MASTER_ADDR=$UNSET``)
counts as unset. Rendezvous is static: node ranks are known.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddprun.cluster._values import (
    DEFAULT_PORT,
    check_rank_rule,
    env_int,
    env_port,
    env_value,
    refuse_loopback_master,
)
from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading
from ddprun.errors import ClusterError

FLAVOURS: tuple[tuple[str, tuple[str, str, str, str]], ...] = (
    ("Open MPI", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                  "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("MVAPICH", ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                 "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE")),
    ("MPICH/Intel MPI", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
    ("Cray PALS", ("PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")),
)
"""(flavour, (rank, size, local rank, local size) variables)."""

MPIRUN_ONLY = ("OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "MPI_LOCALRANKID")
"""Set by mpirun/mpiexec but never by srun (srun --mpi=pmi2 sets PMI_RANK, not MPI_LOCALRANKID)."""


def started_by_mpi_launcher(environ: Mapping[str, str]) -> bool:
    """True when an mpirun/mpiexec started this process (used by SLURM to step aside)."""
    return any(k in environ for k in MPIRUN_ONLY)


def _flavour(environ: Mapping[str, str]) -> tuple[str, tuple[str, str, str, str]] | None:
    """The first flavour whose rank and size are present, preferring one whose local rank and size are
    too (Hydra and PALS share PMI_RANK/PMI_SIZE); None when no flavour's rank and size are."""
    found = [(flavour, keys) for flavour, keys in FLAVOURS if keys[0] in environ and keys[1] in environ]
    complete = [f for f in found if f[1][2] in environ and f[1][3] in environ]
    return next(iter(complete or found), None)


class MpiEnvironment(ClusterEnvironment):
    name = "mpi"
    master_hint = ("MPI does not name a rendezvous host: export it to every rank, "
                   "mpirun -x MASTER_ADDR=$(hostname) ... (Open MPI), -genv MASTER_ADDR $(hostname) "
                   "(MPICH/Intel MPI) or --env MASTER_ADDR=$(hostname) (Cray PALS), or pass --master-addr HOST.")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return _flavour(environ) is not None

    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        found = _flavour(environ)
        if found is None:
            raise ClusterError("No MPI rank variables found.",
                               seen="none of " + ", ".join(k for _, ks in FLAVOURS for k in ks[:2]),
                               hint="Start ddprun with mpirun, or leave MPI out.")
        flavour, (k_rank, k_size, k_local, k_lsize) = found
        missing = [k for k in (k_local, k_lsize) if k not in environ]
        if missing:  # name every local pair this rank variable may come with (Hydra's, PALS')
            missing = [k for _, ks in FLAVOURS if ks[0] == k_rank for k in ks[2:] if k not in environ]
            raise ClusterError(
                f"{flavour} gave the rank but not the local rank and size.",
                seen=f"{k_rank}={environ[k_rank]}, {k_size}={environ[k_size]}, "
                     + ", ".join(f"{k}=<unset>" for k in missing),
                hint="Use mpirun/mpiexec of a current MPI (it sets both), or launch one `ddprun run` per node "
                     "with --nnodes/--node-rank instead.",
            )
        rank, size = env_int(environ, k_rank), env_int(environ, k_size, minimum=1)
        local_rank, local_size = env_int(environ, k_local), env_int(environ, k_lsize, minimum=1)
        seen = f"{k_rank}={rank}, {k_size}={size}, {k_local}={local_rank}, {k_lsize}={local_size}"
        if size % local_size:
            raise ClusterError(
                f"{flavour} placed an uneven number of ranks per node; ddprun needs the same count on every node.",
                seen=seen + f" ({size} ranks do not split into nodes of {local_size})",
                hint="Give every node the same slots: mpirun -np <nodes x GPUs> --map-by ppr:<GPUs>:node "
                     "(Open MPI) or -ppn <GPUs> (MPICH/Intel MPI).",
            )
        node_rank = rank // local_size
        check_rank_rule(rank, local_rank, size, node_rank, local_size, seen=seen,
                        hint="Place ranks node by node: mpirun --map-by slot (Open MPI) or -ppn (MPICH).")
        nnodes = Fact(size // local_size, f"{k_size}={size} / {k_lsize}={local_size}")
        reading: Reading = {
            "min_nodes": nnodes,
            "max_nodes": nnodes,
            "nproc_per_node": Fact(local_size, f"{k_lsize}={local_size}"),
            "node_rank": Fact(node_rank, f"{k_rank}={rank} // {k_lsize}={local_size}"),
            "rank": Fact(rank, f"{k_rank}={rank}"),
            "local_rank": Fact(local_rank, f"{k_local}={local_rank}"),
            "world_size": Fact(size, f"{k_size}={size}"),
            "rdzv_backend": Fact("static", f"node ranks known from {flavour} ranks"),
        }
        addr = env_value(environ, "MASTER_ADDR")  # blank: as unset
        if addr is not None:
            refuse_loopback_master(addr, nnodes.value, f"{nnodes.value} nodes ({nnodes.source})", f"{flavour} job",
                                   hint="Export the address of rank 0's host to every rank: mpirun -x "
                                        "MASTER_ADDR=$(hostname) (Open MPI), -genv MASTER_ADDR $(hostname) "
                                        "(MPICH/Intel MPI) or --env MASTER_ADDR=$(hostname) (Cray PALS).")
            reading["master_addr"] = Fact(addr, f"MASTER_ADDR={addr}")
        elif local_size == size:
            reading["master_addr"] = Fact("127.0.0.1", f"every rank on this node ({k_lsize}={k_size}={size})")
        # else: left out, so that --master-addr can still give it; resolve() raises with master_hint.
        if env_value(environ, "MASTER_PORT") is not None:
            reading["master_port"] = Fact(env_port(environ), f"MASTER_PORT={environ['MASTER_PORT']}")
        else:
            reading["master_port"] = Fact(DEFAULT_PORT, f"default ({DEFAULT_PORT}, as torchrun); MASTER_PORT unset")
        return reading
