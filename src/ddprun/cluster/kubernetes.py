"""Kubeflow PyTorchJob: one pod per node, ``ddprun run`` once in each (the pod's command).

The training operator states the topology in torchrun's ``PET_*`` mirrors of its flags
(PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, and for elastic
jobs PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_RDZV_ID, PET_MAX_RESTARTS), plus MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE. PET_MAX_RESTARTS is the restarts when --max-restarts is not
given. Every value is per node: the pod runs one launcher (``ddprun run``), which starts the
processes; a pod that runs ``python train.py`` itself is its node's one rank
(detect.one_rank_per_node, applied by runtime).

* With PET_NNODES (current operator): nodes = PET_NNODES (``N`` or ``MIN:MAX``), node rank =
  PET_NODE_RANK (else RANK), processes = PET_NPROC_PER_NODE. WORLD_SIZE is not read: the operator sets
  it to pods × PET_NPROC_PER_NODE, and older versions to pods.
* Without (older operator): WORLD_SIZE = number of pods, RANK = this pod's index.

The rendezvous host is PET_RDZV_ENDPOINT, else PET_MASTER_ADDR/PORT, else MASTER_ADDR/PORT (the
master pod's service). A loopback one in a job of several pods is not refused as under SLURM and
MPI: some operators (Kubeflow's old pytorch-operator, forks of the training operator) set
MASTER_ADDR=localhost in the master pod itself, which hosts the store; it is read as this pod's own
name, where its peers reach it (torch's store listens on every interface there). The backend is
PET_RDZV_BACKEND, else static when the node rank is known.
Detected on PET_NNODES, or KUBERNETES_SERVICE_HOST with MASTER_ADDR and RANK or PET_NODE_RANK; RANK
without LOCAL_RANK is not a torchrun worker, so the torchrun environment does not claim it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddprun.cluster._values import env_int, env_port, split_endpoint
from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading
from ddprun.errors import ClusterError


def _nnodes(environ: Mapping[str, str]) -> tuple[int, int, str]:
    if "PET_NNODES" not in environ:
        if "WORLD_SIZE" not in environ:
            raise ClusterError("A PyTorchJob pod without PET_NNODES or WORLD_SIZE: the number of nodes is unknown.",
                               seen=f"RANK={environ.get('RANK', '<unset>')}, WORLD_SIZE=<unset>",
                               hint="Check the PyTorchJob (training operator), or give --nnodes.")
        n = env_int(environ, "WORLD_SIZE", minimum=1)
        return n, n, f"WORLD_SIZE={n} (pods, older training operator)"
    raw = environ["PET_NNODES"]
    parts = raw.split(":")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        lo, hi = int(parts[0]), int(parts[-1])
        if 0 < lo <= hi:
            return lo, hi, f"PET_NNODES={raw}"
    raise ClusterError("PET_NNODES is neither N nor MIN:MAX with 0 < MIN <= MAX.", seen=f"PET_NNODES={raw!r}",
                       hint="Check the PyTorchJob's replicas and elasticPolicy.")


def _nproc(environ: Mapping[str, str], node: NodeFacts) -> Fact | None:
    """PET_NPROC_PER_NODE as torchrun reads it; ``auto`` on a CPU node keeps ddprun's default (1)."""
    raw = environ["PET_NPROC_PER_NODE"].strip()
    src = f"PET_NPROC_PER_NODE={raw}"
    if raw in ("auto", "gpu") and node.cuda_devices:
        return Fact(node.cuda_devices, f"{src} ({node.cuda_devices} visible GPUs)")
    if raw == "auto":
        return None
    if raw == "gpu":
        raise ClusterError("PET_NPROC_PER_NODE=gpu, but this pod sees no CUDA device.",
                           seen=f"{src}, host {node.hostname}: 0 GPUs",
                           hint="Request GPUs in the pod spec (resources.limits nvidia.com/gpu), or set nprocPerNode.")
    if raw == "cpu":
        return Fact(node.cpus, f"{src} ({node.cpus_text()})")
    return Fact(env_int(environ, "PET_NPROC_PER_NODE", minimum=1), src)


def _master(addr: str, key: str, nodes: int, node: NodeFacts) -> Fact:
    """The rendezvous host ``key`` names. A loopback one in a job of several pods is the master pod's
    own (operators that set ``localhost`` there): this pod's name, which its peers reach, so that the
    store it hosts listens where they dial, not on loopback only."""
    from ddprun.cluster.netaddr import is_loopback

    if nodes > 1 and is_loopback(addr):
        return Fact(node.hostname, f"{key}={addr} in a job of {nodes} pods: this pod's own name, {node.hostname}")
    return Fact(addr, f"{key}={addr}")


class KubernetesEnvironment(ClusterEnvironment):
    name = "kubernetes"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        if "PET_NNODES" in environ:
            return True
        return ("KUBERNETES_SERVICE_HOST" in environ and "MASTER_ADDR" in environ
                and ("RANK" in environ or "PET_NODE_RANK" in environ))

    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        lo, hi, nodes_src = _nnodes(environ)
        reading: Reading = {"min_nodes": Fact(lo, nodes_src), "max_nodes": Fact(hi, nodes_src)}
        if "PET_NPROC_PER_NODE" in environ:
            nproc = _nproc(environ, node)
            if nproc is not None:
                reading["nproc_per_node"] = nproc
        for key in ("PET_NODE_RANK", "RANK"):
            if key in environ:
                reading["node_rank"] = Fact(env_int(environ, key), f"{key}={environ[key]}")
                break

        if "PET_RDZV_ENDPOINT" in environ:
            host, port = split_endpoint(environ["PET_RDZV_ENDPOINT"], "PET_RDZV_ENDPOINT")
            reading["master_addr"] = Fact(host, f"PET_RDZV_ENDPOINT={environ['PET_RDZV_ENDPOINT']}")
            if port is not None:
                reading["master_port"] = Fact(port, f"PET_RDZV_ENDPOINT={environ['PET_RDZV_ENDPOINT']}")
        for addr_key, port_key in (("PET_MASTER_ADDR", "PET_MASTER_PORT"), ("MASTER_ADDR", "MASTER_PORT")):
            if addr_key in environ and "master_addr" not in reading:
                reading["master_addr"] = _master(environ[addr_key], addr_key, hi, node)
            if port_key in environ and "master_port" not in reading:
                reading["master_port"] = Fact(env_port(environ, port_key), f"{port_key}={environ[port_key]}")

        if "PET_RDZV_BACKEND" in environ:
            backend = environ["PET_RDZV_BACKEND"]
            reading["rdzv_backend"] = Fact(backend, f"PET_RDZV_BACKEND={backend}")
        elif "node_rank" in reading:
            reading["rdzv_backend"] = Fact("static", f"node rank known from {reading['node_rank'].source}")
        if "PET_RDZV_ID" in environ:
            reading["run_id"] = Fact(environ["PET_RDZV_ID"], f"PET_RDZV_ID={environ['PET_RDZV_ID']}")
        if "PET_MAX_RESTARTS" in environ:  # the job's elasticPolicy.maxRestarts; --max-restarts wins
            n = env_int(environ, "PET_MAX_RESTARTS")
            reading["max_restarts"] = Fact(n, f"PET_MAX_RESTARTS={n}")
        return reading
