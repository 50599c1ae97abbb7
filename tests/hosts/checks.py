"""Assertions shared by the two-host tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import describe


def check_trained(out: Path, results, hosts) -> list[dict]:
    """4 ranks, 2 per host on its own hostname and node rank, equal parameters; the facts."""
    assert results and all(r.returncode == 0 for r in results), describe(results)
    facts = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert sorted(int(f["RANK"]) for f in facts) == [0, 1, 2, 3], describe(results)
    assert {f["WORLD_SIZE"] for f in facts} == {"4"}
    by_host: dict[str, set[int]] = {}
    for f in facts:
        by_host.setdefault(f["host"], set()).add(int(f["RANK"]))
        assert f["NODE_RANK"] == f["GROUP_RANK"] and int(f["RANK"]) == int(f["NODE_RANK"]) * 2 + int(f["LOCAL_RANK"])
    assert set(by_host) == {h.name for h in hosts}
    node_ranks = {h: {f["NODE_RANK"] for f in facts if f["host"] == h} for h in by_host}
    assert all(len(v) == 1 for v in node_ranks.values()) and len({next(iter(v)) for v in node_ranks.values()}) == 2
    for f in facts:  # gloo used the link between the hosts, not loopback
        assert f["GLOO_SOCKET_IFNAME"] == "eth0", f
    ref = torch.load(out / "params-0.pt", weights_only=True)
    for rank in (1, 2, 3):
        other = torch.load(out / f"params-{rank}.pt", weights_only=True)
        assert all(torch.equal(ref[k], other[k]) for k in ref), f"rank {rank} params differ from rank 0"
    return facts


def reaches_algo1(addr: str, hosts) -> bool:
    """``addr`` (a worker's MASTER_ADDR on algo-2) names algo-1, the store's host, by its name or its
    address. Not just "not loopback": "algo-2" resolves to 127.0.0.1 on algo-2 itself."""
    return addr in (hosts[0].name, hosts[0].addr)
