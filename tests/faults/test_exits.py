"""Ends that used to hang or say nothing: an atexit handler that never returns, a full disk under
the run directory, an elastic job that loses the node hosting its store, torch's shared-store switch,
a console that goes away, DataLoader workers alive at the script's end, a Pool the script terminates."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.conftest import assert_nothing_left, describe
from tests.helpers import DDPRUN, job_env

pytestmark = pytest.mark.faults


@pytest.mark.timeout(60)
def test_an_atexit_handler_that_never_returns_is_bounded_and_named(nodes, tmp_path):
    job = nodes(1, 1, ["--steps", "3", "--step-s", "0", "--atexit-hang"], extra=["--exit-timeout", "2"])
    (ended,) = job.finish(timeout=40)
    assert ended.returncode == 1, describe([ended])
    assert "an atexit handler did not return within 2 s; exiting anyway" in ended.output, describe([ended])
    assert "job.py" in ended.output  # where it hangs
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("memfd", ["memfd", "no-memfd"])
def test_a_dataloader_iterator_alive_at_the_scripts_end_lets_its_ranks_exit_at_once(nodes, tmp_path, memfd):
    """At the end multiprocessing terminates a rank's workers and joins them without a bound: under
    ddprun run a DataLoader worker torch forks ignores the preemption signals, SIGTERM included, so
    the rank ends them itself, and torch's SIGCHLD handler must not take that for a worker's failure.
    ``no-memfd``: a Python without ``os.memfd_create`` (conda's), whose workers cannot answer a hang
    report (before: the rank did not find them, and its exit waited for them until --exit-timeout)."""
    script = str(Path(__file__).parent / "scripts" / "loader_outlives.py")
    [ended] = nodes(1, 2, ["no-memfd"] if memfd == "no-memfd" else [], script=script).finish(timeout=40)
    logs = "".join((tmp_path / "runs" / "fault" / "logs" / f"rank-{r}.log").read_text() for r in (0, 1))
    assert ended.returncode == 0 and "finished on this node" in ended.output, describe([ended])
    assert "rank 0 done" in logs and "rank 1 done" in logs, logs
    assert "Traceback" not in logs and "killed by signal" not in logs and "atexit" not in logs, logs
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(60)
def test_a_pool_the_rank_terminates_ends_at_once(nodes, tmp_path):
    """Processes a rank forks had its handlers, which only set a flag: the SIGTERM of a Pool's
    terminate() ended nothing, and its join() waited forever (before: the rank never finished)."""
    script = str(Path(__file__).parent / "scripts" / "pool_terminate.py")
    [ended] = nodes(1, 1, [], script=script).finish(timeout=30)
    assert ended.returncode == 0 and "finished on this node" in ended.output, describe([ended])
    assert "rank 0 done" in (tmp_path / "runs" / "fault" / "logs" / "rank-0.log").read_text()
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(60)
def test_a_dataloader_worker_blocked_in_its_dataset_ends_when_its_loop_leaves_the_dataloader(nodes, tmp_path):
    """A loop that leaves its DataLoader early (``break``) while the worker is blocked in its dataset:
    torch's shutdown joins the worker for 5 s, then terminates it. The worker ignores the job's
    preemption signals (a scheduler sends them to every process of the node), SIGTERM included, so
    in the rank that terminate() kills it. Before: it outlived the loop, blocked, until its rank's
    exit. (The same for every start method and worker_init_fn: tests/unit/test_loader_workers.py.)"""
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    script = str(Path(__file__).parent / "scripts" / "loader_dropped.py")
    args = [str(fifo), str(tmp_path / "worker.pid"), "safe"]
    [ended] = nodes(1, 1, args, script=script).finish(timeout=45)
    assert ended.returncode == 0, describe([ended])
    log = (tmp_path / "runs" / "fault" / "logs" / "rank-0.log").read_text()
    m = re.search(r"rank 0: the blocked worker (ended|is still alive) ([\d.]+) s after the loop left its DataLoader",
                  log)
    assert m and m.group(1) == "ended", log
    assert float(m.group(2)) < 5 + 3, log  # torch's join, its SIGTERM, the next look
    assert_nothing_left(tmp_path)


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MiB tmpfs under tmp_path (root only), almost full."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode:
        pytest.fail("the full-disk test needs root to mount a tmpfs (CI runs as root)")
    try:
        with open(mnt / "filler", "wb") as fp:
            try:
                fp.write(b"\0" * (2 << 20))
            except OSError:
                pass
        os.unlink(mnt / "filler")
        with open(mnt / "filler", "wb") as fp:  # leave ~64 KiB: the run directory starts, its logs fill it
            fp.write(b"\0" * ((2 << 20) - (64 << 10)))
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


@pytest.mark.timeout(90)
def test_a_full_disk_under_the_run_directory_is_said_on_every_nodes_console(nodes, tmp_path, full_disk):
    # every worker's error file is lost with the disk: each agent reads its workers' records (and the
    # job's first cause) from the store instead of saying that a rank "ended without a Python error"
    job = nodes(2, 1, ["--steps", "50", "--step-s", "0.01", "--write-mb", "0.1"],
                extra=["--run-dir", str(full_disk / "run")])
    ended = job.finish(timeout=60)
    assert [e.returncode for e in ended] == [1, 1], describe(ended)
    for e in ended:
        cause = re.findall(r"^ddprun: the job failed: (.*)$", e.output, re.M)
        assert cause and "No space left on device" in cause[0], describe(ended)
    assert "without a Python error" not in "".join(e.output for e in ended), describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(120)
def test_an_elastic_job_that_loses_the_store_host_says_so_and_ends(nodes, tmp_path):
    # The node hosting the rendezvous endpoint's store is the one an elastic job cannot lose (torch's
    # c10d keeps the rendezvous state there); losing any other node, node 0 included, it re-rendezvouses
    # and goes on (tests/multiprocess/test_restarts.py loses the other one).
    job = nodes(2, 1, ["--steps", "600", "--step-s", "0.1"], nnodes="1:2", extra=["--max-restarts", "2"])
    job.worker_pids(range(2))
    host = job.store_host()
    killed_at = job.signal(host, signal.SIGKILL)
    ended = job.finish(timeout=60)
    survivor = ended[1 - host]
    assert ended[host].returncode == -signal.SIGKILL and survivor.returncode == 1, describe(ended)
    cause = re.findall(r"^ddprun: the job failed: (.*)$", survivor.output, re.M)
    assert cause and re.fullmatch(r"(the node hosting the job store was lost: the job store at \S+:\d+ stopped "
                                  r"answering|node \d \(\S+\) was lost: its agent stopped answering).*", cause[0]), \
        describe(ended)
    assert "frame #" not in survivor.output and "Traceback" not in survivor.output, describe(ended)
    print(f"elastic job, store host killed -> survivor exited after {survivor.ended_at - killed_at:.1f} s")
    assert survivor.ended_at - killed_at < 20, describe(ended)
    assert_nothing_left(tmp_path)


def elastic_pair(nodes):
    """2 x 1 nodes of an elastic job (--nnodes 1:2, 2 restarts, 3 s of training) whose rendezvous
    re-forms within seconds: a 1 s last call, keep-alives every second."""
    return nodes(2, 1, ["--steps", "30", "--step-s", "0.1"], nnodes="1:2",
                 extra=["--max-restarts", "2", "--rdzv-conf",
                        "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"])


@pytest.mark.timeout(120)
def test_sigterm_to_one_node_of_an_elastic_job_with_nothing_to_save_restarts_the_other(nodes, tmp_path):
    """The signalled node's rank answers the preemption request "none" (nothing stops at a step): its
    agent stops it at once and leaves, as torchrun's would. The other node's agent read the request
    (which forbids restarts while the job stops at a step), maybe before that answer: it restarts its
    worker alone (--max-restarts) and finishes, as under torchrun."""
    job = elastic_pair(nodes)
    job.worker_pids(range(2))
    victim = 1 - job.store_host()  # torch's rendezvous state lives on the store host: it must stay
    job.signal(victim, signal.SIGTERM)
    ended = job.finish(timeout=90)
    stopped, other = ended[victim], ended[1 - victim]
    assert stopped.returncode == 128 + signal.SIGTERM and other.returncode == 0, describe(ended)
    assert "ddprun: stopped by SIGTERM; workers stopped." in stopped.output, describe(ended)
    assert re.search(rf"^ddprun: node {victim} \(\S+\) was stopped by SIGTERM: its agent got SIGTERM and stopped "
                     r"its workers; restarting the workers \(restart 1 of 2\)$", other.output, re.M), describe(ended)
    # where the signalled node hosted the workers' store (its worker was rank 0), that store is gone
    # while the group re-forms: no loss to name, nothing to stop
    assert "stopped answering" not in other.output and "stopping this node's workers" not in other.output, \
        describe(ended)
    assert "preempt" not in other.output and "Traceback" not in other.output, describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(120)
def test_sigterm_to_every_process_of_one_node_of_an_elastic_job_restarts_only_the_other(nodes, tmp_path):
    """As SLURM or Kubernetes stop a node: its agent and its worker get SIGTERM. The worker, with
    nothing to save at a step, dies of it at once, maybe before its agent read that answer: the
    signalled node goes away all the same, as torchrun's agent does on a signal (it never restarts,
    and leaves the rendezvous open); the other restarts alone and finishes."""
    job = elastic_pair(nodes)
    pids = job.worker_pids(range(2))
    victim = 1 - job.store_host()
    for pid in [job.procs[victim].pid, *(p for p in pids.values() if job.agent_of(p) == victim)]:
        os.kill(pid, signal.SIGTERM)
    ended = job.finish(timeout=90)
    stopped, other = ended[victim], ended[1 - victim]
    assert stopped.returncode == 128 + signal.SIGTERM and other.returncode == 0, describe(ended)
    assert "ddprun: stopped by SIGTERM; workers stopped." in stopped.output, describe(ended)
    assert "restarting the workers" not in stopped.output, describe(ended)
    assert re.search(r"^ddprun: .*restarting the workers \(restart 1 of 2\)$", other.output, re.M), describe(ended)
    assert "Traceback" not in other.output, describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(60)
def test_torchs_unshared_store_switch_is_said_not_silent(nodes, tmp_path):
    from tests.helpers import job_env

    job = nodes(1, 1, ["--steps", "3", "--step-s", "0"], env=job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    (ended,) = job.finish(timeout=40)
    assert ended.returncode == 0, describe([ended])
    assert "warning: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in ended.output and "are off" in ended.output


@pytest.mark.timeout(60)
def test_a_console_that_goes_away_leaves_the_job_training_to_its_end(tmp_path):
    """The agent's stdout and stderr are a pipe whose reader ends after the first line (`ddprun run ...
    | head -1`, a killed `tee`; an ssh session that dropped gives EIO instead). Before: the log
    follower's thread died at the next line, and the launch ended with `the launcher failed:
    BrokenPipeError` and exit 1 after the job; a line the agent itself printed meanwhile (a failure, a
    preemption) would have ended it mid-run, and its workers with it."""
    fit = str(Path(__file__).parents[1] / "multiprocess" / "scripts" / "fit_restart.py")
    cmd = [DDPRUN, "run", "--nproc-per-node", "1", "--rdzv-id", "gone", "--log-dir", str(tmp_path / "runs"), fit,
           "--out", str(tmp_path / "out"), "--steps", "30", "--step-sleep", "0.1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        first = proc.stdout.readline().decode()
        proc.stdout.close()  # the reader is gone: every later write of the agent's fails with EPIPE
        code = proc.wait(timeout=45)
    finally:
        proc.kill()
    log = next((tmp_path / "runs" / "gone" / "logs").glob("agent-*.log")).read_text()
    assert first.startswith("ddprun: run gone: 1 node(s) x 1 process(es)"), first
    assert code == 0, log
    assert json.loads((tmp_path / "out" / "facts-0.json").read_text())["steps"] == 30, log
    gone = log.index("ddprun: the console went away (BrokenPipeError: [Errno 32] Broken pipe): the job goes on")
    assert "step 30/30" in log[gone:] and "ddprun: report: runs/gone/report.html" in log[gone:], log
    assert "Traceback" not in log, log
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(120)
def test_sigterm_during_a_restart_whose_rendezvous_cannot_complete_ends_the_agent_at_once(nodes, tmp_path):
    """2 x 1 (a fixed --nnodes 2, one restart): the node that does not host the store is killed, so
    the survivor restarts its worker into a rendezvous that can never complete. A scheduler's SIGTERM
    then ends it at once with its line and 143, as during the first rendezvous, instead of a wait for
    --join-timeout (after which a scheduler SIGKILLs it, no line)."""
    job = nodes(2, 1, ["--steps", "600", "--step-s", "0.1"], extra=["--max-restarts", "1", "--join-timeout", "60"])
    job.worker_pids(range(2))
    survivor = job.store_host()
    job.signal(1 - survivor, signal.SIGKILL)
    restarted = re.compile(r"^ddprun: .*restarting the workers \(restart 1 of 1\)$", re.M)
    out = job.finish_one(survivor, timeout=0)
    deadline = time.monotonic() + 30
    while not restarted.search(out.output) and out.returncode is None and time.monotonic() < deadline:
        time.sleep(0.1)  # polling its output for the restart line, bounded
        out = job.finish_one(survivor, timeout=0)
    assert restarted.search(out.output) and out.returncode is None, describe([out])
    sent_at = job.signal(survivor, signal.SIGTERM)
    ended = job.finish_one(survivor, timeout=15)
    assert ended.returncode == 128 + signal.SIGTERM, describe([ended])
    assert "ddprun: stopped by SIGTERM; workers stopped." in ended.output, describe([ended])
    assert "Traceback" not in ended.output and "not every node joined" not in ended.output, describe([ended])
    print(f"SIGTERM during a restart -> the agent exited after {ended.ended_at - sent_at:.1f} s")
    assert ended.ended_at - sent_at < 10, describe([ended])
    finished = job.finish(timeout=5)
    assert finished[1 - survivor].returncode == -signal.SIGKILL, describe(finished)
    assert_nothing_left(tmp_path)
