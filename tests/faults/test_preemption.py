"""Preemption: a polite kill (SIGTERM, SIGUSR1, to one worker, one agent, or every process of a node)
stops every rank after one agreed optimizer step; ddprun.fit saves its checkpoint there, every node
exits 75 and says where, and the same command resumes bit for bit. A checkpoint longer than the
agent's SIGTERM-to-SIGKILL window (--stop-grace; torchrun: a fixed 30 s) completes within
--preempt-grace; a stop that outlasts the grace is forced; an unmodified loop gets its on_preempt
callback at the same step on every rank.

2 simulated nodes x 1 process on 127.0.0.1 (tests/faults/conftest.py). fit_restart.py's model has
dropout with a per-rank RNG seed, so a resume that restored the wrong state would not be bitwise.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.faults.conftest import Nodes, assert_nothing_left, describe
from tests.helpers import DDPRUN, extra, job_env, run_agents
from tests.helpers import describe as describe_runs

pytestmark = pytest.mark.faults

FIT = str(Path(__file__).parents[1] / "multiprocess" / "scripts" / "fit_restart.py")
LOOP = str(Path(__file__).parent / "scripts" / "preempt_loop.py")
STEPS = 60  # 96 samples, batch 4 on 2 ranks: 12 steps an epoch; the stop comes mid-epoch
SLOW = ["--steps", str(STEPS), "--step-sleep", "0.1", "--checkpoint-every", "1000"]  # <= 10 steps/s: a stop <= 31 ahead
STOPPED = re.compile(r"^ddprun: preempted by (SIG\w+) to [^:]+: every rank stopped after optimizer step (\d+) "
                     r"of this launch; checkpoint at step (\d+) saved in [\d.]+ s \((\S+)\); resume with the same "
                     r"command$", re.M)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's parameters (one node x 2 ranks: the same two gloo ranks)."""
    tmp = tmp_path_factory.mktemp("ref")
    r = run_agents([[DDPRUN, "run", "--nproc-per-node", "2", "--log-dir", str(tmp / "runs"), FIT, "--out",
                     str(tmp / "out"), "--steps", str(STEPS)]], timeout=120, cwd=tmp)
    assert r[0].returncode == 0, describe_runs(r)
    return torch.load(tmp / "out" / "params-0.pt", weights_only=True)


def preempted(tmp_path: Path, how: list[str], extra: list[str] | None = None, timeout: float = 90):
    """Run 2 x 1 with a signal sent from inside the job at step 5 (fit_restart.py --signal-*)."""
    job = Nodes(tmp_path, 2, 1, [*SLOW, "--out", str(tmp_path / "out"), "--signal-step", "5", *how,
                                 "--marker", str(tmp_path / "signalled")],
                extra=["--log-dir", str(tmp_path / "runs"), *(extra or [])], script=FIT)
    return job, job.finish(timeout=timeout)


def assert_one_stop(ended, tmp_path: Path, signame: str) -> int:
    """Every node exits 75 naming the same stop step and its checkpoint, which exists."""
    assert [e.returncode for e in ended] == [75, 75], describe(ended)
    stops = {STOPPED.search(e.output).groups() if STOPPED.search(e.output) else None for e in ended}
    assert len(stops) == 1 and None not in stops, describe(ended)
    (sig, step, fit_step, path), = stops
    assert sig == signame and step == fit_step and int(step) > 5, describe(ended)
    assert Path(path) == tmp_path / "runs" / "fault" / "checkpoints" / f"step-{int(step):08d}.pt" and Path(path).exists()
    assert "Traceback" not in "".join(e.output for e in ended), describe(ended)
    for rank in (0, 1):  # each rank's own log: it stopped after that very step
        log = (tmp_path / "runs" / "fault" / "logs" / f"rank-{rank}.log").read_text()
        assert f"ddprun: stopped for {signame} after optimizer step {step} of this launch (checkpoint" in log, log
    return int(step)


@pytest.mark.timeout(240)
def test_sigterm_to_one_worker_stops_every_rank_at_one_step_and_the_same_command_resumes_bitwise(tmp_path,
                                                                                             reference):
    job, ended = preempted(tmp_path, ["--signal-rank", "1", "--send-signal", "TERM", "--signal-to", "self"])
    sent = float((tmp_path / "signalled").read_text().split(" at ")[1])
    step = assert_one_stop(ended, tmp_path, "SIGTERM")
    print(f"SIGTERM to one worker -> stop after step {step}; last node exited "
          f"{max(e.ended_at for e in ended) - job_time(job, sent):.1f} s after the signal")
    assert_nothing_left(tmp_path)
    again = Nodes(tmp_path, 2, 1, [*SLOW, "--out", str(tmp_path / "out")],
                  extra=["--log-dir", str(tmp_path / "runs")], script=FIT, name="again").finish(timeout=90)
    assert [e.returncode for e in again] == [0, 0], describe(again)
    ckpt = tmp_path / "runs" / "fault" / "checkpoints" / f"step-{step:08d}.pt"
    assert f"ddprun: resuming from {ckpt}: step {step}" in "".join(e.output for e in again), describe(again)
    for rank in (0, 1):  # not one step redone or lost: the uninterrupted run's parameters, bit for bit
        got = torch.load(tmp_path / "out" / f"params-{rank}.pt", weights_only=True)
        assert all(torch.equal(reference[k], got[k]) for k in reference), f"rank {rank} differs from the reference"
    assert_nothing_left(tmp_path)


def job_time(job: Nodes, wall: float) -> float:
    """time.time() ``wall`` on the harness's monotonic clock."""
    return time.monotonic() - (time.time() - wall)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["USR1", "INT"], ids=["sigusr1", "ctrl-c"])
def test_a_signal_to_one_agent_stops_every_rank_at_one_step(tmp_path, name):
    job, ended = preempted(tmp_path, ["--signal-rank", "0", "--send-signal", name, "--signal-to", "agent"])
    assert_one_stop(ended, tmp_path, f"SIG{name}")
    asked = next(e for e in ended if f"ddprun: got SIG{name}: asking every rank to stop" in e.output)
    other = ended[1 - asked.node]
    assert re.search(rf"^ddprun: SIG{name} on agent \(node \d, \S+\): every rank stops after optimizer step \d+",
                     other.output, re.M), describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
def test_a_hangup_of_a_job_started_with_nohup_is_ignored_and_it_trains_to_its_end(tmp_path):
    """`nohup ddprun run ...`, and the terminal closes (an ssh session drops): SIGHUP to the agent.
    Before: torch's agent replaced the SIG_IGN nohup leaves with its handler, and ddprun took the
    hangup for a preemption: every rank stopped at one step, exit 75 (torchrun's own agent stops its
    workers: `SignalException: Process N got signal: 1`)."""
    job = Nodes(tmp_path, 1, 1, [*SLOW, "--out", str(tmp_path / "out"), "--signal-step", "5", "--signal-rank", "0",
                                 "--send-signal", "HUP", "--signal-to", "agent", "--marker", str(tmp_path / "signalled")],
                extra=["--log-dir", str(tmp_path / "runs")], script=FIT, prefix=["nohup"])
    [ended] = job.finish(timeout=60)
    assert ended.returncode == 0, describe([ended])
    assert (tmp_path / "signalled").read_text().startswith("SIGHUP from rank 0"), "the hangup was never sent"
    assert json.loads((tmp_path / "out" / "facts-0.json").read_text())["steps"] == STEPS, describe([ended])
    assert "SIGHUP" not in ended.output and "preempt" not in ended.output, describe([ended])
    agent_log = next((tmp_path / "runs" / "fault" / "logs").glob("agent-*.log")).read_text()
    assert "ddprun: SIGHUP is ignored (nohup): a closed terminal does not stop this node" in agent_log, agent_log
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(120)
def test_a_second_signal_to_an_agent_stops_its_workers_at_once(tmp_path):
    job = Nodes(tmp_path, 2, 1, [*SLOW, "--out", str(tmp_path / "out"), "--signal-step", "5", "--signal-rank", "0",
                                 "--send-signal", "USR1", "--signal-to", "agent", "--marker", str(tmp_path / "signalled"),
                                 "--hold-after-signal", "60"],  # no rank reaches the stop step before the 2nd signal
                extra=["--log-dir", str(tmp_path / "runs")], script=FIT)
    deadline = time.monotonic() + 60
    # every agent knows the agreed stop step (seconds ahead), so the other node knows its workers end
    # of the preemption; before that it could only say that its peer was lost
    while sum("every rank stops after optimizer step" in out.read_text() for out in job.outs) < 2 \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    asked = next(i for i, out in enumerate(job.outs) if "ddprun: got SIGUSR1" in out.read_text())
    sent = job.signal(asked, signal.SIGTERM)
    ended = job.finish(timeout=60)
    stopped, other = ended[asked], ended[1 - asked]
    assert stopped.returncode == 128 + signal.SIGTERM and other.returncode == 128 + signal.SIGUSR1, describe(ended)
    assert "ddprun: stopped by SIGTERM; workers stopped." in stopped.output, describe(ended)
    # the stopped node's record, or, when it hosted the store, the store's loss (the record went with it)
    first = (r"(?:node \d \(\S+\) was stopped by SIGTERM: its agent got SIGTERM and stopped its workers"
             r"|the node hosting the job store was lost: the job store at \S+ stopped answering(?: for \d+ s)?)")
    assert re.search(rf"^ddprun: the preemption stop did not complete on every node: {first}; this node's workers "
                     r"were stopped before the stop completed; the last checkpoint is the one before\.$", other.output,
                     re.M), describe(ended)
    assert "the job failed" not in other.output, describe(ended)
    assert not list((tmp_path / "runs" / "fault" / "checkpoints").glob("step-*.pt")), "a checkpoint after all"
    print(f"a second signal to an agent -> that node exited {stopped.ended_at - sent:.1f} s later")
    assert stopped.ended_at - sent < 10, describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(120)
def test_sigterm_to_every_process_of_one_node_stops_every_rank_at_one_step(tmp_path):
    _, ended = preempted(tmp_path, ["--signal-rank", "1", "--send-signal", "TERM", "--signal-to", "node"])
    assert_one_stop(ended, tmp_path, "SIGTERM")
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(150)
def test_sigusr1_to_every_process_under_an_agent_spares_fits_dataloader_workers(tmp_path):
    """SLURM signals every process of a step (scancel --signal=USR1, #SBATCH --signal=USR1@N): fit's
    DataLoader workers too, which SIGUSR1's default action would kill, failing their rank."""
    _, ended = preempted(tmp_path, ["--signal-rank", "1", "--send-signal", "USR1", "--signal-to", "tree",
                                    "--num-workers", "1"])
    assert_one_stop(ended, tmp_path, "SIGUSR1")
    assert "DataLoader worker" not in "".join(e.output for e in ended), describe(ended)
    assert "fit loads the data in the training process" not in "".join(e.output for e in ended), "its workers ran"
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
def test_a_checkpoint_longer_than_the_sigterm_to_sigkill_window_completes_within_the_grace(tmp_path):
    # torch's agent gives its workers --stop-grace (torchrun: a fixed 30 s) between SIGTERM and SIGKILL;
    # under a preemption that window does not start: the 8 s checkpoint outlives a 3 s one
    _, ended = preempted(tmp_path, ["--signal-rank", "1", "--send-signal", "TERM", "--slow-checkpoint", "8"],
                         extra=["--preempt-grace", "25", "--stop-grace", "3"], timeout=60)
    assert_one_stop(ended, tmp_path, "SIGTERM")
    assert all("preemption grace" not in e.output for e in ended), describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
def test_a_stop_that_outlasts_the_grace_is_forced_on_every_node(tmp_path):
    job, ended = preempted(tmp_path, ["--signal-rank", "1", "--send-signal", "TERM", "--slow-checkpoint", "60"],
                           extra=["--preempt-grace", "3", "--stop-grace", "3"], timeout=60)
    sent = job_time(job, float((tmp_path / "signalled").read_text().split(" at ")[1]))
    assert [e.returncode for e in ended] == [128 + signal.SIGTERM] * 2, describe(ended)
    for e in ended:
        assert "ddprun: the preemption grace of 3 s (--preempt-grace) ended before every rank of this node stopped " \
               "at the agreed step; workers stopped" in e.output, describe(ended)
    last = max(e.ended_at for e in ended) - sent
    print(f"preemption outlasting a 3 s grace -> last node exited {last:.1f} s after the signal")
    assert last < 15, describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
def test_a_signal_whose_stop_step_lies_past_the_runs_end_lets_it_finish_and_every_node_says_so(tmp_path):
    """SIGTERM to one worker 3 steps before the end: the agreed stop step (at least 3 s of steps ahead)
    lies past max_steps, so fit trains to its end and saves its final checkpoint; every node says the
    signal came as the run was ending and exits 0: nothing to resume."""
    job, ended = preempted(tmp_path, ["--signal-rank", "1", "--send-signal", "TERM", "--signal-to", "self",
                                      "--signal-step", str(STEPS - 3)])
    assert (tmp_path / "signalled").exists(), describe(ended)  # the signal was sent
    assert [e.returncode for e in ended] == [0, 0], describe(ended)
    for e in ended:
        assert "ddprun: SIGTERM came as the run was ending: it finished; nothing to resume" in e.output, describe(ended)
        assert "Traceback" not in e.output, describe(ended)
    for rank in (0, 1):
        assert json.loads((tmp_path / "out" / f"facts-{rank}.json").read_text())["steps"] == STEPS
    assert (tmp_path / "runs" / "fault" / "checkpoints" / f"step-{STEPS:08d}.pt").exists()
    assert_nothing_left(tmp_path)

@pytest.mark.timeout(120)
@pytest.mark.parametrize("catch", [False, True], ids=["raises", "script-catches-preempted"])
def test_an_unmodified_loop_gets_its_on_preempt_callback_at_one_step_on_every_rank(tmp_path, catch):
    """Also when the script catches ddprun.Preempted and returns: rank 0 still tells the agents where
    the job stopped (they said 'rank 0 did not say at which step')."""
    out = tmp_path / "out"
    job = Nodes(tmp_path, 2, 1, ["--out", str(out), "--signal-rank", "1", "--signal-step", "5",
                                 *(["--catch"] if catch else [])], script=LOOP,
                extra=["--log-dir", str(tmp_path / "runs")])
    ended = job.finish(timeout=90)
    assert [e.returncode for e in ended] == [75, 75], describe(ended)
    called = {r: (out / f"callback-{r}.txt").read_text() for r in (0, 1)}
    assert called[0] == called[1] and int(called[0]) > 5, called  # the same step on both ranks
    for e in ended:
        assert f"every rank stopped after optimizer step {called[0]} of this launch; the script's on_preempt " \
               "callbacks ran there" in e.output, describe(ended)
        assert "Traceback" not in e.output, describe(ended)
    assert not (out / "after-loop-0.txt").exists(), "the script went on past its stop step"
    assert all((out / f"caught-{r}.txt").exists() == catch for r in (0, 1))
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["TERM", "USR1"])
def test_a_signal_to_every_process_of_a_node_stops_a_loop_with_its_own_dataloader_at_one_step(tmp_path, name):
    """SLURM signals every process of a step, DataLoader workers too; a loop of the script's own whose
    DataLoader torch forks, with no worker_init_fn. Before: SIGUSR1 reached the rank twice (its worker
    inherited the rank's wakeup pipe), and the second stopped it at once (`stopped by a second SIGUSR1`);
    SIGTERM ended the worker (torch's handler), and its rank with it."""
    out = tmp_path / "out"
    job = Nodes(tmp_path, 2, 1, ["--out", str(out), "--signal-rank", "1", "--signal-step", "5", "--loader-workers", "1",
                                 "--send-signal", name, "--signal-to", "tree"], script=LOOP,
                extra=["--log-dir", str(tmp_path / "runs")])
    ended = job.finish(timeout=60)
    assert [e.returncode for e in ended] == [75, 75], describe(ended)
    called = {r: (out / f"callback-{r}.txt").read_text() for r in (0, 1)}
    assert called[0] == called[1] and int(called[0]) > 5, called
    for e in ended:
        assert re.search(rf"^ddprun: preempted by SIG{name} to [^:]+: every rank stopped after optimizer step "
                         rf"{called[0]} of this launch; the script's on_preempt callbacks ran there", e.output, re.M), \
            describe(ended)
        assert "DataLoader worker" not in e.output and "second SIG" not in e.output, describe(ended)
    assert "Traceback" not in "".join((tmp_path / "runs" / "fault" / "logs" / f"rank-{r}.log").read_text()
                                      for r in (0, 1))
    assert_nothing_left(tmp_path)


LIGHTNING_FIT = str(Path(__file__).parents[1] / "integrations" / "scripts" / "lightning_fit.py")


@pytest.mark.timeout(240)
def test_a_lightning_module_under_fit_stops_at_one_step_with_last_ckpt_and_resumes_there(tmp_path):
    """ddprun.fit(lit_module): SIGTERM to one rank; Lightning's own handler (which would stop each rank
    at its own batch) is not installed, both ranks save last.ckpt at the agreed step and stop there,
    and the same command continues from that step: no step is trained twice or lost."""
    extra("lightning.pytorch")
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = ["--out", str(out), "--steps", "60", "--step-sleep", "0.1", "--signal-rank", "1", "--signal-step", "5",
            "--marker", str(tmp_path / "signalled")]
    ended = Nodes(tmp_path, 2, 1, args, extra=["--log-dir", str(runs)], script=LIGHTNING_FIT).finish(timeout=120)
    assert [e.returncode for e in ended] == [75, 75], describe(ended)
    stops = {STOPPED.search(e.output).groups() if STOPPED.search(e.output) else None for e in ended}
    assert len(stops) == 1 and None not in stops, describe(ended)
    (sig, step, fit_step, path), = stops
    ckpt = runs / "fault" / "checkpoints" / "last.ckpt"
    assert sig == "SIGTERM" and step == fit_step and int(step) > 5 and Path(path) == ckpt, describe(ended)
    assert torch.load(ckpt, weights_only=True)["global_step"] == int(step)
    assert "SIGTERMException" not in "".join(e.output for e in ended), describe(ended)
    assert not list(out.glob("rank-*.json")), "fit returned instead of stopping"
    assert_nothing_left(tmp_path)
    again = Nodes(tmp_path, 2, 1, args, extra=["--log-dir", str(runs)], script=LIGHTNING_FIT,
                  name="again").finish(timeout=120)
    assert [e.returncode for e in again] == [0, 0], describe(again)
    import json

    for rank in (0, 1):  # the second launch trained the remaining steps only
        facts = json.loads((out / f"rank-{rank}.json").read_text())
        assert (facts["steps"], facts["train_steps"]) == (60, 60 - int(step)), facts
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(120)
def test_a_spot_interruption_notice_in_the_metadata_stops_every_rank_at_one_step(tmp_path):
    """--spot-notice aws against a local metadata server whose 404 turns into a notice mid-run."""
    from tests.fakes.metadata import Metadata, serve

    httpd, url = serve()
    timeline = tmp_path / "timeline"
    try:
        env = job_env(DDPRUN_SPOT_NOTICE_URL=url, DDPRUN_SPOT_NOTICE_POLL_S="0.2")
        job = Nodes(tmp_path, 2, 1, [*SLOW, "--out", str(tmp_path / "out"), "--timeline", str(timeline)],
                    extra=["--log-dir", str(tmp_path / "runs"), "--spot-notice", "aws"], script=FIT, env=env)
        deadline = time.monotonic() + 60
        while not (timeline.exists() and timeline.read_text().count("step ") >= 5) and time.monotonic() < deadline:
            time.sleep(0.05)
        Metadata.notice = True
        ended = job.finish(timeout=60)
    finally:
        httpd.shutdown()
    assert [e.returncode for e in ended] == [75, 75], describe(ended)
    notice = re.compile(r"^ddprun: preempted by an AWS spot interruption notice \(terminate at 2026-12-01T18:40:00Z\) "
                        r"on node \d \(\S+\): every rank stopped after optimizer step (\d+) of this launch; checkpoint "
                        r"at step \1 saved in [\d.]+ s \((\S+)\); resume with the same command$", re.M)
    stops = {notice.search(e.output).groups() if notice.search(e.output) else None for e in ended}
    assert len(stops) == 1 and None not in stops, describe(ended)
    (step, path), = stops
    assert int(step) > 5 and Path(path).exists(), describe(ended)
    assert "Traceback" not in "".join(e.output for e in ended), describe(ended)
    assert_nothing_left(tmp_path)


OWN_HANDLER = str(Path(__file__).parent / "scripts" / "own_handler_loop.py")


@pytest.mark.timeout(120)
def test_a_script_with_its_own_sigterm_handler_saves_where_it_decides_when_every_agent_is_signalled(tmp_path):
    """Kubernetes deletes every pod of the job: each agent (PID 1) gets SIGTERM, its workers do not.
    Nothing in the job stops at a step (no ddprun.fit, no on_preempt), so each agent stops its workers
    as torchrun's does, with SIGTERM and --stop-grace, and the script's own handler decides: every rank
    saves after one step and returns. Before: each rank ended the moment its agent's stop came."""
    out = tmp_path / "out"
    job = Nodes(tmp_path, 2, 1, ["--out", str(out)], script=OWN_HANDLER, extra=["--log-dir", str(tmp_path / "runs")])
    deadline = time.monotonic() + 60
    while not all((out / f"started-{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all((out / f"started-{r}").exists() for r in (0, 1)), job.describe()
    sent = min(job.signal(i, signal.SIGTERM) for i in (0, 1))
    ended = job.finish(timeout=60)
    saved = {r: (out / f"saved-{r}.txt").read_text() for r in (0, 1) if (out / f"saved-{r}.txt").exists()}
    assert set(saved) == {0, 1} and saved[0] == saved[1], describe(ended)  # both ranks, after the same step
    assert not (out / "after-loop-0.txt").exists(), "the script trained to its end"
    assert [e.returncode for e in ended] == [128 + signal.SIGTERM] * 2, describe(ended)
    for e in ended:
        assert "ddprun: stopped by SIGTERM; workers stopped." in e.output, describe(ended)
        assert "Traceback" not in e.output, describe(ended)
    print(f"every agent SIGTERMed -> both nodes ended {max(e.ended_at for e in ended) - sent:.1f} s later")
    assert max(e.ended_at for e in ended) - sent < 20, describe(ended)  # the save's 1 s, well inside --stop-grace
    assert_nothing_left(tmp_path)
