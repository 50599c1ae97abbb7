"""``ddprun plan --json``: the plan as one JSON document for scripts (schema: docs/plan-json.md).

It carries everything ``plan --explain`` prints, as data: the environment, every resolved value with
its source, the rendezvous (endpoint, backend, run id), the device kind, the network decision, notes
and warnings, and the rank table. Pure: the network decision is passed in (cli.py probes it).
"""

from __future__ import annotations

from typing import Any

from ddprun.cluster.base import ClusterSpec
from ddprun.cluster.detect import UNRESOLVED
from ddprun.cluster.netaddr import NetworkPlan
from ddprun.cluster.plan import RankPlan

SCHEMA = "ddprun.plan/1"
"""Bumped when a key changes meaning or goes away; new keys do not bump it."""


def unresolved_reason(spec: ClusterSpec) -> str | None:
    """Why the rendezvous host is unknown (with the HINT ``ddprun run`` would give), or None."""
    if spec.master_addr is not None:
        return None
    return spec.sources.get("master_addr", "").removeprefix(UNRESOLVED) or "no rendezvous host"


def _value(spec: ClusterSpec, key: str) -> Any:
    return spec.extra[key] if key in spec.extra else getattr(spec, key, None)


def values(spec: ClusterSpec) -> dict[str, dict[str, Any]]:
    """Every fact resolve() kept: ``{key: {"value": ..., "source": ...}}``, in resolution order."""
    return {key: {"value": _value(spec, key), "source": src} for key, src in spec.sources.items()}


def rendezvous(spec: ClusterSpec) -> dict[str, Any]:
    """Where and how the nodes meet."""
    reason = unresolved_reason(spec)
    return {
        "endpoint": spec.rdzv_endpoint,
        "host": spec.master_addr,
        "port": spec.master_port or None,  # 0 = a free port picked at launch
        "resolved": reason is None,
        "unresolved_reason": reason,
        "backend": spec.rdzv_backend,
        "node_ranks": "fixed" if spec.node_rank is not None else "arrival order (c10d)",
        "elastic": spec.elastic,
    }


def network(net: NetworkPlan | None, error: str | None, spec: ClusterSpec) -> dict[str, Any]:
    """The network decision (netaddr.plan_network), or why there is none."""
    if net is None:
        reason = ("the rendezvous host is unresolved" if spec.master_addr is None else "not probed")
        return {"decided": False, "reason": error or reason, "error": error}
    decided = "network" not in net.sources
    return {
        "decided": decided,
        "reason": None if decided else net.sources["network"],
        "error": None,
        "is_host": net.is_host,
        "local_addr": net.local_addr,
        "ifname": net.ifname,
        "sources": {k: v for k, v in net.sources.items() if k != "network"},
        "worker_env": dict(net.worker_env),
    }


def warnings(spec: ClusterSpec, net_error: str | None) -> list[str]:
    """What would make ``ddprun run`` on this node stop, as one line each (empty when nothing would)."""
    out = []
    reason = unresolved_reason(spec)
    if reason:
        out.append(f"rendezvous endpoint unresolved: {reason}")
    if net_error:
        out.append(f"network: `ddprun run` on this node would fail: {net_error}")
    return out


def plan_document(spec: ClusterSpec, plan: RankPlan, net: NetworkPlan | None = None,
                  net_error: str | None = None) -> dict[str, Any]:
    """The ``plan --json`` document; ``net_error``: the network check's error, one line."""
    return {
        "schema": SCHEMA,
        "environment": spec.environment,
        "nnodes": plan.nnodes,
        "min_nodes": spec.min_nodes,
        "max_nodes": spec.max_nodes,
        "nproc_per_node": plan.nproc_per_node,
        "world_size": plan.world_size,
        "node_rank": spec.node_rank,
        "device": spec.device,
        "run_id": spec.run_id or None,  # "" = generated at launch
        "rendezvous": rendezvous(spec),
        "network": network(net, net_error, spec),
        "values": values(spec),
        "sources": dict(spec.sources),
        "notes": list(spec.notes),
        "warnings": warnings(spec, net_error),
        "ranks": plan.to_json()["ranks"],
    }
