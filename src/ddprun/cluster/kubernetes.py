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
PET_RDZV_BACKEND, else static when the node rank is known. The run id is PET_RDZV_ID, else the job's
name, which every pod shares also when the operator recreates them (``_run_id``): a job without an
elastic policy has no PET_RDZV_ID, and a run id made at launch would start a restarted job over.
Detected on PET_NNODES, or KUBERNETES_SERVICE_HOST with MASTER_ADDR and RANK or PET_NODE_RANK; RANK
without LOCAL_RANK is not a torchrun worker, so the torchrun environment does not claim it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddprun.cluster._values import env_int, env_port, env_value, split_endpoint
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


_KUBEFLOW_HOSTS = (
    (re.compile(r"^(?P<job>.+)-node-0-0\.(?P=job)$"), "trainjob"),  # TrainJob (v2): <job>-node-0-0.<job>
    (re.compile(r"^(?P<job>.+)-(?:master|worker)-0$"), "pytorchjob"),  # PyTorchJob: <job>-master-0, elastic -worker-0
)


def _run_id(environ: Mapping[str, str], master: Fact | None) -> Fact | None:
    """The run id every pod of the job shares, also after the operator recreates them (a restart, a
    preemption), so ``runs/<run id>`` and ``ddprun.fit(resume="auto")`` find the run again: PET_RDZV_ID,
    else the job's name from the rendezvous host, a DNS name the operator derives from it
    (``pytorchjob-<job>`` from ``<job>-master-0``, ``trainjob-<job>`` from ``<job>-node-0-0.<job>``,
    else ``k8s-<host>``). An IP address or loopback names no job (a pod's IP changes when it is
    recreated): the run id is then the launch's own, as outside Kubernetes."""
    import ipaddress

    from ddprun.cluster.netaddr import is_loopback

    if "PET_RDZV_ID" in environ:
        return Fact(environ["PET_RDZV_ID"], f"PET_RDZV_ID={environ['PET_RDZV_ID']}")
    if master is None or not isinstance(master.value, str) or is_loopback(master.value):
        return None
    host = master.value.strip().lower().rstrip(".")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return None
    except ValueError:
        pass
    for pattern, kind in _KUBEFLOW_HOSTS:
        m = pattern.match(host)
        if m:
            return Fact(f"{kind}-{m['job']}", f"the {kind}'s name {m['job']!r}, from {master.source}")
    return Fact(f"k8s-{host}", f"the rendezvous host {host!r}, from {master.source}")


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
            addr = env_value(environ, addr_key)  # blank: as unset
            if addr is not None and "master_addr" not in reading:
                reading["master_addr"] = _master(addr, addr_key, hi, node)
            if env_value(environ, port_key) is not None and "master_port" not in reading:
                reading["master_port"] = Fact(env_port(environ, port_key), f"{port_key}={environ[port_key]}")

        if "PET_RDZV_BACKEND" in environ:
            backend = environ["PET_RDZV_BACKEND"]
            reading["rdzv_backend"] = Fact(backend, f"PET_RDZV_BACKEND={backend}")
        elif "node_rank" in reading:
            reading["rdzv_backend"] = Fact("static", f"node rank known from {reading['node_rank'].source}")
        run_id = _run_id(environ, reading.get("master_addr"))
        if run_id is not None:
            reading["run_id"] = run_id
        if "PET_MAX_RESTARTS" in environ:  # the job's elasticPolicy.maxRestarts; --max-restarts wins
            n = env_int(environ, "PET_MAX_RESTARTS")
            reading["max_restarts"] = Fact(n, f"PET_MAX_RESTARTS={n}")
        return reading
