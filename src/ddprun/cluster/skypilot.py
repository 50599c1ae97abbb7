"""SkyPilot: a task's ``run:`` section runs once on every node of the cluster; make it ``ddprun run train.py``.

SkyPilot exports to every node (docs: "Distributed Multi-Node Jobs", "SkyPilot environment variables"):

* SKYPILOT_NODE_IPS: the IP of every node, one per line, the head node first;
* SKYPILOT_NODE_RANK: this node's index in that list (0 = head);
* SKYPILOT_NUM_NODES: the number of nodes (newer SkyPilot; else the lines are counted);
* SKYPILOT_NUM_GPUS_PER_NODE: the GPUs of the task's ``accelerators`` per node (0 on CPU nodes);
* SKYPILOT_TASK_ID: e.g. ``sky-2023-07-06-21-18-31-563597_myclus_1``, the same on every node and,
  for managed jobs, across recoveries: it becomes the run id, so a recovered job resumes its run.

Detected when SKYPILOT_NODE_IPS and SKYPILOT_NODE_RANK are present. nodes = the IPs, node rank =
SKYPILOT_NODE_RANK, rendezvous static at the first IP on MASTER_PORT, else 29500, processes per node
= SKYPILOT_NUM_GPUS_PER_NODE when above 0, else ddprun's default.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddprun.cluster._values import DEFAULT_PORT, count, env_int, env_port, env_value
from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading
from ddprun.errors import ClusterError


def node_ips(environ: Mapping[str, str]) -> list[str]:
    """SKYPILOT_NODE_IPS as a list (one address per line; blank lines and spaces ignored)."""
    raw = environ["SKYPILOT_NODE_IPS"]
    ips = raw.split()
    if not ips:
        raise ClusterError("SKYPILOT_NODE_IPS names no node.", seen=f"SKYPILOT_NODE_IPS={raw!r}",
                           hint="Run ddprun in the task's run: section, where SkyPilot sets it; do not set it by hand.")
    if len(set(ips)) != len(ips):
        raise ClusterError("SKYPILOT_NODE_IPS names a node twice.", seen=f"SKYPILOT_NODE_IPS={raw!r}",
                           hint="Each node must appear once; do not set SKYPILOT_NODE_IPS by hand.")
    return ips


class SkyPilotEnvironment(ClusterEnvironment):
    name = "skypilot"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "SKYPILOT_NODE_IPS" in environ and "SKYPILOT_NODE_RANK" in environ

    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        ips = node_ips(environ)
        shown = ",".join(ips)
        nnodes = Fact(len(ips), f"SKYPILOT_NODE_IPS ({count(len(ips), 'node')}: {shown})")
        if "SKYPILOT_NUM_NODES" in environ:
            n = env_int(environ, "SKYPILOT_NUM_NODES", minimum=1)
            if n != len(ips):
                raise ClusterError("SKYPILOT_NUM_NODES and SKYPILOT_NODE_IPS disagree on the number of nodes.",
                                   seen=f"SKYPILOT_NUM_NODES={n}, SKYPILOT_NODE_IPS={shown} ({len(ips)})",
                                   hint="Do not set SKYPILOT_* by hand; relaunch the task (sky launch).")
            nnodes = Fact(n, f"SKYPILOT_NUM_NODES={n}")
        rank = env_int(environ, "SKYPILOT_NODE_RANK")
        if rank >= len(ips):
            raise ClusterError("SKYPILOT_NODE_RANK is outside the task's nodes.",
                               seen=f"SKYPILOT_NODE_RANK={rank}, {nnodes.source}",
                               hint="Do not set SKYPILOT_* by hand; relaunch the task (sky launch).")
        reading: Reading = {
            "min_nodes": nnodes,
            "max_nodes": nnodes,
            "node_rank": Fact(rank, f"SKYPILOT_NODE_RANK={rank}"),
            "master_addr": Fact(ips[0], "first of SKYPILOT_NODE_IPS (the head node)"),
            "rdzv_backend": Fact("static", "node ranks known from SKYPILOT_NODE_RANK"),
        }
        if env_value(environ, "MASTER_PORT") is not None:
            reading["master_port"] = Fact(env_port(environ), f"MASTER_PORT={environ['MASTER_PORT']}")
        else:
            reading["master_port"] = Fact(DEFAULT_PORT, f"default ({DEFAULT_PORT}, as torchrun); MASTER_PORT unset")
        if "SKYPILOT_NUM_GPUS_PER_NODE" in environ:
            gpus = env_int(environ, "SKYPILOT_NUM_GPUS_PER_NODE")
            if gpus > 0:
                reading["nproc_per_node"] = Fact(gpus, f"SKYPILOT_NUM_GPUS_PER_NODE={gpus}")
        task = environ.get("SKYPILOT_TASK_ID", "").strip()
        if task:
            reading["run_id"] = Fact(task, f"SKYPILOT_TASK_ID={task}")
        return reading
