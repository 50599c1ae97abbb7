"""Never hang silently: a missing node, a stalled rank, mismatched nodes, a second job."""

import re

import pytest

from tests.helpers import EXAMPLE, Watched, ddprun_nodes, describe, free_port, run_agents

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(60)
def test_missing_node_is_reported_while_waiting_and_named_at_the_join_timeout(tmp_path):
    cmd = ddprun_nodes(2, 1, [EXAMPLE], rdzv_id="tmiss", extra=["--join-timeout", "8"])[0]
    with Watched(cmd, cwd=tmp_path) as node:
        rc, ended = node.finish(timeout=40)
    output = node.output
    assert rc == 1, output
    # the join timeout counts from the rendezvous, which starts right after this line (not the imports before)
    (joining,) = [t for t, line in node.lines if line.startswith("ddprun: run tmiss:")]
    assert ended - joining < 8 + 3, (joining, ended, output)
    assert "1/2 nodes joined" in output and "waiting up to 8 s" in output
    assert "not every node joined within 8 s" in output and "1 missing" in output and "HINT" in output


@pytest.mark.timeout(90)
def test_stalled_rank_is_named_with_every_rank_stack(tmp_path):
    stall = 5
    results = run_agents(ddprun_nodes(2, 2, [EXAMPLE, "--steps", "400", "--hang-rank", "3"], rdzv_id="tstall",
                                      extra=["--stall-timeout", str(stall)]), timeout=75, cwd=tmp_path)
    assert all(r.returncode not in (0, None) for r in results), describe(results)
    both = "\n".join(r.output for r in results)
    assert "rank 3 (" in both and "while ranks 0-2 are in backward" in both, describe(results)
    report = (tmp_path / "runs" / "tstall" / "stacks" / "hang-report.txt").read_text()
    assert report.startswith("ddprun hang report: no rank advanced for")
    stacks = tmp_path / "runs" / "tstall" / "stacks"
    assert sorted(p.name for p in stacks.glob("rank-*.txt")) == [f"rank-{r}.txt" for r in range(4)]
    assert "torchrun_style.py" in (stacks / "rank-3.txt").read_text()
    # every node names it
    assert all("stall: no rank advanced" in r.output for r in results), describe(results)


@pytest.mark.timeout(60)
def test_nodes_with_different_process_counts_are_stopped_before_user_code(tmp_path):
    port = free_port()
    out = tmp_path / "out"
    cmds = [c for n in (2, 1) for c in ddprun_nodes(1, n, [EXAMPLE, "--out", str(out)], rdzv_id="tmis", port=port)]
    for c in cmds:
        c[c.index("--nnodes") + 1] = "2"
    results = run_agents(cmds, timeout=50, cwd=tmp_path)
    assert [r.returncode for r in results] == [1, 1], describe(results)
    both = "\n".join(r.output for r in results)
    assert "nodes run different numbers of processes" in both and "WORLD_SIZE became 3" in both
    assert all("different numbers of processes" in r.output for r in results), describe(results)
    assert not out.exists(), "user code ran despite the preflight error"


@pytest.mark.timeout(90)
def test_second_job_on_the_same_endpoint_is_refused_and_the_first_unharmed(tmp_path):
    port = free_port()
    first = ddprun_nodes(2, 1, [EXAMPLE, "--steps", "10"], rdzv_id="jobA", port=port)
    with Watched(first[0], cwd=tmp_path) as node_a:
        # admitted: jobA holds the endpoint's claim
        assert node_a.wait_for_line("ddprun: run jobA:", timeout=30) is not None, node_a.output
        (b,) = run_agents(ddprun_nodes(2, 1, [EXAMPLE], rdzv_id="jobB", port=port)[:1], timeout=30, cwd=tmp_path)
        # refused, not timed out: the join timeout is 120 s (the time to refuse: benchmarks/detection.py)
        assert b.returncode == 1 and b.wall_s < 20, describe([b])
        assert "refused" in b.output and "run id 'jobA'; this one is 'jobB'" in b.output
        (a2,) = run_agents(first[1:], timeout=45, cwd=tmp_path)
        assert a2.returncode == 0, describe([a2])
        assert node_a.finish(timeout=30)[0] == 0, node_a.output
        # the refused job left nothing: no run directory of its own, no trace in the first job's
        files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
        assert [f for f in files if not f.startswith("runs/jobA/")] == [], files
        assert {"runs/jobA/logs/rank-0.log", "runs/jobA/logs/rank-1.log", "runs/jobA/plan.json"} <= set(files)
        # report.html embeds its plots as base64, where any 4 letters turn up by chance (about 1 report in 120)
        assert not [f for f in files if "jobB" in re.sub(r"base64,[A-Za-z0-9+/=]+", "base64,",
                                                           (tmp_path / f).read_text(errors="replace"))], files
