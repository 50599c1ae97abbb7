"""Processes that die: a worker or an agent killed (SIGKILL: the OOM killer, kill -9), an agent stopped
(SIGTERM, Ctrl-C three times), a rank that raises on the node that hosts the store. Every node must
name the right cause, exit non-zero within seconds, and leave no process behind."""

import os
import re
import signal
import time
from pathlib import Path

import pytest

from ddprun.agent.endpoint import port_open
from tests.faults.conftest import Nodes, assert_nothing_left, describe

pytestmark = pytest.mark.faults

SLOW = ["--step-s", "0.1", "--steps", "600"]
"""A job that trains for a minute unless something ends it."""


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie nobody reaped yet, as under a container's init, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def cause_line(output: str) -> str:
    found = re.findall(r"^ddprun: the job failed: (.*)$", output, re.M)
    return found[0] if found else ""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["store-host", "other"])
def test_a_worker_killed_by_sigkill_is_named_on_every_node(nodes, tmp_path, where):
    job = nodes(2, 1, SLOW)
    pids = job.worker_pids(range(2))
    rank = 0 if where == "store-host" else 1  # node 0's agent (rank 0's) hosts the workers' store
    node_of_rank = job.agent_of(pids[rank])
    killed_at = time.monotonic()
    os.kill(pids[rank], signal.SIGKILL)
    ended = job.finish(timeout=40)
    assert all(e.returncode == 1 for e in ended), describe(ended)
    for e in ended:
        cause = cause_line(e.output)
        assert re.fullmatch(rf"rank {rank} \(node \d, \S+\) was killed by SIGKILL", cause), describe(ended)
        assert "HINT: killed by SIGKILL" in e.output, describe(ended)
        assert "Traceback" not in e.output and "Connection reset" not in cause, describe(ended)
    other = ended[1 - node_of_rank].output
    assert re.search(rf"rank\(s\) {1 - rank} on \S+ were stopped because of it", other), describe(ended)
    last = max(e.ended_at for e in ended) - killed_at
    print(f"SIGKILL of rank {rank} ({where} node) -> last node exited after {last:.1f} s")
    assert last < 15, describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
def test_sigterm_to_one_worker_of_a_loop_with_nothing_to_stop_at_a_step_ends_it_as_without_ddprun(nodes, tmp_path):
    """docs/preemption.md: a process with nothing that stops at a step (neither ddprun.fit nor an
    on_preempt callback) ends at once by the signal, as without ddprun; every node names that rank
    and exits 1, and no node calls it a preemption."""
    job = nodes(2, 1, SLOW)
    pids = job.worker_pids(range(2))
    sent_at = time.monotonic()
    os.kill(pids[1], signal.SIGTERM)
    ended = job.finish(timeout=40)
    assert [e.returncode for e in ended] == [1, 1], describe(ended)
    for e in ended:
        assert re.fullmatch(r"rank 1 \(node \d, \S+\) was killed by SIGTERM", cause_line(e.output)), describe(ended)
        assert "preempt" not in e.output and "Traceback" not in e.output, describe(ended)
    last = max(e.ended_at for e in ended) - sent_at
    print(f"SIGTERM to one worker of a loop with nothing to stop at a step -> last node exited after {last:.1f} s")
    assert last < 15, describe(ended)
    assert_nothing_left(tmp_path)

@pytest.mark.timeout(90)
def test_a_worker_killed_on_a_node_of_two_leaves_its_sibling_stopped_not_failed_or_preempted(nodes, tmp_path):
    """torch stops the killed worker's sibling itself, with SIGTERM, one of the preemption signals:
    the sibling must take it as its agent's stop (no preemption request for the job) and be named as
    stopped because of the kill, not as a rank killed by SIGTERM."""
    job = nodes(2, 2, SLOW)
    pids = job.worker_pids(range(4))
    node = job.agent_of(pids[3])
    sibling = next(r for r in range(3) if job.agent_of(pids[r]) == node)
    os.kill(pids[3], signal.SIGKILL)
    ended = job.finish(timeout=40)
    assert all(e.returncode == 1 for e in ended), describe(ended)
    for e in ended:
        assert re.fullmatch(r"rank 3 \(node \d, \S+\) was killed by SIGKILL", cause_line(e.output)), describe(ended)
        # no preemption request, no line of one (the SIGKILL hint may name a preemption as a possible cause)
        assert "SIGTERM" not in e.output and "preempted" not in e.output, describe(ended)
        assert "asking every rank to stop" not in e.output and "stops after optimizer step" not in e.output
    others = ", ".join(str(r) for r in range(3) if r != sibling)
    assert re.search(rf"rank\(s\) {sibling} on \S+ were stopped because of it", ended[node].output), describe(ended)
    assert re.search(rf"rank\(s\) {others} on \S+ were stopped because of it", ended[1 - node].output), describe(ended)
    for rank in range(3):
        log = (tmp_path / "runs" / "fault" / "logs" / f"rank-{rank}.log").read_text()
        assert "asking every rank to stop" not in log, f"rank {rank} took its stop for a preemption:\n{log}"
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
def test_a_rank_whose_script_ends_while_another_waits_for_it_is_named_by_every_node(nodes, tmp_path):
    """Uneven data: rank 1 trains 5 steps and its script ends (exit 0); rank 0 goes on into the next
    step's all-reduce, and gloo tells it its peer closed the connection. Before: every node named rank
    0's echo (`Connection closed by peer ... typically caused by a remote worker crashing`) as the
    job's cause, and rank 1's node said it finished."""
    job = nodes(2, 1, ["--steps", "60", "--short-rank", "1", "--short-steps", "5"])
    ended = job.finish(timeout=60)
    assert [e.returncode for e in ended] == [1, 1], describe(ended)
    cause = (r"^ddprun: the job failed: rank 1 \(node \d, \S+\) finished first: its script ended \(exit 0\) after 5 "
             r"optimizer steps while another rank still waited for it in a collective\nHINT: every rank must call "
             r"the same collectives: a rank with fewer batches \(uneven data per rank\)")
    for e in ended:
        assert re.search(cause, e.output, re.M), describe(ended)
        assert "finished on this node" not in e.output and "Connection closed by peer" not in cause_line(e.output)
    assert sum("ddprun: this node's ranks ended their script (exit 0), but the job failed:" in e.output
               for e in ended) == 1, describe(ended)
    logs = tmp_path / "runs" / "fault" / "logs"
    assert "rank 1: done after 5 steps" in (logs / "rank-1.log").read_text()
    assert "ddprun: stopped because rank 1 (node" in (logs / "rank-0.log").read_text()
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
def test_a_rank_that_finished_first_on_a_slow_node_is_named_on_that_node_too(nodes, tmp_path):
    """As above, with rank 1's agent stopped for 4 s once rank 1 ended (a loaded node). Rank 0's node
    started first, so it hosts both stores and nothing it does waits for rank 1's agent. It used to
    leave as soon as every rank had a record, taking the store with it, and rank 1's node, which learns
    that the job failed only from that store, then said its run finished (exit 0): seen once beside a
    second test tier. It now stays until that node has read the cause."""
    args = ["--steps", "60", "--short-rank", "1", "--short-steps", "5", "--step-s", "0.2"]
    first = nodes(1, 1, args, nnodes="2")
    deadline = time.monotonic() + 30
    while first.procs[0].poll() is None and time.monotonic() < deadline and not port_open("127.0.0.1", first.port):
        time.sleep(0.05)
    late = nodes(1, 1, args, nnodes="2", port=first.port, name="late")
    assert first.procs[0].pid < late.procs[0].pid  # torch ranks nodes by (address, pid): rank 0 is the first's
    pids = first.worker_pids(range(2))
    assert late.agent_of(pids[1]) == 0, "rank 1 is not the late node's"
    deadline = time.monotonic() + 30
    while running(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.02)
    late.signal(0, signal.SIGSTOP)
    try:
        time.sleep(4)  # past rank 0's wait for an echo's cause (2 s) and its node's exit that used to follow
    finally:
        late.signal(0, signal.SIGCONT)
    ended = first.finish(timeout=60) + late.finish(timeout=30)
    assert [e.returncode for e in ended] == [1, 1], describe(ended)
    for e in ended:
        assert re.search(r"^ddprun: the job failed: rank 1 \(node 1, \S+\) finished first: its script ended "
                         r"\(exit 0\) after 5 optimizer steps", e.output, re.M), describe(ended)
        assert "finished on this node" not in e.output, describe(ended)
    assert "ddprun: this node's ranks ended their script (exit 0), but the job failed:" in ended[1].output, \
        describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(120)
def test_a_killed_rank_of_fit_leaves_no_dataloader_worker_or_forkserver(tmp_path):
    """A rank of ddprun.fit with DataLoader workers is SIGKILLed (the OOM killer): its forkserver and
    their workers end with it (they hold each other up: torch's worker waits while its parent, the
    forkserver, lives, and the forkserver while a worker holds its pipe)."""
    fit = str(Path(__file__).parents[1] / "multiprocess" / "scripts" / "fit_restart.py")
    job = Nodes(tmp_path, 2, 1, ["--out", str(tmp_path / "out"), "--steps", "60", "--step-sleep", "0.1",
                                 "--kill-rank", "1", "--kill-step", "3", "--num-workers", "1"],
                extra=["--log-dir", str(tmp_path / "runs")], script=fit)
    ended = job.finish(timeout=60)
    assert all(e.returncode == 1 for e in ended), describe(ended)
    for e in ended:
        assert re.fullmatch(r"rank 1 \(node \d, \S+\) was killed by SIGKILL", cause_line(e.output)), describe(ended)
        assert "fit loads the data in the training process" not in e.output, "a guarded script keeps its workers"
    assert_nothing_left(tmp_path, within_s=10)  # a worker notices its forkserver's end within 5 s


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["store-host", "other"])
def test_an_agent_killed_by_sigkill_takes_its_workers_and_is_named_by_the_others(nodes, tmp_path, where):
    job = nodes(2, 1, SLOW)
    pids = job.worker_pids(range(2))
    host = job.agent_of(pids[0])  # node 0's agent hosts the workers' store
    victim = host if where == "store-host" else 1 - host
    orphan = next(pid for pid in pids.values() if job.agent_of(pid) == victim)
    killed_at = job.signal(victim, signal.SIGKILL)
    ended = job.finish(timeout=40)
    survivor = ended[1 - victim]
    assert ended[victim].returncode == -signal.SIGKILL and survivor.returncode == 1, describe(ended)
    cause = cause_line(survivor.output)
    if where == "store-host":  # the store died with it: the survivor says which node is gone
        assert re.fullmatch(r"the node hosting the job store was lost: the job store at \S+:\d+ stopped "
                            r"answering.*", cause), describe(ended)
    else:
        assert re.fullmatch(r"node \d \(\S+\) was lost: its agent stopped answering.*", cause), describe(ended)
    assert "frame #" not in survivor.output and "Traceback" not in survivor.output, describe(ended)
    last = survivor.ended_at - killed_at
    print(f"SIGKILL of the {where} agent -> survivor exited after {last:.1f} s")
    assert last < 15, describe(ended)
    assert_nothing_left(tmp_path)  # the killed agent's worker went with it (PR_SET_PDEATHSIG)
    assert not running(orphan), "the killed agent's worker outlived it"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["neither-store", "endpoint-store", "workers-store"])
def test_a_frozen_agent_is_named_lost_and_its_workers_end_while_it_stays_frozen(nodes, tmp_path, where):
    """SIGSTOP of an agent (3 nodes: one hosts neither the endpoint's store nor the workers'; the
    endpoint's host; rank 0's, which hosts the workers' store): the others name it lost and end, and
    its workers, whose node store no longer answers (torch's TCPStore client would wait for it for
    ever), end too, while it stays frozen."""
    job = nodes(3, 1, SLOW)  # torch's 30 s --stop-grace: no stop of the survivors may wait it out
    pids = job.worker_pids(range(3))
    endpoint, workers_store = job.store_host(), job.agent_of(pids[0])
    victim = {"endpoint-store": endpoint, "workers-store": workers_store}.get(where)
    if victim is None:
        victim = ({0, 1, 2} - {endpoint, workers_store}).pop()
    frozen_worker = next(pid for pid in pids.values() if job.agent_of(pid) == victim)
    stopped_at = job.signal(victim, signal.SIGSTOP)
    try:
        others = [job.finish_one(i, timeout=40) for i in range(3) if i != victim]
        deadline = time.monotonic() + 20
        while running(frozen_worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker_gone = not running(frozen_worker)
        print(f"SIGSTOP of an agent ({where}) -> the others exited after "
              f"{max(o.ended_at for o in others) - stopped_at:.1f} s, its worker "
              f"{'ended' if worker_gone else 'still ran'} after {time.monotonic() - stopped_at:.1f} s")
    finally:
        job.signal(victim, signal.SIGCONT)
    ended = job.finish(timeout=30)
    for o in others:
        assert o.returncode == 1, describe(ended)
        # its heartbeat stopped; or, where it hosted the workers' store too, that store stopped answering
        lost = rf"node {victim} \(\S+\) was lost: its agent stopped answering.*" + (
            r"|the node hosting the job store was lost: the job store at \S+ stopped answering.*"
            if where != "neither-store" else "")
        assert re.fullmatch(lost, cause_line(o.output)), describe(ended)
        assert o.ended_at - stopped_at < 25, describe(ended)
    assert worker_gone, "the frozen agent's worker did not end:\n" + describe(ended)
    assert ended[victim].returncode == 1, describe(ended)  # thawed, it reports what its worker said
    assert "Traceback" not in ended[victim].output, describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("ignore", "rank"), [(False, 1), (True, 1), (False, 0)],
                         ids=["worker-stops", "worker-ignores-sigterm", "store-host-worker-stops"])
def test_sigterm_to_an_agent_stops_its_workers_and_the_others_name_that_node(nodes, tmp_path, ignore, rank):
    """rank 0's node hosts the workers' store, and with it the record of its stop: it stays up until
    the other node read it (AgentFailures.linger), which then names it, not a lost store."""
    job = nodes(2, 1, SLOW + (["--ignore-sigterm"] if ignore else []), extra=["--stop-grace", "3"])
    pids = job.worker_pids(range(2))
    victim = job.agent_of(pids[rank])
    sent_at = job.signal(victim, signal.SIGTERM)
    ended = job.finish(timeout=40)
    stopped, other = ended[victim], ended[1 - victim]
    assert stopped.returncode == 128 + signal.SIGTERM and other.returncode == 1, describe(ended)
    assert "ddprun: stopped by" in stopped.output and "SIGTERM" in stopped.output, describe(ended)
    assert re.fullmatch(r"node \d \(\S+\) was stopped by SIGTERM: its agent got SIGTERM and stopped its workers",
                        cause_line(other.output)), describe(ended)
    last = max(e.ended_at for e in ended) - sent_at
    print(f"SIGTERM to an agent ({'worker ignores it' if ignore else 'worker stops'}) -> last exit after {last:.1f} s")
    assert last < (3 + 12 if ignore else 12), describe(ended)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
def test_three_ctrl_c_to_an_agent_leave_no_worker_even_one_that_ignores_sigterm(nodes, tmp_path):
    job = nodes(1, 2, SLOW + ["--ignore-sigterm"])
    job.worker_pids(range(2))
    for _ in range(3):
        job.signal(0, signal.SIGINT)
        time.sleep(0.3)
    # an impatient user goes on pressing it until the launcher is gone: whatever phase it hits (the
    # workers' stop, the summary, the report), no traceback
    deadline = time.monotonic() + 30
    while job.procs[0].poll() is None and time.monotonic() < deadline:
        job.signal(0, signal.SIGINT)
        time.sleep(0.1)
    (ended,) = job.finish(timeout=40)
    assert ended.returncode == 128 + signal.SIGINT, describe([ended])  # whichever phase the last one hit
    assert "Traceback" not in ended.output and "SignalException" not in ended.output, describe([ended])
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_raises_is_named_by_every_node_also_when_its_node_hosts_the_store(nodes, tmp_path, rank):
    # rank 0's node hosts the workers' store, and then ends first
    job = nodes(2, 1, ["--step-s", "0.05", "--raise-rank", str(rank)])
    ended = job.finish(timeout=60)
    assert all(e.returncode == 1 for e in ended), describe(ended)
    for e in ended:
        assert re.fullmatch(rf"rank {rank} \(node \d, \S+\) failed: RuntimeError: injected failure on rank {rank}",
                            cause_line(e.output)), describe(ended)
        assert not re.search(r"^ddprun: rendezvous at \S+ failed", e.output, re.M), describe(ended)
    # its traceback once, on its own node's console (rank 0's output, another rank's last log lines), no echo's
    assert sum(e.output.count("Traceback") for e in ended) == 1, describe(ended)
    log = (tmp_path / "runs" / "fault" / "logs" / f"rank-{rank}.log").read_text()
    assert log.count("Traceback") == 1 and f"RuntimeError: injected failure on rank {rank}" in log, log


@pytest.mark.timeout(90)
def test_a_node_lost_after_the_others_ranks_finished_fails_the_job_on_every_other_node(nodes, tmp_path):
    """2 x 1: the rank on the node that does not host the endpoint's store (the exit barrier) goes on
    alone after the other rank ended its script (exit 0); its agent is then killed. The other node,
    waiting for it at the end, names it lost and exits 1, instead of 0 (the job never finished)."""
    script = str(Path(__file__).parent / "scripts" / "linger_rank.py")
    job = nodes(2, 1, [str(tmp_path / "pids")], script=script)
    pids = job.worker_pids(range(2))
    survivor = job.store_host()
    victim = 1 - survivor
    lingering = next(rank for rank, pid in pids.items() if job.agent_of(pid) == victim)
    (tmp_path / "pids" / "linger").write_text(str(lingering))
    deadline = time.monotonic() + 30
    while running(pids[1 - lingering]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pids[1 - lingering]), job.describe()
    killed_at = job.signal(victim, signal.SIGKILL)
    out = job.finish_one(survivor, timeout=40)
    ended = job.finish(timeout=5)
    assert out.returncode == 1 and ended[victim].returncode == -signal.SIGKILL, describe(ended)
    assert "this node's ranks ended their script (exit 0), but the job failed:" in out.output, describe(ended)
    assert re.fullmatch(rf"node {victim} \(\S+\) was lost: its agent stopped answering.*|the node hosting the job "
                        r"store was lost: the job store at \S+ stopped answering.*", cause_line(out.output)), \
        describe(ended)
    print(f"a node lost after the other's ranks finished -> the other exited after {out.ended_at - killed_at:.1f} s")
    assert out.ended_at - killed_at < 30, describe(ended)
    assert_nothing_left(tmp_path)
