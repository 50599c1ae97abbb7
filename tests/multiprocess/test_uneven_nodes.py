"""--allow-uneven-nodes: 2 nodes x (2, 1) processes train together; ranks follow torch's agent, the
rank table and plan.json show the counts, and fit's sampler and metrics cover every sample once."""

import json
from pathlib import Path

import pytest

from tests.helpers import ddprun_nodes, describe, free_port, run_agents

pytestmark = pytest.mark.multiprocess
SCRIPT = str(Path(__file__).parent / "scripts" / "uneven_fit.py")


@pytest.mark.timeout(120)
def test_two_nodes_of_two_and_one_process_train_as_three_ranks(tmp_path):
    port, out = free_port(), tmp_path / "out"
    cmds = [c for n in (2, 1) for c in ddprun_nodes(1, n, [SCRIPT, "--out", str(out)], rdzv_id="tuneven", port=port,
                                                     extra=["--allow-uneven-nodes"])]
    for c in cmds:
        c[c.index("--nnodes") + 1] = "2"
    results = run_agents(cmds, timeout=100, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank-*.json")), key=lambda f: f["rank"])
    assert [f["rank"] for f in ranks] == [0, 1, 2] and {f["world_size"] for f in ranks} == {3}
    # torch's agent: a node's ranks follow every lower node's; the node with 2 processes may join first or second
    by_node = {}
    for f in ranks:
        by_node.setdefault(f["node_rank"], []).append((f["rank"], f["local_rank"], f["local_world_size"]))
        assert f["env"]["GROUP_RANK"] == str(f["node_rank"]) and f["env"]["RANK"] == str(f["rank"])
    assert sorted(len(v) for v in by_node.values()) == [1, 2]
    first = by_node[0]
    assert [r for r, _, _ in first] == list(range(len(first))) and by_node[1][0][0] == len(first)
    assert all(lws == len(by_node[n]) for n, v in by_node.items() for _, _, lws in v)
    # the sampler: one epoch, every training sample exactly once over the three ranks
    seen = [i for f in ranks for i in f["train_seen"]]
    assert sorted(seen) == list(range(96)) and {len(f["train_seen"]) for f in ranks} == {32}
    # the metric: the mean of x over all 30 validation samples, on every rank
    assert {round(f["val_x"], 6) for f in ranks} == {14.5}
    plan = json.loads((tmp_path / "runs" / "tuneven" / "plan.json").read_text())
    assert plan["uneven"] is True and plan["world_size"] == 3
    assert sorted(plan["nproc_per_node"].values()) == [1, 2]
    both = "\n".join(r.output for r in results)
    assert "ddprun: 3/3 ranks on 2 node(s) (uneven: node 0 runs" in both, describe(results)


@pytest.mark.timeout(60)
def test_without_the_flag_the_refusal_names_it(tmp_path):
    port = free_port()
    cmds = [c for n in (2, 1) for c in ddprun_nodes(1, n, [SCRIPT, "--out", str(tmp_path / "out")], rdzv_id="tno",
                                                     port=port)]
    for c in cmds:
        c[c.index("--nnodes") + 1] = "2"
    results = run_agents(cmds, timeout=50, cwd=tmp_path)
    assert [r.returncode for r in results] == [1, 1], describe(results)
    assert all("nodes run different numbers of processes" in r.output for r in results), describe(results)
    # the preflight error, printed where rank 0 ran, carries the HINT
    assert any("HINT: give every node the same --nproc-per-node (or leave it out to use every GPU), or, if the "
               "nodes really have different GPU counts, pass --allow-uneven-nodes on every node." in r.output
               for r in results), describe(results)
    assert not (tmp_path / "out").exists()
