"""Elastic restarts resume from the last checkpoint: a SIGKILLed or raising worker is restarted by
torch's agent (--max-restarts) and ddprun.fit continues bit for bit; a lost node under --nnodes 1:2
leaves the job running on the other.

The uninterrupted reference for 2 nodes x 2 is one node x 4: the same four gloo ranks on loopback
(measured bit-identical to 2 x 2). fit_restart.py's model has dropout with a different RNG seed
per rank, so restoring the wrong rank's RNG state, or none, would show.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from tests.faults.conftest import assert_nothing_left
from tests.helpers import DDPRUN, ddprun_nodes, describe, free_port, run_agents

pytestmark = pytest.mark.multiprocess

SCRIPT = str(Path(__file__).parent / "scripts" / "fit_restart.py")
STEPS = 14  # 96 samples, batch 4 per rank: 6 steps per epoch on 4 ranks, 12 on 2


def params(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"params-{rank}.pt", weights_only=True)


def facts(out: Path, rank: int) -> dict:
    return json.loads((out / f"facts-{rank}.json").read_text())


def reference(tmp_path: Path, nproc: int) -> dict[str, torch.Tensor]:
    out = tmp_path / "ref"
    r = run_agents([[DDPRUN, "run", "--nproc-per-node", str(nproc), "--log-dir", str(tmp_path / "runs"), SCRIPT,
                     "--out", str(out), "--steps", str(STEPS)]], timeout=90, cwd=tmp_path)
    assert r[0].returncode == 0, describe(r)
    return params(out, 0)


def assert_bitwise(ref: dict, out: Path, world: int) -> None:
    for rank in range(world):
        got = params(out, rank)
        assert all(torch.equal(ref[k], got[k]) for k in ref), f"rank {rank}: not the uninterrupted run's parameters"


@pytest.mark.timeout(300)
def test_a_sigkilled_worker_is_restarted_and_fit_resumes_bitwise(tmp_path):
    ref = reference(tmp_path, 4)
    out = tmp_path / "out"
    cmds = ddprun_nodes(2, 2, [SCRIPT, "--out", str(out), "--steps", str(STEPS), "--checkpoint-every", "3",
                               "--kill-rank", "3", "--kill-step", "7", "--marker", str(tmp_path / "killed")],
                        rdzv_id="rs2x2", extra=["--max-restarts", "1", "--log-dir", str(tmp_path / "runs")])
    results = run_agents(cmds, timeout=180, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert (tmp_path / "killed").exists()
    both = "\n".join(r.output for r in results)
    for r in results:  # each agent names the killed rank (on node 1) before restarting its workers
        assert "ddprun: rank 3 (node 1, " in r.output and "restarting the workers (restart 1 of 1)" in r.output, \
            describe(results)
    ckdir = tmp_path / "runs" / "rs2x2" / "checkpoints"
    assert f"ddprun: resuming from {ckdir / 'step-00000006.pt'}: step 6" in both, describe(results)
    got = [facts(out, r) for r in range(4)]
    assert {(f["world_size"], f["steps"]) for f in got} == {(4, STEPS)}
    # torchrun's variable, in every worker: the killed rank's node counted its restart (the other node's
    # agent restarts for the new round without counting one, as torch's does)
    assert max(int(f["restart_count"]) for f in got) == 1 and {int(f["restart_count"]) for f in got} <= {0, 1}, got
    # one attempt id on every node (the rendezvous round), whatever each agent's restart count says
    assert len({f["attempt"] for f in got}) == 1 and got[0]["attempt"] != "r0", got
    named = re.findall(r"^ddprun: rank 3 \(node 1, .*\(its log: (\S+) on ", both, re.M)
    assert named and named[0].startswith("logs/rank-3.attempt-r"), describe(results)
    assert (tmp_path / "runs" / "rs2x2" / named[0]).exists(), describe(results)  # the name the line printed
    assert_bitwise(ref, out, 4)
    assert_nothing_left(tmp_path)  # the killed attempt's workers and both agents


@pytest.mark.timeout(240)
def test_a_raising_worker_is_restarted_and_fit_resumes_bitwise(tmp_path):
    ref = reference(tmp_path, 2)
    out = tmp_path / "out"
    r = run_agents([[DDPRUN, "run", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", "rs1x2",
                     "--log-dir", str(tmp_path / "runs"), SCRIPT, "--out", str(out), "--steps", str(STEPS),
                     "--checkpoint-every", "4", "--raise-rank", "1", "--raise-step", "10",
                     "--marker", str(tmp_path / "raised")]], timeout=150, cwd=tmp_path)
    assert r[0].returncode == 0, describe(r)
    # the agent names the failure before every restart (a stopped rank's own line may lose the race)
    assert ("ddprun: rank 1 (node 0, " in r[0].output and "failed: RuntimeError: injected failure on rank 1"
            in r[0].output and "; restarting the workers (restart 1 of 1)" in r[0].output), describe(r)
    assert "resuming from" in r[0].output and "step-00000008.pt: step 8" in r[0].output, describe(r)
    assert_bitwise(ref, out, 2)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(240)
def test_a_lost_node_under_elastic_nnodes_leaves_the_job_running_on_the_other(tmp_path):
    """--nnodes 1:2, the node that does not host the rendezvous loses its agent and workers (SIGKILL)
    at step 5: the other restarts its workers alone and finishes from the step-4 checkpoint on 2
    ranks (the global batch halves; the learning rate stays)."""
    out, port = tmp_path / "out", free_port()

    lost_marker = str(tmp_path / "lost")

    def node(is_host: bool, *more: str) -> list[str]:
        conf = f"is_host={str(is_host).lower()},last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"
        # a first round that formed before the other node arrived (a slow start) waits for it, not trains alone
        return [DDPRUN, "run", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "rsel", "--rdzv-conf", conf, "--max-restarts", "2", "--log-dir", str(tmp_path / "runs"),
                SCRIPT, "--out", str(out), "--steps", str(STEPS), "--checkpoint-every", "4", "--wait-world", "4",
                "--wait-unless", lost_marker, *more]

    results = run_agents([node(True), node(False, "--kill-node-step", "5", "--marker", lost_marker)],
                         timeout=200, cwd=tmp_path)
    host, lost = results
    assert (tmp_path / "lost").exists(), describe(results)
    assert lost.returncode not in (0, None), describe(results)  # SIGKILLed with its workers
    assert host.returncode == 0, describe(results)
    got = [facts(out, r) for r in range(2)]
    assert {(f["world_size"], f["steps"]) for f in got} == {(2, STEPS)}
    assert not (out / "facts-2.json").exists()
    assert "the checkpoint was written with another world size 4 -> 2" in host.output, describe(results)
    assert all(torch.equal(params(out, 0)[k], params(out, 1)[k]) for k in params(out, 0))
    assert_nothing_left(tmp_path)  # the lost node's workers died with its agent


@pytest.mark.timeout(240)
def test_checkpoints_not_shared_between_nodes_are_written_on_each_and_sent_where_missing(tmp_path):
    """Each node its own run dir (so its own checkpoint directory): said once by rank 0; both
    nodes write every checkpoint; the killed rank's node loses its copies before the restart, and
    the restarted job resumes from the other node's copy, sent over the process group, bit for bit."""
    ref = reference(tmp_path, 2)
    out, port = tmp_path / "out", free_port()
    cmds = [[DDPRUN, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "rsapart", "--max-restarts", "1", "--log-dir", str(tmp_path / f"node{i}"), SCRIPT,
             "--out", str(out), "--steps", str(STEPS), "--checkpoint-every", "4", "--kill-rank", "1",
             "--kill-step", "6", "--wipe-before-kill", "--marker", str(tmp_path / "killed")] for i in range(2)]
    results = run_agents(cmds, timeout=180, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    both = "\n".join(r.output for r in results)
    assert both.count("is not shared with node(s)") == 2, describe(results)  # once per attempt, by rank 0
    assert "step 4" in both and "resuming from" in both, describe(results)
    for i in range(2):  # after the restart every node has every later checkpoint again
        names = sorted(p.name for p in (tmp_path / f"node{i}" / "rsapart" / "checkpoints").glob("step-*.pt"))
        assert names[-1] == f"step-{STEPS:08d}.pt", names
    assert_bitwise(ref, out, 2)
