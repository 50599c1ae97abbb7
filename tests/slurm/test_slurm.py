"""ddprun under a real SLURM (conftest.py: node1, node2 as separate hosts, real slurmctld/slurmd/munge).

The launch styles a SLURM user has: a batch script whose step is ``srun ddprun run`` (one task per
node, no topology flags: everything comes from SLURM), ``srun python script.py`` with
``ddprun.init()`` (one task per rank), a Lightning Trainer through ``ddprun run``, the
``ddprun slurm-template`` script submitted as it is, and the allocations that cannot work: each
ends in bounded time with ddprun's error naming the values and a HINT.

2 shared cores run every rank of both nodes, so the jobs are small and run one at a time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import DDPRUN, EXAMPLE, REPO, extra, run_agents
from tests.helpers import describe as describe_runs

pytestmark = pytest.mark.slurm

SCRIPTS = Path(__file__).parent / "scripts"
INIT_TRAIN = str(Path(__file__).parents[1] / "integrations" / "scripts" / "init_train.py")  # shared with mpirun
LIGHTNING_TRAINER = str(SCRIPTS / "lightning_trainer.py")
PYTHON = str(Path(DDPRUN).parent / "python")
STEPS = ["--steps", "8"]


def facts(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def params_equal(out: Path, ranks) -> None:
    ref = torch.load(out / "params-0.pt", weights_only=True)
    for rank in ranks:
        other = torch.load(out / f"params-{rank}.pt", weights_only=True)
        assert ref.keys() == other.keys() and all(torch.equal(ref[k], other[k]) for k in ref), \
            f"rank {rank} params differ from rank 0"


def batch_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "job.sbatch"
    script.write_text(f"#!/bin/bash\n{body}\n")
    return script


def slurm_port(job_id: int) -> int:
    """The port ddprun derives from the job id on SLURM (cluster/slurm.py): every node derives the same."""
    return 15000 + job_id % 17000


def check_per_node_run(job, out: Path, nproc: int, master: str, nodes=("node1", "node2")) -> list[dict]:
    """torchrun_style.py ran under one `ddprun run` per node: every rank's facts follow SLURM's job.

    MASTER_ADDR is where a node's workers dial the store. Node 0's store listens on one address,
    ``master`` (node1's IP, agent/endpoint.py), and its own workers dial exactly that, never a name
    that may resolve to another address on its own host (127.0.1.1); the other node dials the name
    SLURM gave, node1, as its agent did."""
    got = facts(out)
    world = nproc * len(nodes)
    assert sorted(int(f["RANK"]) for f in got) == list(range(world))
    port = str(slurm_port(job.job_id))
    for f in got:
        rank, local, node = int(f["RANK"]), int(f["LOCAL_RANK"]), int(f["NODE_RANK"])
        assert f["GROUP_RANK"] == f["NODE_RANK"] and rank == node * nproc + local and 0 <= local < nproc, f
        assert (f["WORLD_SIZE"], f["LOCAL_WORLD_SIZE"]) == (str(world), str(nproc)), f
        assert f["host"] == nodes[node], f  # node rank = SLURM_NODEID = place in SLURM_JOB_NODELIST
        assert (f["MASTER_ADDR"], f["MASTER_PORT"]) == (master if node == 0 else "node1", port), f
        assert f["TORCHELASTIC_RUN_ID"] == f"slurm-{job.job_id}" and f["GLOO_SOCKET_IFNAME"] == "eth0", f
        assert f["device"] == "cpu" and f["OMP_NUM_THREADS"] == "1", f
    params_equal(out, range(1, world))
    return got


def test_repo_is_visible_to_the_nodes(slurm, tmp_path):
    """The nodes share this filesystem: jobs run the repo's venv (what every other test relies on)."""
    job = slurm.srun(["-N2", "--ntasks-per-node=1", PYTHON, "-c",
                      "import ddprun, socket; print(socket.gethostname(), ddprun.__file__)"], timeout=30, cwd=tmp_path)
    assert job.returncode == 0, slurm.describe(job)
    lines = sorted(job.output.split("\n"))
    assert [line.split()[0] for line in lines if line] == ["node1", "node2"], slurm.describe(job)
    assert all(str(REPO / "src" / "ddprun") in line for line in lines if line), slurm.describe(job)


@pytest.mark.timeout(120)
def test_sbatch_one_ddprun_per_node_reads_everything_from_slurm(slurm, tmp_path):
    out = tmp_path / "out"
    script = batch_script(tmp_path, f"srun {DDPRUN} run {EXAMPLE} {' '.join(STEPS)} --out {out} --destroy")
    job = slurm.sbatch(script, ["-N2", "--ntasks-per-node=1"], timeout=90, cwd=tmp_path)
    assert job.returncode == 0 and job.job_id, slurm.describe(job)
    # CPU nodes, no GPU asked for: one process per node
    check_per_node_run(job, out, nproc=1, master=slurm.addr("node1"))
    assert f"static rendezvous at node1:{slurm_port(job.job_id)}" in job.output, slurm.describe(job)
    assert "2/2 ranks on 2 node(s)" in job.output, slurm.describe(job)
    plan = json.loads((tmp_path / "runs" / f"slurm-{job.job_id}" / "plan.json").read_text())
    assert sorted((r["rank"], r["host"]) for r in plan["ranks"]) == [(0, "node1"), (1, "node2")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tasks", [2, 1], ids=["2-tasks-per-node", "1-task-per-node"])
def test_srun_one_task_per_rank_with_ddprun_init(slurm, tmp_path, tasks):
    """One task per node too: each node's only process is that node's rank (as torch's env:// and
    Lightning take it), never a job of one that trains alone."""
    out, world = tmp_path / "out", 2 * tasks
    job = slurm.srun(["-N2", f"--ntasks-per-node={tasks}", PYTHON, INIT_TRAIN, "--out", str(out), "--steps", "5"],
                     timeout=90, cwd=tmp_path)
    assert job.returncode == 0, slurm.describe(job)
    got = facts(out)
    assert sorted(f["rank"] for f in got) == list(range(world)), slurm.describe(job)
    for f in got:
        assert f["rank"] == int(f["SLURM_PROCID"]) == f["group_rank"], f
        assert f["local_rank"] == int(f["SLURM_LOCALID"]) and f["node_rank"] == int(f["SLURM_NODEID"]), f
        assert f["host"] == ("node1", "node2")[f["node_rank"]] and f["rank"] == f["node_rank"] * tasks + f["local_rank"], f
        assert (f["world_size"], f["local_world_size"], f["group_size"]) == (world, tasks, world), f
        assert (f["device"], f["backend"], f["steps"]) == ("cpu", "gloo", 5), f
        job_id = int(f["SLURM_JOB_ID"])
        assert (f["MASTER_ADDR"], f["MASTER_PORT"]) == ("node1", str(slurm_port(job_id))), f
        assert f["GLOO_SOCKET_IFNAME"] == "eth0", f  # gloo on the link between the nodes, not loopback
    params_equal(out, tuple(range(1, world)))


@pytest.mark.timeout(180)
def test_lightning_trainer_under_srun_ddprun_run_uses_every_rank(slurm, tmp_path):
    extra("lightning.pytorch")
    out = tmp_path / "out"
    script = batch_script(tmp_path, f"srun {DDPRUN} run {LIGHTNING_TRAINER} --max-steps 5 --out {out}")
    job = slurm.sbatch(script, ["-N2", "--ntasks-per-node=1", "--gres=gpu:2"], timeout=150, cwd=tmp_path)
    assert job.returncode == 0, slurm.describe(job)
    got = facts(out)
    assert sorted(f["global_rank"] for f in got) == [0, 1, 2, 3], slurm.describe(job)
    for f in got:
        assert (f["world_size"], f["num_nodes"], f["devices"]) == (4, 2, 2), f
        assert f["global_rank"] == f["node_rank"] * 2 + f["local_rank"], f
        assert f["host"] == ("node1", "node2")[f["node_rank"]] and f["SLURM_NODEID"] == str(f["node_rank"]), f
        assert f["steps"] == 5 and f["global_step"] == 5 and f["cluster_environment"] == "DdprunEnvironment", f
    params_equal(out, (1, 2, 3))


BAD_ALLOCATIONS = {
    "uneven tasks": (
        ["-n3", "-N2", PYTHON, INIT_TRAIN, "--out", "unused"],
        ["SLURM gave the nodes different numbers of tasks", "SLURM_STEP_TASKS_PER_NODE=2,1", "--ntasks-per-node"]),
    "tasks per node differ from gpus": (
        ["-N2", "--ntasks-per-node=3", "--gres=gpu:2", PYTHON, INIT_TRAIN, "--out", "unused"],
        ["SLURM tasks per node differ from GPUs per node", "SLURM_STEP_TASKS_PER_NODE=3(x2)", "SLURM_GPUS_ON_NODE=2",
         "--ntasks-per-node=2"]),
    "ddprun run once per task": (
        ["-N2", "--ntasks-per-node=2", DDPRUN, "run", EXAMPLE, "--out", "unused"],
        ["`ddprun run` was started 2 times on this node by srun", "SLURM_STEP_TASKS_PER_NODE=2(x2)",
         "srun --ntasks-per-node=1 ddprun run"]),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(BAD_ALLOCATIONS))
def test_bad_allocations_fail_fast_with_a_hint(slurm, tmp_path, case):
    args, expected = BAD_ALLOCATIONS[case]
    job = slurm.srun(args, timeout=60, cwd=tmp_path)
    assert job.returncode not in (0, None), slurm.describe(job)
    assert job.wall_s < 45, slurm.describe(job)
    assert "HINT:" in job.output, slurm.describe(job)
    for text in expected:
        assert text in job.output, (text, slurm.describe(job))
    assert not (tmp_path / "unused").exists()  # nothing trained
    assert not (tmp_path / "runs").exists()  # refused before a run directory was made


@pytest.mark.timeout(90)
def test_starting_ddprun_in_the_batch_script_without_srun_is_refused_at_once(slurm, tmp_path):
    """The most common SLURM mistake: the batch script runs on the first node only, outside any step.
    Without the check `ddprun run` there waits for node2 until the join timeout, and the script with
    ddprun.init() trains alone as one process (with several tasks per node: rank 0 waits for ranks
    that never start)."""
    script = batch_script(tmp_path, f"{DDPRUN} run {EXAMPLE} --out unused; echo ddprun-rc=$?\n"
                                    f"{PYTHON} {INIT_TRAIN} --out unused; echo init-rc=$?")
    job = slurm.sbatch(script, ["-N2", "--ntasks-per-node=1"], timeout=60, cwd=tmp_path)
    assert job.returncode == 0 and job.wall_s < 45, slurm.describe(job)
    assert "ddprun-rc=2" in job.output and "init-rc=1" in job.output, slurm.describe(job)
    assert job.output.count("ddprun is not running in an srun step, but the SLURM job has 2 tasks") == 2, \
        slurm.describe(job)
    assert job.output.count("HINT: Start it with srun") == 2 and "SLURM_TASKS_PER_NODE=1(x2)" in job.output
    assert not (tmp_path / "unused").exists()  # nothing trained
    assert not (tmp_path / "runs").exists()  # refused before a run directory was made


@pytest.mark.timeout(150)
def test_slurm_template_submitted_as_printed(slurm, tmp_path):
    """`ddprun slurm-template`, scaled to the test bed (2 nodes x 2 GPUs), submitted unchanged.

    The nodes' GPUs are fake: SLURM_GPUS_ON_NODE=2 sets 2 processes per node, torch sees no CUDA
    device, so they run on cpu and `ddprun run` says so in a note. (--gres=gpu:2 is the Lightning test's.)"""
    out = tmp_path / "out"
    printed = subprocess.run([DDPRUN, "slurm-template", "--nodes", "2", "--gpus-per-node", "2", "--cpus-per-task", "2",
                              "--time", "00:05:00", "--partition", "debug", "--job-name", "tpl-test",
                              EXAMPLE, *STEPS, "--out", str(out), "--destroy"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    script = tmp_path / "job.sbatch"
    script.write_text(printed)
    job = slurm.sbatch(script, timeout=120, cwd=tmp_path, as_written=True)
    assert job.returncode == 0 and job.job_id, slurm.describe(job)
    check_per_node_run(job, out, nproc=2, master=slurm.addr("node1"))
    assert "2 node(s) x 2 process(es) on cpu" in job.output, slurm.describe(job)
    assert "SLURM_GPUS_ON_NODE=2, but torch sees no CUDA device on node1" in job.output, slurm.describe(job)
    assert (tmp_path / f"tpl-test-{job.job_id}.out").exists()  # the template's own --output


FIT = str(Path(__file__).parents[1] / "multiprocess" / "scripts" / "fit_restart.py")  # shared with tests/faults
FIT_ARGS = ["--steps", "60", "--step-sleep", "0.1", "--checkpoint-every", "1000"]  # 10 steps/s: stops mid-run
# scancel --signal signals every process of the step's tasks: an agent or a worker may be the first to ask
STOPPED = re.compile(r"^ddprun: preempted by SIGUSR1 to (?:the agent|rank \d) of node \d \(node\d\): every rank stopped after "
                     r"optimizer step (\d+) of this launch; checkpoint at step \1 saved in [\d.]+ s \((\S+)\); "
                     r"resume with the same command$", re.M)


def until(what, timeout: float, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s"
        time.sleep(poll)


def scontrol(slurm, *args: str) -> str:
    return subprocess.run(["scontrol", *args], env=slurm.env(), capture_output=True, text=True, timeout=10).stdout


def start_when_eligible(slurm, job_id: str) -> None:
    """Once ``job_id`` is requeued, start it as soon as SLURM lets it.

    Requeued, SLURM holds the job back (Reason=BeginTime) until the old credential expires: the test
    bed's cred_expire, 5 s (testbed/setup.sh; 120 s by default). An earlier start, forced with
    `scontrol update StartTime=now`, is killed by slurmd: "Job credential revoked". After it, the
    builtin scheduler would wait for its next periodic pass (up to a minute): the update asks for one."""
    until(lambda: "JobState=PENDING" in scontrol(slurm, "show", "job", job_id), timeout=60)
    pending = scontrol(slurm, "show", "job", job_id)
    print("requeued:", *(f for f in pending.split() if f.startswith(("Reason=", "EligibleTime=", "Restarts="))))
    eligible = re.search(r"EligibleTime=(\S+)", pending).group(1)
    # EligibleTime is shown to the second, truncated: 2.5 s past it is past the real one
    wait_s = time.mktime(time.strptime(eligible, "%Y-%m-%dT%H:%M:%S")) + 2.5 - time.time()
    assert wait_s < 20, f"the requeued job is held until {eligible}: is cred_expire=5 in the test bed?"
    time.sleep(max(0.0, wait_s))
    scontrol(slurm, "update", f"JobId={job_id}", "StartTime=now")
    print(f"held {wait_s:.1f} s after the requeue")


def signal_then_requeue(slurm, script: Path, name: str, timeline: Path, cwd: Path) -> tuple[str, Any, float]:
    """Submit ``script`` (job ``name``); after its rank 0 logged 5 steps in ``timeline``, ``scancel
    --signal=USR1``; start the requeued job when SLURM lets it; return (job id, the finished job, when
    signalled)."""
    done: dict = {}
    submit = threading.Thread(target=lambda: done.update(job=slurm.sbatch(script, timeout=200, cwd=cwd,
                                                                          as_written=True)))
    submit.start()
    until(lambda: timeline.exists() and timeline.read_text().count("step ") >= 5, timeout=120)
    job_id = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], env=slurm.env(), capture_output=True,
                            text=True, timeout=10).stdout.strip()
    signalled = time.monotonic()
    subprocess.run(["scancel", "--signal=USR1", job_id], env=slurm.env(), check=True, timeout=10)
    start_when_eligible(slurm, job_id)
    print(f"{time.monotonic() - signalled:.1f} s since the signal")
    submit.join(220)
    assert not submit.is_alive(), f"sbatch of the requeued job still waiting:\n{slurm.logs()}"
    print(f"the requeued job ended {time.monotonic() - signalled:.1f} s after the signal")
    return job_id, done["job"], signalled


@pytest.mark.timeout(300)
def test_scancel_usr1_stops_every_rank_at_one_step_and_the_requeued_job_resumes_bitwise(slurm, tmp_path):
    """SLURM's own preemption path: `scancel --signal=USR1` (what `--signal=USR1@N` sends before the
    time limit) reaches every `ddprun run`; both stop after one step with a checkpoint, node 0 runs
    `scontrol requeue`, and SLURM's second start of the same job id resumes there: the parameters are
    those of an uninterrupted run, bit for bit."""
    ref = run_agents([[DDPRUN, "run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "ref"), FIT, "--out",
                       str(tmp_path / "ref-out"), "--steps", "60"]], timeout=60, cwd=tmp_path)
    assert ref[0].returncode == 0, describe_runs(ref)
    out, timeline, name = tmp_path / "out", tmp_path / "timeline", f"preempt-{os.getpid()}"
    script = batch_script(tmp_path, "\n".join([
        f"#SBATCH --job-name={name}", "#SBATCH --output=%x-%j.out", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue", "#SBATCH --open-mode=append",
        f"srun {DDPRUN} run --requeue {FIT} {' '.join(FIT_ARGS)} --out {out} --timeline {timeline}"]))
    job_id, job, signalled = signal_then_requeue(slurm, script, name, timeline, tmp_path)
    assert job.returncode == 0 and job.job_id == int(job_id), slurm.describe(job)
    _, _, again = job.output.partition("ddprun: requeued SLURM job")
    # both nodes of the first launch (the second one ends without a stop): one step, one checkpoint. Node 0
    # requeues only after every node said its line, since SLURM's requeue kills the job's steps at once
    stops = STOPPED.findall(job.output)
    assert len(stops) == 2 and len(set(stops)) == 1, slurm.describe(job)
    (step, path), = set(stops)
    assert Path(path) == tmp_path / "runs" / f"slurm-{job_id}" / "checkpoints" / f"step-{int(step):08d}.pt"
    assert again.startswith(f" {job_id} (scontrol requeue {job_id}): ") and again.count("requeued SLURM job") == 0
    assert f"ddprun: resuming from {path}: step {step}" in again, slurm.describe(job)
    assert "Traceback" not in job.output, slurm.describe(job)
    show = scontrol(slurm, "show", "job", job_id)
    assert "Restarts=1" in show and "JobState=COMPLETED" in show, show
    reference = torch.load(tmp_path / "ref-out" / "params-0.pt", weights_only=True)
    for rank in (0, 1):  # not one step redone or lost
        got = torch.load(out / f"params-{rank}.pt", weights_only=True)
        assert all(torch.equal(reference[k], got[k]) for k in reference), f"rank {rank} differs from the reference"
    print(f"scancel --signal=USR1 -> stop after step {step}, requeued and resumed; "
          f"job done {time.monotonic() - signalled:.1f} s after the signal")


FORCED = re.compile(r"^ddprun: (?:the preemption grace of 3 s \(--preempt-grace\) ended before every rank of this node "
                    r"stopped at the agreed step|the preemption stop did not complete on every node: .*); workers "
                    r"stopped", re.M)


@pytest.mark.timeout(300)
def test_a_preemption_stop_the_grace_forced_is_requeued_too_and_the_next_start_finishes(slurm, tmp_path):
    """`--requeue` after a stop that `--preempt-grace` forced (docs/preemption.md): a checkpoint hook
    that outlasts the 3 s grace keeps every rank from stopping at the agreed step. Every node says so
    and ends as signalled, not as a failure; node 0 still requeues the job (it is not done), once, and
    says so though SLURM's requeue SIGTERMs it; SLURM's second start of the same job id runs the
    script to its end."""
    out, timeline, name = tmp_path / "out", tmp_path / "timeline", f"forced-{os.getpid()}"
    script = batch_script(tmp_path, "\n".join([
        f"#SBATCH --job-name={name}", "#SBATCH --output=%x-%j.out", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue", "#SBATCH --open-mode=append",
        f"srun {DDPRUN} run --requeue --preempt-grace 3 --stop-grace 3 {FIT} {' '.join(FIT_ARGS)} "
        f"--slow-checkpoint 60 --out {out} --timeline {timeline}"]))
    job_id, job, signalled = signal_then_requeue(slurm, script, name, timeline, tmp_path)
    assert job.returncode == 0 and job.job_id == int(job_id), slurm.describe(job)
    first, requeued, again = job.output.partition(f"ddprun: requeued SLURM job {job_id} (scontrol requeue {job_id})")
    assert requeued and "requeued SLURM job" not in again, slurm.describe(job)  # once, by node 0
    assert len(FORCED.findall(first)) == 2 and "the job failed" not in first, slurm.describe(job)
    assert "preempted by SIGUSR1" not in first, slurm.describe(job)  # no rank stopped at the step
    # each agent's record: a stop by the preemption's signal, never a failure. (Its exit code, 138, is
    # not asserted: SLURM's requeue SIGTERMs whichever agent has not exited yet.)
    for node in (0, 1):
        record = json.loads((tmp_path / "runs" / f"slurm-{job_id}" / "failures" / f"rank-node{node}.json").read_text())
        assert (record["kind"], record["signal"], record["by"]) == ("signal", "SIGUSR1", "agent"), record
        assert record["summary"].startswith("its preemption grace of 3 s (--preempt-grace) ended"), record
    # the second start trains to the end: from the stop step's checkpoint when it was written before
    # the hook hung, else from the start (when the agreed step lies beyond the grace: timing); each
    # node's forced-stop line said which
    assert "step 60/60" in again and again.count("finished on this node") == 2, slurm.describe(job)
    resumed = re.search(r"ddprun: resuming from .*?: step (\d+),", again)
    said = (f"; rank 0 had saved the stop step's checkpoint first (step {resumed[1]}, " if resumed else
            "; the last checkpoint is the one before.")
    assert first.count(said) == 2, slurm.describe(job)
    for rank in (0, 1):
        assert json.loads((out / f"facts-{rank}.json").read_text())["steps"] == 60
    assert "Traceback" not in job.output, slurm.describe(job)
    show = scontrol(slurm, "show", "job", job_id)
    assert "Restarts=1" in show and "JobState=COMPLETED" in show, show
    print(f"forced stop -> requeued and finished {time.monotonic() - signalled:.1f} s after the signal, resumed "
          f"from {f'step {resumed[1]}' if resumed else 'the start'}")


@pytest.mark.timeout(120)
def test_steps_on_part_of_the_allocation_train_side_by_side_each_a_run_of_its_own(slurm, tmp_path):
    """A sweep: `srun -N1 -n1 ddprun run ... &` twice inside a 2-node allocation, one step a node. The
    step's own variables (SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE, ...) say one node where the
    job's say two (before, the job's were read and each step was refused), and each step is a run of
    its own (runs/slurm-<job>.<step>), not two writers of one run directory and its checkpoints."""
    steps = [f"srun -N1 -n1 -w {node} {DDPRUN} run {EXAMPLE} {' '.join(STEPS)} --out {tmp_path / node} --destroy &"
             for node in ("node1", "node2")]
    script = batch_script(tmp_path, "\n".join(steps + ["wait"]))
    job = slurm.sbatch(script, ["-N2", "--ntasks-per-node=1"], timeout=90, cwd=tmp_path)
    assert job.returncode == 0 and job.job_id, slurm.describe(job)
    for node in ("node1", "node2"):
        got = facts(tmp_path / node)
        assert [(f["RANK"], f["WORLD_SIZE"], f["NODE_RANK"], f["host"]) for f in got] == [("0", "1", "0", node)], got
    assert job.output.count("1/1 ranks on 1 node(s)") == 2, slurm.describe(job)
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == [f"slurm-{job.job_id}.0", f"slurm-{job.job_id}.1"], runs


@pytest.mark.timeout(120)
def test_ranks_exported_in_the_batch_script_are_refused_on_every_task_at_once(slurm, tmp_path):
    """`export RANK=$SLURM_PROCID ...` in the batch script is the batch step's value (0) in every task of
    the srun after it: every task would be rank 0 and wait out the init timeout. Each task whose values
    disagree names its SLURM_PROCID and exits within seconds; task 0's agree, so it cannot tell, and
    srun's --kill-on-bad-exit ends it (without, it waits for the others up to init's timeout)."""
    script = batch_script(tmp_path, "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
                                    f"MASTER_ADDR=node1 MASTER_PORT=29555\n"
                                    f"srun --kill-on-bad-exit=1 {PYTHON} {INIT_TRAIN} --out unused")
    job = slurm.sbatch(script, ["-N2", "--ntasks-per-node=1"], timeout=90, cwd=tmp_path)
    assert job.returncode not in (0, None) and job.wall_s < 60, slurm.describe(job)
    assert "RANK/LOCAL_RANK are not this srun task's own" in job.output, slurm.describe(job)
    assert "RANK=0 but SLURM_PROCID=1" in job.output, slurm.describe(job)
