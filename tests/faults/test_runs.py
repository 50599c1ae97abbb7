"""One run per launch, and one job per endpoint (agent/admission.py): a relaunch, two jobs in one
directory, a third node at a full job, a stranger at an elastic job, two launches racing for one job,
nodes started with different --nnodes."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.faults.conftest import assert_nothing_left, describe
from tests.helpers import job_env, store_client

pytestmark = pytest.mark.faults

FIT = str(Path(__file__).parents[1] / "multiprocess" / "scripts" / "fit_restart.py")
RUN_ID = re.compile(r"^ddprun: run (\S+): ", re.M)


def facts(out: Path, rank: int) -> dict:
    return json.loads((out / f"facts-{rank}.json").read_text())


def run_ids(ended) -> set[str]:
    return {m for e in ended for m in RUN_ID.findall(e.output)}


def fit_nodes(nodes, tmp_path: Path, out: str, *, rdzv_id: str | None = None, name: str = "node", **kw):
    return nodes(2, 1, ["--out", str(tmp_path / out), "--steps", "6", "--checkpoint-every", "3"],
                 script=FIT, rdzv_id=rdzv_id, name=name, **kw)


@pytest.mark.timeout(150)
def test_a_relaunch_of_the_same_command_is_a_new_run_that_trains(nodes, tmp_path):
    first = fit_nodes(nodes, tmp_path, "a", name="a").finish(timeout=60)
    assert [e.returncode for e in first] == [0, 0], describe(first)
    second = fit_nodes(nodes, tmp_path, "b", name="b").finish(timeout=60)
    assert [e.returncode for e in second] == [0, 0], describe(second)
    (id1,), (id2,) = run_ids(first), run_ids(second)  # every node of a launch names the same run
    assert id1 != id2, describe(first + second)
    assert "resuming from" not in "".join(e.output for e in second), describe(second)
    for out, run_id in (("a", id1), ("b", id2)):
        got = [facts(tmp_path / out, r) for r in range(2)]
        assert {(f["steps"], f["training_step_calls"]) for f in got} == {(6, 6)}, got  # trained, not 0 steps
        assert {Path(f["run_dir"]).name for f in got} == {run_id}
        assert (tmp_path / "runs" / run_id / "checkpoints" / "step-00000006.pt").exists()
        assert (tmp_path / "runs" / run_id / "logs" / "rank-1.log").exists()
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(120)
def test_two_jobs_with_the_defaults_in_one_directory_keep_their_runs_apart(nodes, tmp_path):
    a, b = fit_nodes(nodes, tmp_path, "a", name="a"), fit_nodes(nodes, tmp_path, "b", name="b")
    ended_a, ended_b = a.finish(timeout=90), b.finish(timeout=60)
    assert [e.returncode for e in ended_a + ended_b] == [0] * 4, describe(ended_a + ended_b)
    (id_a,), (id_b,) = run_ids(ended_a), run_ids(ended_b)
    assert id_a != id_b
    for out, run_id in (("a", id_a), ("b", id_b)):
        got = [facts(tmp_path / out, r) for r in range(2)]
        assert {(f["training_step_calls"], Path(f["run_dir"]).name) for f in got} == {(6, run_id)}, got
    assert "resuming from" not in "".join(e.output for e in ended_a + ended_b)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(150)
def test_a_finished_run_relaunched_by_its_id_says_so_and_keeps_its_logs(nodes, tmp_path):
    first = fit_nodes(nodes, tmp_path, "a", rdzv_id="job1", name="a").finish(timeout=60)
    assert [e.returncode for e in first] == [0, 0], describe(first)
    log1 = (tmp_path / "runs" / "job1" / "logs" / "rank-1.log").read_text()
    t0 = time.monotonic()
    again = fit_nodes(nodes, tmp_path, "b", rdzv_id="job1", name="b").finish(timeout=60)
    assert [e.returncode for e in again] == [0, 0], describe(again)
    said = re.findall(r"^ddprun: run job1 finished at step 6 \(checkpoint of .*\); nothing to do\. Give a new "
                      r"--rdzv-id \(or run_dir\), or resume=False to train again\.$", again[0].output + again[1].output,
                      re.M)
    assert len(said) == 1, describe(again)  # rank 0 says it, once
    assert {facts(tmp_path / "b", r)["training_step_calls"] for r in range(2)} == {0}
    print(f"relaunch of a finished run: {time.monotonic() - t0:.1f} s to the end")
    earlier = list((tmp_path / "runs" / "job1" / "logs").glob("before-*/rank-1.log"))
    assert len(earlier) == 1 and earlier[0].read_text() == log1, "the first launch's log was not kept"
    assert_nothing_left(tmp_path)


def slow_job(nodes, until: Path, **kw):
    """A 2 x 1 job that trains (20 steps at least) until ``until`` exists: the test ends it once its
    newcomer has been seen, so the job is alive and training throughout."""
    return nodes(2, 1, ["--steps", "20", "--step-s", "0.05", "--until", str(until)], rdzv_id=None, **kw)


@pytest.mark.timeout(120)
def test_a_third_node_at_a_full_job_is_refused_within_seconds(nodes, tmp_path):
    job = slow_job(nodes, tmp_path / "enough")
    job.worker_pids(range(2))
    t0 = time.monotonic()
    (third,) = nodes(1, 1, [], rdzv_id=None, nnodes="2", port=job.port, name="third").finish(timeout=30)
    took = third.ended_at - t0
    (tmp_path / "enough").touch()
    assert third.returncode == 1, describe([third])
    (run_id,) = {m for m in RUN_ID.findall(Path(job.outs[0]).read_text())}
    msg = third.output
    assert f"Refused: the job at the rendezvous endpoint 127.0.0.1:{job.port} runs already, and it is full " \
           "(2 of 2 node(s))" in msg, msg
    assert re.search(rf"Seen: run {run_id}, 2 node\(s\): \S+ \(agent pid \d+\), \S+ \(agent pid \d+\); running since ",
                     msg), msg
    assert "Traceback" not in msg and "ddprun: run " not in msg, msg  # refused before it announced a run
    print(f"third node refused {took:.1f} s after it started (its Python and torch imports included)")
    assert took < 15, msg
    ended = job.finish(timeout=60)
    assert [e.returncode for e in ended] == [0, 0], describe(ended)  # the job is unharmed
    assert "restarting the workers" not in "".join(e.output for e in ended)
    assert_nothing_left(tmp_path)


ELASTIC = ["--rdzv-conf", "last_call_timeout=1"]


@pytest.mark.timeout(120)
def test_a_stranger_at_an_elastic_job_with_room_is_refused(nodes, tmp_path):
    job = slow_job(nodes, tmp_path / "enough", nnodes="1:3", extra=ELASTIC, env=job_env(DDPRUN_JOB_TOKEN="job-7"))
    job.worker_pids(range(2))
    restarts = sum(p.read_text().count("a node waits to join") for p in job.outs)  # a first round of one node
    (third,) = nodes(1, 1, [], rdzv_id=None, nnodes="1:3", extra=ELASTIC, port=job.port, name="third",
                     env=job_env(DDPRUN_JOB_TOKEN="other-job")).finish(timeout=30)
    time.sleep(1.5)  # past the job's last call (1 s): a stranger wrongly taken in would restart the workers now
    (tmp_path / "enough").touch()
    assert third.returncode == 1, describe([third])
    assert "is in use by another job with the same run id 'ddprun' but a different DDPRUN_JOB_TOKEN" in \
        third.output, third.output
    ended = job.finish(timeout=60)
    assert [e.returncode for e in ended] == [0, 0], describe(ended)
    assert "".join(e.output for e in ended).count("a node waits to join") == restarts, describe(ended)  # not for it
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(150)
def test_a_late_node_of_the_same_elastic_job_is_taken_in(nodes, tmp_path):
    # the job trains until the late node is in (its workers restart with WORLD_SIZE 3), however long it takes
    args = ["--steps", "60", "--step-s", "0.05", "--min-world", "3"]
    job = nodes(2, 1, args, rdzv_id=None, nnodes="1:3", extra=ELASTIC)
    job.worker_pids(range(2))
    late = nodes(1, 1, args, rdzv_id=None, nnodes="1:3", extra=ELASTIC, port=job.port, name="late")
    ended = job.finish(timeout=90) + late.finish(timeout=30)
    assert [e.returncode for e in ended] == [0, 0, 0], describe(ended)
    both = "".join(e.output for e in ended)
    # each running node says why its workers restart (more than once when the first round had one node)
    assert both.count("ddprun: a node waits to join; restarting the workers to take it in") >= 2, describe(ended)
    assert "ddprun: 3/3 ranks on 3 node(s)" in both, describe(ended)
    assert both.count("ddprun: note: this elastic job takes in any node started with the same command") == 3
    assert len(run_ids(ended)) == 1, describe(ended)  # the late node joined the same run
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(150)
def test_a_late_node_that_becomes_group_rank_0_of_the_new_round_is_taken_in(nodes, tmp_path):
    """torch ranks a round's nodes by (address, pid). A late node that sorts first (here: its agent
    started first, and reached the rendezvous last) is group rank 0 of the round that takes it in, and
    torch 2.13 makes it a new workers' store while the running node keeps the one it made in round 0:
    the two nodes' workers would wait on different stores, and the running node would name the late
    one lost (seen in the fault tier under load). Every node must train on the round's store."""
    args = ["--steps", "40", "--step-s", "0.05", "--min-world", "2"]
    gate = tmp_path / "go"
    late = nodes(1, 1, args, rdzv_id="sorted", nnodes="1:2", extra=ELASTIC, name="late", gate=gate)
    early = nodes(1, 1, args, rdzv_id="sorted", nnodes="1:2", extra=ELASTIC, port=late.port, name="early")
    assert late.procs[0].pid < early.procs[0].pid
    early.worker_pids(range(1))  # round 0: the early node alone
    gate.touch()
    ended = early.finish(timeout=90) + late.finish(timeout=30)
    assert [e.returncode for e in ended] == [0, 0], describe(ended)
    both = "".join(e.output for e in ended)
    assert "ddprun: a node waits to join; restarting the workers to take it in" in ended[0].output, describe(ended)
    assert "lost" not in both, describe(ended)
    # rank 0 prints the rank table on its node's console: the late node's, group rank 0 of the new round
    assert "ddprun: 2/2 ranks on 2 node(s)" in ended[1].output, describe(ended)
    assert "ddprun: 2/2 ranks" not in ended[0].output, describe(ended)
    env = [json.loads((tmp_path / "pids" / f"rank-{r}.env.json").read_text()) for r in (0, 1)]
    assert env[0]["GROUP_RANK"] == "0" and env[0]["WORLD_SIZE"] == "2", env[0]
    assert env[0]["MASTER_PORT"] == env[1]["MASTER_PORT"], [(e["RANK"], e["MASTER_PORT"]) for e in env]
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(120)
def test_of_three_launches_racing_for_a_two_node_job_the_one_left_out_says_so(nodes, tmp_path):
    # the job trains until the node left out has said so: it checks while the job is alive
    until = tmp_path / "said"
    job = nodes(3, 1, ["--steps", "20", "--step-s", "0.05", "--until", str(until)], rdzv_id=None, nnodes="2")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any("Refused" in o.read_text(errors="replace") for o in job.outs):
        time.sleep(0.2)
    until.touch()
    ended = job.finish(timeout=60)
    codes = sorted(e.returncode for e in ended)
    assert codes == [0, 0, 1], describe(ended)
    (out,) = [e for e in ended if e.returncode == 1]
    assert "Refused: the job at the rendezvous endpoint" in out.output and "it is full (2 of 2 node(s))" in \
        out.output, describe(ended)
    assert_nothing_left(tmp_path)


def wait_for_text(path: Path, text: str, timeout: float) -> float | None:
    """time.monotonic() when ``text`` was first seen in the file at ``path``; None after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return time.monotonic()
        time.sleep(0.1)
    return None


@pytest.mark.timeout(120)
def test_nodes_started_with_different_nnodes_name_the_mismatch_within_seconds(nodes, tmp_path):
    """torch completes a round by each joining node's own MIN:MAX: a --nnodes 2 node then a --nnodes 3
    node waited the whole join timeout, and the first said '2/2 nodes joined' naming no --nnodes."""
    two = nodes(1, 1, [], rdzv_id=None, nnodes="2", extra=["--join-timeout", "20"], name="two")
    assert wait_for_text(two.outs[0], "ddprun: run ", 60) is not None, two.describe()  # admitted: it set --nnodes 2
    t0 = time.monotonic()
    (three,) = nodes(1, 1, [], rdzv_id=None, nnodes="3", extra=["--join-timeout", "20"], port=two.port,
                     name="three").finish(timeout=40)
    said = wait_for_text(two.outs[0], "was refused: it was started with --nnodes 3", 10)
    (first,) = two.finish(timeout=40)
    assert three.returncode == 1, describe([first, three])
    assert f"Refused: this node was started with --nnodes 3, the job at the rendezvous endpoint 127.0.0.1:{two.port} " \
           "with --nnodes 2." in three.output and "the same --nnodes" in three.output, describe([three])
    assert "ddprun: run " not in three.output, describe([three])  # refused before it joined the rendezvous
    assert three.ended_at - t0 < 20, describe([three])  # its imports, then at once: not its join timeout
    assert said is not None and said - three.ended_at < 5, describe([first, three])  # the next progress line
    assert first.returncode == 1, describe([first])
    assert re.search(r"^ddprun: \S+ \(agent pid \d+\) was refused: it was started with --nnodes 3, this job's nodes "
                     r"with --nnodes 2 \(every node needs the same --nnodes\)$", first.output, re.M), describe([first])
    assert re.search(r"^ddprun: not every node joined within 20 s: 1/2 nodes joined \(.*\); 1 missing; \S+ \(agent "
                     r"pid \d+\) was refused: it was started with --nnodes 3", first.output, re.M), describe([first])
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(60)
def test_the_job_token_is_never_printed_nor_written_to_the_run_directory(nodes, tmp_path):
    secret = "s3cret-token-4242"
    (ended,) = nodes(1, 2, ["--steps", "5", "--step-s", "0"], env=job_env(DDPRUN_JOB_TOKEN=secret)).finish(timeout=40)
    assert ended.returncode == 0, describe([ended])
    assert secret not in ended.output
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert files and not [p for p in files if secret.encode() in p.read_bytes()]
    assert_nothing_left(tmp_path)


def new_workers(job, old: set[int], ranks: range, timeout: float) -> dict[int, int]:
    """rank -> pid once every rank's pid file (written at its first step) names a process not in ``old``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        texts = [(job.pids_dir / f"rank-{r}.pid").read_text() if (job.pids_dir / f"rank-{r}.pid").exists() else ""
                 for r in ranks]
        if all(t.strip().isdigit() for t in texts) and not {int(t) for t in texts} & old:
            return {r: int(t) for r, t in zip(ranks, texts)}
        time.sleep(0.1)
    raise AssertionError(f"the restarted workers did not all step within {timeout:.0f} s:\n" + job.describe())


@pytest.mark.timeout(150)
def test_a_node_restarted_after_its_agent_died_is_taken_back_by_a_job_with_restarts_left(nodes, tmp_path):
    """3 nodes; the one that hosts neither store (the endpoint's: losing it ends the job, tests/faults/
    test_exits.py; nor the workers' on group rank 0: below) loses its agent and comes back at once. The
    others' restart line names it (no record of its rank comes), not their own ranks' resets."""
    import signal

    until = tmp_path / "enough"  # the job trains until the three restarted ranks have stepped
    args, extra = ["--steps", "20", "--step-s", "0.05", "--until", str(until)], ["--max-restarts", "1"]
    job = nodes(3, 1, args, rdzv_id=None, extra=extra)
    pids = job.worker_pids(range(3))
    victim = ({0, 1, 2} - {job.store_host(), job.agent_of(pids[0])}).pop()
    lost = next(r for r, pid in pids.items() if job.agent_of(pid) == victim)  # its node rank: one rank a node
    job.signal(victim, signal.SIGKILL)  # its worker dies with it (PR_SET_PDEATHSIG)
    back = nodes(1, 1, args, rdzv_id=None, nnodes="3", extra=extra, port=job.port, name="back")
    new_workers(job, set(pids.values()), range(3), timeout=60)
    until.touch()
    ended = [e for e in job.finish(timeout=100) if e.node != victim] + back.finish(timeout=30)
    assert [e.returncode for e in ended] == [0, 0, 0], describe(ended)
    assert "Refused" not in ended[2].output, describe(ended)
    line = rf"^ddprun: node {lost} \(\S+\) was lost: its agent stopped answering; restarting the workers \(restart 1 of 1\)$"
    assert all(re.search(line, e.output, re.M) for e in ended[:2]), describe(ended)
    assert len(run_ids(ended)) == 1, describe(ended)  # the same run, agreed again
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(150)
def test_an_elastic_job_that_loses_the_workers_store_host_re_forms_past_the_lost_bound_and_trains_on(nodes, tmp_path):
    """3 nodes (--nnodes 2:3, a restart left) of a rendezvous whose store none of them hosts (the test's
    here; a rendezvous service on a cluster). Group rank 0's node, which hosts the workers' store, loses
    its agent (SIGKILL). The two others re-form under torch's default keep-alive (15 s, longer than the
    10 s after which a silent store is named lost) with a new workers' store, and train on. A failure
    thread's tick that was in a connect to the dead store when the new attempt began used to name the
    new store lost and stop the re-formed job's workers."""
    import signal

    from tests.helpers import free_port, store_server

    port = free_port()
    endpoint = store_server(port)  # the rendezvous' store, which no node hosts: held to the test's end
    until = tmp_path / "enough"
    args = ["--steps", "20", "--step-s", "0.05", "--until", str(until)]
    job = nodes(3, 1, args, rdzv_id=None, nnodes="2:3", port=port,
                extra=["--max-restarts", "1", "--rdzv-conf", "last_call_timeout=1"])
    pids = job.worker_pids(range(3))
    victim = job.agent_of(pids[0])
    killed_at = job.signal(victim, signal.SIGKILL)  # its worker dies with it (PR_SET_PDEATHSIG)
    new_workers(job, set(pids.values()), range(2), timeout=60)
    print(f"workers' store host killed -> the re-formed job stepped after {time.monotonic() - killed_at:.1f} s")
    until.touch()
    ended = job.finish(timeout=60)
    survivors = [e for e in ended if e.node != victim]
    assert ended[victim].returncode == -signal.SIGKILL, describe(ended)
    assert [e.returncode for e in survivors] == [0, 0], describe(ended)
    for e in survivors:  # the restart names the node that went (its ranks wrote no record), not a peer's reset
        assert re.search(r"^ddprun: the node hosting the job store was lost: the job store at \S+:\d+ stopped "
                         r"answering; restarting the workers \(restart 1 of 1\)$", e.output, re.M), describe(ended)
        assert "stopping this node's workers" not in e.output and "job failed" not in e.output, describe(ended)
    assert_nothing_left(tmp_path)
    del endpoint


def drop_from_rendezvous(port: int) -> int:
    """What torch's sanitizer does to a node whose keep-alive went stale (another node's view of a
    frozen agent): remove it from the round's participants; with none left, the next round. Returns
    the round the state moves to."""
    import base64
    import pickle

    store = store_client(port, 10.0)
    key = "torch.rendezvous.ddprun"
    raw = store.get(key)
    state = pickle.loads(base64.b64decode(raw))  # torch's own state: this test's process plays torch's part
    state.participants.clear()
    state.last_heartbeats.clear()
    state.complete, state.round = False, state.round + 1
    assert store.compare_set(key, raw, base64.b64encode(pickle.dumps(state))) != raw
    return state.round


@pytest.mark.timeout(120)
def test_a_node_the_rendezvous_dropped_says_so_and_joins_again_instead_of_training_outside_the_job(nodes, tmp_path):
    """torch's rendezvous drops a participant whose keep-alive went stale (its agent frozen or starved
    past keep_alive_interval x keep_alive_max_attempt); another node may then form a round without
    it, while its own workers train on: torch's agent never notices. Here the state is edited as the
    other node's sanitizer would; the dropped node says so, restarts its workers into a new round, and
    ends normally."""
    until = tmp_path / "enough"
    a = nodes(1, 1, ["--steps", "20", "--step-s", "0.05", "--until", str(until)], rdzv_id=None, nnodes="1:2",
              extra=["--rdzv-conf", "last_call_timeout=1"])
    a.worker_pids(range(1))
    new_round = drop_from_rendezvous(a.port)
    deadline = time.monotonic() + 30
    while a.outs[0].read_text().count("ddprun: 1/1 ranks on 1 node(s)") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    until.touch()
    (ended,) = a.finish(timeout=40)
    assert ended.returncode == 0, describe([ended])
    assert "ddprun: this node was dropped from the job's rendezvous: its agent missed torch's keep-alive for more " \
           "than keep_alive_interval 5 s x keep_alive_max_attempt 3" in ended.output, describe([ended])
    assert ended.output.count("ddprun: 1/1 ranks on 1 node(s)") == 2, describe([ended])  # in the new round
    log = next((tmp_path / "runs").glob("*/logs/agent-*.log")).read_text()
    assert f"has joined round {new_round} of the rendezvous" in log, log[-2000:]
    assert_nothing_left(tmp_path)
