"""The agent's failure records across restarts (agent/failures.py), on a real TCPStore."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from ddprun.agent.failures import AgentFailures
from ddprun.protocol import failure as fr
from ddprun.protocol.rundir import RunDir
from ddprun.protocol.store import Keys
from tests.helpers import preconnected, store_client, store_server

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def store():
    return store_server()


@pytest.fixture
def agent(tmp_path, store):
    """Node 0's AgentFailures in attempt r1 of a 2-node job, its console, stopped afterwards."""
    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", out,
                      connect=preconnected(store.port))
    a.on_workers_started("r1", 0, 2, {0: (0, 0, ""), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", store.port), last_attempt=False)
    yield a, out
    a.stop()


@pytest.fixture
def stand_in():
    """Starts a Python child standing in for a worker (default: it sleeps 30 s); each one is killed and
    reaped at teardown."""
    started: list[subprocess.Popen] = []

    def start(code: str = "import time; time.sleep(30)", **popen) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", code], **popen))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait(5)


def publish(store, attempt: str, rec: fr.FailureRecord) -> None:
    keys = Keys(f"ddprun/job/{attempt}/")
    store.set(keys.failure(int(store.add(keys.failures, 1))), rec.to_json())


def killed(rank: int, node: int) -> fr.FailureRecord:
    return fr.from_exit(rank, -9, node_rank=node, host=f"host-{node}", local_rank=rank % 2, t=time.time())


def test_a_restart_names_the_rank_that_failed_on_another_node_and_its_attempt_forgets_it(agent, store):
    a, out = agent
    publish(store, "r1", killed(3, 1))
    a.on_restarting(0, 1)
    # its log as the restart keeps it, under this attempt's id (agent/logs.py keep_as_attempt)
    assert out.getvalue() == ("ddprun: rank 3 (node 1, host-1) was killed by SIGKILL (its log: "
                              "logs/rank-3.attempt-r1.log on host-1); restarting the workers (restart 1 of 1)\n")
    # the new attempt (the last one) must not inherit the old cause: it would stop its workers
    a.on_workers_started("r2", 0, 2, {0: (0, 0, ""), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", store.port), last_attempt=True)
    assert a.root_cause() is None and a.records() == []


def test_a_restart_waits_for_the_first_hand_record_when_it_knows_only_an_echo(agent, store):
    a, out = agent
    publish(store, "r1", fr.FailureRecord(fr.ERROR, 0, "RuntimeError: Connection closed by peer [1.2.3.4]:5",
                                          0, "host-a", 0, t=time.time()))
    late = threading.Timer(0.5, publish, (store, "r1", killed(2, 1)))
    late.start()
    t0 = time.monotonic()
    a.on_restarting(1, 2)
    late.join()
    assert "ddprun: rank 2 (node 1, host-1) was killed by SIGKILL" in out.getvalue(), out.getvalue()
    assert "(restart 1 of 2)" in out.getvalue() and time.monotonic() - t0 < 2.5


def beating(store, attempt: str, node: int, every_s: float = 0.5) -> threading.Event:
    """Node ``node``'s agent beats in ``attempt`` (a daemon thread) until the returned event is set."""
    stop, key = threading.Event(), Keys(f"ddprun/job/{attempt}/").agent(node)

    def beat():
        i = 0
        while not stop.wait(every_s if i else 0):
            i += 1
            store.set(key, json.dumps({"host": f"host-{node}", "beat": i}))
    threading.Thread(target=beat, daemon=True).start()
    return stop


def test_a_restart_with_nothing_known_says_so_within_its_bound(agent, store):
    a, out = agent
    stop = beating(store, "r1", 1)  # the other node is alive
    t0 = time.monotonic()
    try:
        a.on_restarting(2, 3)
    finally:
        stop.set()
    assert out.getvalue() == "ddprun: a worker failed; restarting the workers (restart 1 of 3)\n"
    assert time.monotonic() - t0 < 5


def echo(rank: int, node: int) -> fr.FailureRecord:
    return fr.FailureRecord(fr.ERROR, rank, "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:47829: Connection "
                            "reset by peer", node, f"host-{node}", 0, t=time.time())


def test_a_restart_that_knows_only_an_echo_names_the_node_whose_agent_stopped_beating(agent, store):
    """A node's agent died with its workers (kill -9, the machine went down): no record of its ranks
    comes, and this node's ranks saw only their peers' connections close. The restart line names that
    node, not this node's rank that saw the reset (as it did)."""
    a, out = agent
    store.set(Keys("ddprun/job/r1/").agent(1), json.dumps({"host": "host-b", "beat": 7}))  # its last beat
    publish(store, "r1", echo(0, 0))
    t0 = time.monotonic()
    a.on_restarting(0, 1)
    assert out.getvalue() == ("ddprun: node 1 (host-b) was lost: its agent stopped answering; restarting the "
                              "workers (restart 1 of 1)\n"), out.getvalue()
    assert time.monotonic() - t0 < 5  # within the wait for a first-hand record that was there already


def test_a_restart_that_knows_only_an_echo_names_the_workers_store_host_when_it_refuses(tmp_path):
    """Group rank 0's node, which hosts the workers' store, died with its workers: that store refuses
    connections. The restart line names it at once, not this node's rank that saw the reset."""
    import gc

    server = store_server()
    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-b", "127.0.0.1", server.port, "job", out,
                      connect=preconnected(server.port))
    a.on_workers_started("r1", 1, 2, {1: (0, 0, "")}, world_size=2, store=("127.0.0.1", server.port),
                         last_attempt=False)
    try:
        publish(server, "r1", echo(1, 1))
        a._read_records(a._client(), a._keys, every=True)
        port = server.port
        del server
        gc.collect()  # the server's socket closes: its port refuses
        from ddprun.agent.endpoint import port_open

        assert not port_open("127.0.0.1", port)
        t0 = time.monotonic()
        a.on_restarting(0, 1)
        assert out.getvalue() == (f"ddprun: the node hosting the job store was lost: the job store at 127.0.0.1:{port} "
                                  "stopped answering; restarting the workers (restart 1 of 1)\n"), out.getvalue()
        assert time.monotonic() - t0 < 2
    finally:
        a.stop()


def test_node_0_waits_until_every_node_said_its_line_and_no_longer_than_its_bound(agent, store, tmp_path):
    """Before a requeue (SLURM then kills every step at once): node 1 marks, node 0 sees both marks."""
    a, _ = agent
    other = AgentFailures(RunDir(str(tmp_path)), "host-b", "127.0.0.1", store.port, "job", io.StringIO(),
                          connect=preconnected(store.port))
    other.on_workers_started("r1", 1, 2, {2: (0, 0, ""), 3: (1, 0, "")}, world_size=4,
                             store=("127.0.0.1", store.port))
    a.mark_said()
    t0 = time.monotonic()
    assert not a.wait_all_said(0.3)  # node 1 has not said its line
    assert 0.25 < time.monotonic() - t0 < 3
    threading.Timer(0.2, other.mark_said).start()
    assert a.wait_all_said(5)
    other.stop()


def test_a_rendezvous_endpoint_that_refuses_is_named_as_the_lost_store_not_the_workers_store(agent, store):
    """An elastic job's workers' store is group rank 0's own; the rendezvous store may be another node's.
    When torch's agent fails to reach the endpoint, that endpoint's node is the cause."""
    from ddprun.agent.endpoint import free_port

    a, _ = agent
    assert a.endpoint_gone("127.0.0.1", store.port) == []  # it answers
    closed = free_port("127.0.0.1")
    (rec,) = a.endpoint_gone("127.0.0.1", closed)
    assert rec.kind == fr.LOST and rec.rank == -1 and not rec.is_echo
    assert rec.headline() == f"the node hosting the job store was lost: the job store at 127.0.0.1:{closed} stopped answering"
    echo = fr.FailureRecord(fr.ERROR, 0, "RuntimeError: [gloo] Connection reset by peer", 0, "host-a", t=time.time() - 1)
    assert fr.root_cause([echo, rec]) == rec  # the worker's earlier echo is not the cause


def test_a_node_whose_agent_never_beat_in_this_attempt_is_named_lost_with_its_host(agent, store):
    """kill -9 of an agent right after its workers started, before its first heartbeat: the probe
    (a failure whose only record is an echo) still names that node, its host read from its ranks' rows."""
    import json

    a, _ = agent
    keys = Keys("ddprun/job/r1/")
    store.set(keys.rank(2), json.dumps({"rank": 2, "node_rank": 1, "host": "host-b"}))
    t0 = time.monotonic()
    (lost,) = a.probe_lost(wait_s=0.2)
    took = time.monotonic() - t0
    assert lost.headline() == "node 1 (host-b) was lost: its agent stopped answering", lost.headline()
    # not before a live agent would have beaten (its workers start within torch's 1 s rendezvous poll)
    from ddprun.agent.failures import FIRST_BEAT_S

    assert FIRST_BEAT_S - 0.5 < took < FIRST_BEAT_S + 2, took


def test_a_node_whose_agent_beats_is_not_lost(agent, store):
    import json

    a, _ = agent
    keys = Keys("ddprun/job/r1/")
    beats = [threading.Timer(t, store.set, (keys.agent(1), json.dumps({"host": "host-b", "beat": i})))
             for i, t in enumerate((0.0, 1.0, 2.0, 3.0))]
    for b in beats:
        b.start()
    assert a.probe_lost(wait_s=1.5) == []
    for b in beats:
        b.join()


def test_probing_300_beating_nodes_takes_a_few_store_calls_not_two_a_node(tmp_path, store):
    # every surviving node probes at once after a node's loss: at 1,000 nodes one check a node each
    # would be two million calls on the job's store just when the failure is to be named
    import json

    from tests.helpers import Counting

    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", io.StringIO(),
                      connect=preconnected(store.port))
    a.on_workers_started("r1", 0, 300, {0: (0, 0, "")}, world_size=300, store=("127.0.0.1", store.port),
                         last_attempt=False)
    keys = Keys("ddprun/job/r1/")
    try:
        beat = [0]

        def beat_all():
            beat[0] += 1
            for n in range(1, 300):
                store.set(keys.agent(n), json.dumps({"host": f"host-{n}", "beat": beat[0]}))

        beat_all()
        timer = threading.Timer(0.4, beat_all)
        timer.start()
        client = a._client()  # the agent's own thread beats with the same client meanwhile

        def client_of_this_thread():
            return counted if threading.get_ident() == me else client

        me, counted = threading.get_ident(), Counting(client)
        a._client = client_of_this_thread
        assert a.probe_lost(wait_s=1.0) == []
        timer.join()
        assert counted.calls == ["check", "multi_get", "check", "multi_get"], counted.calls
    finally:
        a.stop()


def test_the_ring_watch_names_a_neighbour_that_never_beat(tmp_path, store):
    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", out, lost_after_s=1.0,
                      connect=preconnected(store.port))
    a.on_workers_started("r1", 0, 2, {0: (0, 0, ""), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", store.port), last_attempt=False)
    deadline = time.monotonic() + 5
    while a.lost is None and time.monotonic() < deadline:
        time.sleep(0.1)
    a.stop()
    assert a.lost is not None and a.lost.headline().startswith("node 1 (?) was lost: its agent stopped answering for")


def test_a_node_that_joins_an_elastic_job_is_not_lost_before_its_first_beat(tmp_path, store):
    """--nnodes 1:2: node 0 ran alone for longer than lost_after, then node 1 joined. The watch of
    node 1's heartbeat counts from the new attempt's start, not from when node 0's thread began
    (which named node 1 lost at node 0's first look, before node 1 could beat, and ended the job)."""
    import json

    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", out, lost_after_s=2.5,
                      connect=preconnected(store.port))
    a.on_workers_started("r1", 0, 1, {0: (0, 0, "")}, world_size=1, store=("127.0.0.1", store.port))
    time.sleep(3.0)  # alone: no neighbour to watch
    a.on_workers_started("r2", 0, 2, {0: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port))
    keys = Keys("ddprun/job/r2/")
    beats = [threading.Timer(t, store.set, (keys.agent(1), json.dumps({"host": "host-b", "beat": i})))
             for i, t in enumerate((1.0, 1.5, 2.0, 2.5))]  # node 1's first beat after node 0's first look (0.5 s)
    for b in beats:
        b.start()
    for b in beats:
        b.join()
    time.sleep(0.4)
    a.stop()
    assert a.lost is None, a.lost.headline()


def test_a_lost_store_stops_a_worker_that_ignores_sigterm_after_the_stop_grace(tmp_path, stand_in):
    """The store's host is gone: torch's agent sees healthy workers, so this thread stops them; one
    that ignores SIGTERM is killed --stop-grace later instead of running on to its collective timeout."""
    from ddprun.agent.failures import kill_children

    worker = stand_in("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "print('ready', flush=True); time.sleep(60)", stdout=subprocess.PIPE)
    assert worker.stdout.readline() == b"ready\n"

    def gone():
        raise ConnectionRefusedError("the store's host is gone")

    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", 1, "job", out, lost_after_s=1.0,
                      connect=gone, stop_grace_s=1.0)
    t0 = time.monotonic()
    a.on_workers_started("r1", 1, 2, {1: (0, worker.pid, "")}, world_size=2)
    try:
        code = worker.wait(timeout=10)
    finally:
        a.stop()
    assert code == -signal.SIGKILL and 2.0 <= time.monotonic() - t0 < 6, (code, time.monotonic() - t0)
    assert "the job store at 127.0.0.1:1 stopped answering for 1 s; stopping this node's workers" in out.getvalue()
    assert kill_children([worker.pid, 1], signal.SIGKILL) == []  # reaped, and not our child: nothing sent
    # 0 and -1 are no worker's pid but this process group and every process: neither is ever signalled
    assert kill_children([0, -1], signal.SIGTERM) == []


def test_an_error_of_the_watch_itself_is_said_once_and_never_names_the_store_lost(tmp_path, store, stand_in):
    """A tick that raises what no unreachable store raises (here its relay raises a TypeError, as a
    renamed method or an unreadable value would) is said once, with its traceback; the store, which
    answers, is not named lost after lost_after, and the healthy worker is not stopped."""
    from ddprun.agent.noderelay import NodeRelay

    class BrokenRelay(NodeRelay):
        calls = 0

        def mirror(self, *args, **kwargs):
            self.calls += 1  # a message that differs at each tick is still one error, said once
            raise TypeError(f"mirror() takes 5 positional arguments but 6 were given (call {self.calls})")

    worker = stand_in()
    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", out, lost_after_s=0.5,
                      connect=preconnected(store.port), relay=BrokenRelay(store_server()), stop_grace_s=0.5)
    a.on_workers_started("r1", 0, 1, {0: (0, worker.pid, "")}, world_size=1, store=("127.0.0.1", store.port))
    try:
        time.sleep(2.5)  # five ticks, each failing, past lost_after and the stop grace
        assert worker.poll() is None, "a healthy worker was stopped for the watch's own error"
        assert a.lost is None, a.lost.headline()
    finally:
        a.stop()
    said = out.getvalue()
    assert said.count("failure watch hit an error of its own (TypeError: mirror() takes 5") == 1, said
    assert "(call 1)" in said
    assert "Traceback" in said and "in mirror" in said and "stopped answering" not in said, said



def test_every_stop_of_the_workers_is_marked_in_the_node_store_first(tmp_path, stand_in):
    """A lost job store, and torch's own stops (mark_stopping), mark this node's stop where its workers'
    signal thread reads it (worker/signals.py): the job store, gone silent, is never asked."""
    from ddprun.agent.noderelay import NodeRelay

    node = store_server()
    worker = stand_in()

    def gone():
        raise ConnectionRefusedError("the store's host is gone")

    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", 1, "job", io.StringIO(), lost_after_s=1.0,
                      connect=gone, relay=NodeRelay(node), stop_grace_s=1.0)
    a.on_workers_started("r1", 1, 2, {1: (0, worker.pid, "")}, world_size=2)
    try:
        assert worker.wait(timeout=10) == -signal.SIGTERM
        assert node.check([Keys("ddprun/job/r1/").stopping(1)])
        a.on_workers_started("r2", 1, 2, {1: (0, stand_in().pid, "")}, world_size=2)
        assert not node.check([Keys("ddprun/job/r2/").stopping(1)])
        a.mark_stopping()  # torch's agent is about to signal them
        assert node.check([Keys("ddprun/job/r2/").stopping(1)])
    finally:
        a.stop()


def test_a_worker_whose_error_file_was_lost_is_named_by_the_record_it_handed_its_node(tmp_path, store):
    """A full disk under the run directory loses the worker's error file, and the job store may be
    gone with its host (node 0 ended first): the copy in the node store is the worker's own record,
    not the agent's "ended without a Python error"."""
    from ddprun.agent.noderelay import NodeRelay
    from ddprun.worker.channel import JobChannel

    relay = NodeRelay(store_server())
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", 1, "job", io.StringIO(), relay=relay,
                      connect=lambda: (_ for _ in ()).throw(ConnectionError("the job store's host is gone")))
    a.on_workers_started("r1", 0, 2, {0: (0, 0, ""), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", 1), last_attempt=False)
    try:
        # the worker side: rank 1's channel hands its record over before the job's store (which is gone)
        env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
               "TORCHELASTIC_RUN_ID": "job", "DDPRUN_ATTEMPT": "r1"}
        ch = JobChannel(env, WorkerEnvStub(), connect=lambda: DeadStore(), connect_node=lambda: relay._store)
        assert ch.keys.prefix == Keys("ddprun/job/r1/").prefix
        mine = ch.me(fr.ERROR, "OSError: [Errno 28] No space left on device")
        ch.record_failure(mine)
        a.on_worker_exit(1, 1, pid=0, code=1)  # its error file ("") was never written
        assert a.local_record(1) == mine and a.root_cause() == mine
        assert not (tmp_path / "failures").exists()  # nothing made up was written for it
        # a worker that left nothing anywhere is still the agent's own record of its exit code
        a.on_worker_exit(0, 0, pid=0, code=1)
        assert a.local_record(0).summary == "the process ended without a Python error"
        assert a.local_record(0).by == "agent"
    finally:
        a.stop()


def breakable(store, broken: threading.Event):
    """A ``connect`` whose clients are ``store`` until ``broken`` is set, then raise as a store whose host
    went away."""
    class Breakable:
        def __getattr__(self, name):
            if broken.is_set():
                raise ConnectionResetError("the job store's host is gone")
            return getattr(store, name)
    return Breakable


def stopped_host(released: threading.Event):
    """A ``connect`` whose clients take every call and answer none (a stopped host) until ``released``."""
    class StoppedHost:
        def __getattr__(self, name):
            return lambda *a, **kw: released.wait(30)
    return StoppedHost


class WorkerEnvStub:
    run_dir, device_kind, node_store = "", "cpu", ""


class DeadStore:
    def __getattr__(self, name):
        raise ConnectionError("the job store's host is gone")


def test_a_time_the_agent_itself_was_stopped_is_not_taken_for_the_stores_silence(tmp_path, store, monkeypatch,
                                                                                stand_in):
    """The agent was stopped (SIGSTOP) for 20 s between two ticks, and the store's host went away
    meanwhile: the store is named lost only after its ticks have failed for lost_after (1 s here),
    not on the first failing tick after the thaw, and the line gives that time, not the freeze's."""
    from types import SimpleNamespace

    from ddprun.agent import failures as failures_mod

    offset, broken = [0.0], threading.Event()
    monkeypatch.setattr(failures_mod, "time", SimpleNamespace(
        monotonic=lambda: time.monotonic() + offset[0], time=time.time, sleep=time.sleep))

    worker = stand_in()
    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", out, lost_after_s=1.0,
                      connect=breakable(store, broken), stop_grace_s=1.0)
    a.on_workers_started("r1", 0, 1, {0: (0, worker.pid, "")}, world_size=1)
    try:
        time.sleep(1.2)  # ticks that answer
        assert a.lost is None
        offset[0], thawed = 20.0, time.monotonic()
        broken.set()
        while time.monotonic() - thawed < 0.8:
            assert a.lost is None, out.getvalue()  # the old count: lost at the first failing tick
            time.sleep(0.05)
        code = worker.wait(timeout=5)
    finally:
        a.stop()
    assert code == -signal.SIGTERM and a.lost is not None
    assert "the job store at 127.0.0.1:" in out.getvalue() and "stopped answering for 1 s" in out.getvalue()


def test_a_signal_after_a_worker_died_does_not_rename_that_death(agent, store):
    """A worker was SIGKILLed (its agent recorded it) and then the agent got SIGTERM: the other
    workers are recorded as stopped by the SIGTERM, the dead one keeps its own cause."""
    a, _ = agent
    a.on_worker_exit(0, 0, pid=0, code=-9)
    a.on_signal(15)
    keys = Keys("ddprun/job/r1/")
    published = [fr.FailureRecord.from_json(store.get(keys.failure(i)))
                 for i in range(1, int(store.add(keys.failures, 0)) + 1)]
    by_rank = {rec.rank: rec for rec in published}
    assert by_rank[0].kind == fr.SIGNAL and by_rank[0].signal == "SIGKILL", by_rank[0]
    assert by_rank[1].kind == fr.STOPPED and by_rank[-1].signal == "SIGTERM", published
    assert [rec.rank for rec in published].count(0) == 1


def test_a_stopped_store_is_named_lost_after_lost_after_not_after_a_last_try_to_reach_it(tmp_path, monkeypatch,
                                                                                          stand_in):
    """The store's host is stopped (its calls never return; each is given up after STORE_CALL_S, and a
    new connection is tried STORE_CALL_S after that): the store is named lost once lost_after has
    passed since its first failing tick, not once the try that straddles that moment gives up too
    (STORE_CALL_S later). Scaled: STORE_CALL_S 2 s, lost_after 4 s, beats of 0.2 s."""
    from ddprun.agent import failures as failures_mod

    monkeypatch.setattr(failures_mod, "STORE_CALL_S", 2.0)
    monkeypatch.setattr(failures_mod, "BEAT_S", 0.2)
    stopped = threading.Event()

    worker = stand_in()
    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", 1, "job", out, lost_after_s=4.0,
                      connect=stopped_host(stopped), stop_grace_s=1.0)
    t0 = time.monotonic()
    a.on_workers_started("r1", 0, 1, {0: (0, worker.pid, "")}, world_size=1)
    try:
        while a.lost is None and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        named_after = time.monotonic() - t0
    finally:
        stopped.set()
        a.stop()
    assert a.lost is not None and 4.0 <= named_after < 5.0, (named_after, out.getvalue())


def test_a_new_attempt_after_a_lost_store_is_not_stopped_for_the_old_stores_loss(tmp_path, store, stand_in):
    """Elastic: the workers' store's host died, its loss stopped this node's workers, and torch formed
    a new round whose store answers (a new group rank 0 hosts it). The new attempt's workers train on:
    the thread used to stay given up and keep its failing time, so it named the store lost again at
    once, and again at every restart."""
    broken = threading.Event()
    broken.set()

    first, second = stand_in(), stand_in()
    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", out, lost_after_s=1.0,
                      connect=breakable(store, broken), stop_grace_s=1.0)
    a.on_workers_started("r1", 0, 1, {0: (0, first.pid, "")}, world_size=1)
    try:
        assert first.wait(timeout=10) == -signal.SIGTERM and a.lost is not None, out.getvalue()
        broken.clear()  # the new round's store answers
        a.on_workers_started("r2", 0, 1, {0: (0, second.pid, "")}, world_size=1)
        time.sleep(2.5)  # more than twice lost_after: the old code stopped it within one tick
        assert second.poll() is None and a.lost is None, out.getvalue()
    finally:
        a.stop()
    assert out.getvalue().count("stopping this node's workers") == 1, out.getvalue()


def test_the_agreed_stop_step_is_read_on_demand_before_a_beat_reads_it(agent, store):
    from ddprun.protocol import preempt as pp

    a, _ = agent
    keys = Keys("ddprun/job/r1/")
    assert a.read_preempt_stop() is None  # no request: nothing to read
    a.preempt_request = pp.Request("SIGTERM", "agent", 1, "host-b", time.time())
    assert a.read_preempt_stop() is None  # asked, not answered
    # a rank answered as the workers do (compare_set waits for the reply; a set from another client
    # may reach the server after this agent's next read); no beat has read it
    store.compare_set(keys.preempt_stop, "", pp.NO_STEP)
    assert a.read_preempt_stop() == pp.NO_STEP and a.preempt_stop == pp.NO_STEP
    store.set(keys.preempt_stop, "35")  # once read, the answer is kept (the workers set it once: compare_set)
    assert a.read_preempt_stop() == pp.NO_STEP
    a.on_workers_started("r2", 0, 2, {0: (0, 0, ""), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", store.port), last_attempt=False)
    assert a.preempt_request is None and a.preempt_stop is None  # the last attempt's: not this one's


def test_the_request_is_read_on_demand_before_a_beat_reads_it(agent, store):
    """Before the exit barrier the agent reads the request itself: a beat reads it only when the alarm
    moves, and workers that ended within that beat left it unread (CI: a node said 'rank 0 did not say
    at which step' and exited 75 while its peer finished and exited 0)."""
    from ddprun.protocol import preempt as pp

    a, _ = agent
    keys = Keys("ddprun/job/r1/")
    assert a.read_preempt_request() is None  # none asked
    deadline = time.monotonic() + 5
    while a._alarm == -1 and time.monotonic() < deadline:  # the first beat reads everything once
        time.sleep(0.05)
    req = pp.Request("SIGTERM", "rank 1", 1, "host-b", time.time())
    store.compare_set(keys.preempt, "", req.to_json())  # the alarm not raised: no beat reads it
    time.sleep(0.6)  # beats pass
    assert a.preempt_request is None
    assert a.read_preempt_request() == req and a.preempt_request == req
    a.on_workers_started("r2", 0, 2, {0: (0, 0, ""), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", store.port), last_attempt=False)
    assert a.read_preempt_request() is None  # the last attempt's request: not this one's


def test_an_oom_kill_is_evidence_only_for_a_sigkill_of_its_own_attempt(agent, store, monkeypatch):
    """The cgroup's oom_kill count is read at each attempt's start: a kill in attempt r1 does not make
    a later SIGKILL (a scheduler, a user) an out-of-memory kill in r2, and a count that was read and
    stayed says it was not one; only a count that cannot be read leaves the question open."""
    a, _ = agent
    kills = iter([1, 1, 1, 2, None, None])
    monkeypatch.setattr("ddprun.cgroups.oom_kills", lambda: next(kills))
    a.on_workers_started("r2", 0, 2, {0: (0, 0, ""), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", store.port), last_attempt=True)  # r1's kill counted: 1
    a.on_worker_exit(1, 1, 0, -signal.SIGKILL)  # still 1: not an OOM kill
    hint = a.local_record(1).hint
    assert hint.startswith("killed by SIGKILL, not by the out-of-memory killer (the cgroup's oom_kill count stayed "
                           "1): a scheduler that ended the job"), hint
    assert "out-of-memory killer?" not in hint, hint
    a.on_workers_started("r3", 0, 2, {0: (0, 0, ""), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", store.port), last_attempt=True)
    a.on_worker_exit(1, 1, 0, -signal.SIGKILL)  # 1 -> 2 in this attempt
    assert a.local_record(1).hint.startswith("the out-of-memory killer ended it (the cgroup's oom_kill count went "
                                             "1 -> 2)"), a.local_record(1).hint
    a.on_workers_started("r4", 0, 2, {0: (0, 0, ""), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", store.port), last_attempt=True)
    a.on_worker_exit(1, 1, 0, -signal.SIGKILL)  # no count to read (no memory controller): only the question
    assert a.local_record(1).hint == fr.SIGKILL_HINT


def test_after_a_network_outage_shorter_than_the_lost_bound_the_beat_is_back_within_two_seconds(tmp_path, store,
                                                                                                  stand_in):
    """A 6 s outage of the link to the job store, the packets vanishing in a switch: the call in flight
    gets no answer (the agent drops it after STORE_CALL_S), and a connect made during the outage never
    completes in time (its SYN retries come 1, 3, 7 s after it began). When the link returns, this
    node's beat is back within about two seconds: the other nodes, which name it lost after 10 s
    of silence, never do. It used to wait 5 s after the dropped call before it tried again: 10 s after
    the outage began, when it named the store lost itself (here, and in a real 6 s outage)."""
    from tests.helpers import store_client

    down, released = threading.Event(), threading.Event()

    def silent():  # no answer while the link is down; the test's end releases the thread
        released.wait(30)
        raise TimeoutError("no answer")

    class Link:
        """A client of the job store through the link."""

        def __init__(self):
            if down.is_set():
                silent()
            self._client = store_client(store.port)

        def __getattr__(self, name):
            method = getattr(self._client, name)
            return lambda *args, **kwargs: silent() if down.is_set() else method(*args, **kwargs)

    beat_key = Keys("ddprun/job/r1/").agent(1)
    a = AgentFailures(RunDir(str(tmp_path)), "host-b", "127.0.0.1", store.port, "job", io.StringIO(), connect=Link)
    worker = stand_in()
    a.on_workers_started("r1", 1, 2, {1: (0, worker.pid, "")}, world_size=2)
    try:
        deadline = time.monotonic() + 5
        while not store.check([beat_key]) and time.monotonic() < deadline:
            time.sleep(0.05)
        down.set()
        time.sleep(6.0)
        before = store.get(beat_key)
        down.clear()
        back = time.monotonic()
        while store.get(beat_key) == before and time.monotonic() - back < 8:
            time.sleep(0.05)
        took = time.monotonic() - back
    finally:
        a.stop()
        released.set()
    assert took < 3.0 and a.lost is None, (took, a.lost)
    assert worker.poll() is None  # its workers train on


def test_the_exit_barrier_is_left_once_the_job_has_a_first_hand_cause_and_not_for_an_echo(agent, store):
    """A node whose ranks all ended 0 waits in the agents' exit barrier; a node whose ranks failed never
    arrives there. The job's first-hand cause ends the wait (here, carried by the record of a rank it
    stopped: a peer that finished first); an echo alone does not, its cause may still come."""
    from ddprun.protocol.store import publish_failure

    a, _ = agent
    keys = Keys("ddprun/job/r1/")
    publish_failure(store, keys, fr.FailureRecord(fr.ERROR, 0, "RuntimeError: Connection closed by peer", 0, "host-a",
                                                  0, t=time.time()))
    time.sleep(1.5)  # three beats: read
    assert a.records() and not a.exit_barrier_done() and a.job_failed() is None
    first = fr.finished_first(fr.CleanEnd(3, 1, "host-1", 1, 5, time.time()))
    publish_failure(store, keys, fr.stopped_by(first, rank=0, node_rank=0, host="host-a", local_rank=0, t=time.time()))
    deadline = time.monotonic() + 3
    while not a.exit_barrier_done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.exit_barrier_done() and a.job_failed() == first


def test_another_nodes_lost_record_ends_the_exit_barrier_and_fails_the_job_only_if_it_never_arrived(agent, store):
    """A node whose ranks ended 0 waits in the exit barrier; another node (not its ring neighbour, which
    alone watches that node's beat) names a third node lost: the wait ends once the record is read, and
    the job failed of it when the lost node had not arrived, not when it had (its ranks finished)."""
    from ddprun.protocol.store import publish_failure

    a, _ = agent
    lost = fr.FailureRecord(fr.LOST, -1, "its agent stopped answering for 10 s", 2, "host-c", by="observer",
                            t=time.time())
    assert not a.exit_barrier_done()
    publish_failure(store, Keys("ddprun/job/r1/"), lost)
    deadline = time.monotonic() + 3
    while not a.exit_barrier_done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.exit_barrier_done() and a.lost is None and a.job_failed() is None
    a.exit_barrier_left(3, 3)  # every agent arrived: the lost node had finished
    assert a.lost_before_end() is None
    a.exit_barrier_left(2, 3)
    assert a.lost_before_end() == lost


def test_node_0_whose_ranks_finished_lingers_only_until_the_others_have_their_records(agent, store):
    """Its ranks (0, 1) ended 0 and need no record; rank 3 finished first (the cause rank 2's record
    carries): every rank is accounted for at once, where it used to wait out the bound."""
    from ddprun.protocol.store import publish_failure

    a, _ = agent
    first = fr.finished_first(fr.CleanEnd(3, 1, "host-1", 1, 5, time.time()))
    publish_failure(store, Keys("ddprun/job/r1/"),
                    fr.stopped_by(first, rank=2, node_rank=1, host="host-1", local_rank=0, t=time.time()))
    deadline = time.monotonic() + 3
    while a.root_cause() != first and time.monotonic() < deadline:  # a beat reads it (as before _finished)
        time.sleep(0.05)
    t0 = time.monotonic()
    a.linger(timeout_s=2, finished=True)
    assert time.monotonic() - t0 < 1.0 and a.root_cause() == first
    t0 = time.monotonic()
    a.linger(timeout_s=2)  # ranks 0 and 1 counted as failed ones would be: their records never come
    assert time.monotonic() - t0 >= 1.9


def test_the_store_host_lingers_until_the_node_of_the_rank_that_finished_first_has_read_it(tmp_path, store):
    """Rank 1, node 1's only rank, finished first; rank 0 (node 0, the store's host) was stopped by
    it. Node 1's agent learns the job failed only from the store: node 0 stays up until node 1 says it
    read the cause, though every rank has a record at once. Here node 1's agent reads 1 s late (a
    loaded node); before, node 0 left at once and node 1 said its run finished (exit 0)."""
    from ddprun.protocol.store import publish_failure

    keys = Keys("ddprun/job/r1/")
    first = fr.finished_first(fr.CleanEnd(1, 1, "host-1", 0, 5, time.time()))
    publish_failure(store, keys, fr.stopped_by(first, rank=0, node_rank=0, host="host-a", local_rank=0,
                                               t=time.time()))
    nodes = [AgentFailures(RunDir(str(tmp_path / host)), host, "127.0.0.1", store.port, "job", io.StringIO(),
                           connect=preconnected(store.port))
             for host in ("host-a", "host-1")]
    late = threading.Timer(1.0, nodes[1].on_workers_started, ("r1", 1, 2, {1: (0, 0, "")}),
                           dict(world_size=2, store=("127.0.0.1", store.port), last_attempt=True))
    try:
        nodes[0].on_workers_started("r1", 0, 2, {0: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port),
                                    last_attempt=True)
        deadline = time.monotonic() + 3
        while nodes[0].root_cause() != first and time.monotonic() < deadline:  # a beat reads it (as before linger)
            time.sleep(0.05)
        late.start()
        t0 = time.monotonic()
        nodes[0].linger(timeout_s=8)
        took = time.monotonic() - t0
        assert nodes[1].job_failed() == first, nodes[1].records()  # read before the store's host left
        assert 1.0 <= took < 4.0, took  # not at once, and not the bound
        assert store.check([keys.cause_read(1)]) and not store.check([keys.cause_read(0)])
    finally:
        late.cancel()
        for a in nodes:
            a.stop()


def test_a_peer_that_stopped_for_a_no_step_answer_carries_it_where_its_store_went_with_it(tmp_path, store):
    """Node 1 was signalled, its ranks answered NO_STEP (nothing stops at a step), so its agent stopped
    them at once and left, with the workers' store it hosted. Node 0's worker failed of it before a beat
    read the answer: the answer comes with the cause its worker recorded, so node 0 knows the job is
    not stopping at a step (a restart may follow), where before it knew no answer (no restart)."""
    from ddprun.protocol import preempt as pp

    gone = store_server()  # node 1's store, which node 0 never reads here
    peer = AgentFailures(RunDir(str(tmp_path / "b")), "host-b", "127.0.0.1", gone.port, "job", io.StringIO(),
                         connect=preconnected(gone.port))
    peer.on_workers_started("r1", 1, 2, {2: (0, 0, ""), 3: (1, 0, "")}, world_size=4,
                            store=("127.0.0.1", gone.port), last_attempt=False)
    try:
        peer.preempt_request = pp.Request("SIGTERM", "agent", 1, "host-b", time.time())
        peer.preempt_stop = pp.NO_STEP
        peer.on_signal(15)
        assert peer.stopping_for is not None and peer.stopping_for.stop_step == pp.NO_STEP
    finally:
        peer.stop()
    seen = fr.stopped_by(fr.FailureRecord.from_json(peer.stopping_for.to_json()), rank=0, node_rank=0,
                         host="host-a", local_rank=0, t=time.time(), seen="Connection reset by peer")
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"extraInfo": {"ddprun": json.loads(seen.to_json())}}}))
    a = AgentFailures(RunDir(str(tmp_path / "a")), "host-a", "127.0.0.1", store.port, "job", io.StringIO(),
                      connect=preconnected(store.port))
    a.on_workers_started("r1", 0, 2, {0: (0, 0, str(error_file)), 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", store.port), last_attempt=False)
    try:
        a.preempt_request = pp.Request("SIGTERM", "agent", 1, "host-b", time.time())
        assert a.read_preempt_stop() is None  # asked, no answer in its store, no record carrying one
        a.on_worker_exit(0, 0, pid=0, code=1)
        assert a.read_preempt_stop() == pp.NO_STEP
    finally:
        a.stop()


def test_a_records_answer_is_a_string_or_nothing():
    from ddprun.protocol import preempt as pp

    rec = fr.FailureRecord(fr.SIGNAL, -1, "its agent got SIGTERM and stopped its workers", 1, "b", signal="SIGTERM",
                           by="agent", stop_step=pp.NO_STEP)
    assert fr.FailureRecord.from_json(rec.to_json()).stop_step == pp.NO_STEP
    assert fr.answer_in([rec]) == pp.NO_STEP
    assert fr.answer_in([fr.stopped_by(rec, rank=0, node_rank=0, host="a", local_rank=0, t=0.0)]) == pp.NO_STEP
    bad = json.loads(rec.to_json()) | {"stop_step": 35}
    assert fr.FailureRecord.from_dict(bad).stop_step is None  # never trusted
    assert fr.answer_in([fr.FailureRecord(fr.ERROR, 1, "x")]) is None


def _failures_in(store, attempt: str) -> int:
    return int(store.add(Keys(f"ddprun/job/{attempt}/").failures, 0))


def test_a_neighbour_that_dies_while_torch_re_forms_the_group_is_not_named_lost(tmp_path, store):
    """A restart (or a node joining) re-forms the group: torch's rendezvous leaves a dead node out of
    the next round, and a node that comes back takes its rank. Naming the dead one lost meanwhile (13 s
    after its last beat, while the next round waited for its keep-alive) put a lost record in the next
    attempt and ended a job that had its node back (tests/faults/test_runs.py)."""
    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", out, lost_after_s=1.0,
                      connect=preconnected(store.port))
    a.on_workers_started("r1", 0, 2, {0: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port))
    store.set(Keys("ddprun/job/r1/").agent(1), json.dumps({"host": "host-b", "beat": 2}))  # its last beat
    a.on_reforming()
    try:
        time.sleep(2.5)  # more than lost_after past its last beat, and ticks that look
        assert a.lost is None, a.lost.headline()
        assert _failures_in(store, "r1") == 0 and not (tmp_path / "failures").exists()
        a.on_workers_started("r2", 0, 2, {0: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port))
        store.set(Keys("ddprun/job/r2/").agent(1), json.dumps({"host": "host-c", "beat": 2}))  # the node back
        time.sleep(0.6)
        assert a.lost is None and _failures_in(store, "r2") == 0
    finally:
        a.stop()


def test_a_tick_of_the_attempt_before_names_no_node_lost_in_this_one(tmp_path, store):
    """The failure thread's tick reads the attempt's keys once; a new attempt may start while it runs.
    Its look at the old attempt's neighbour must not name that node lost under the new attempt's keys,
    whose node of that rank is another (the thread's own timing: called here as the thread would)."""
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", io.StringIO(),
                      lost_after_s=1.0, connect=preconnected(store.port))
    a.on_workers_started("r1", 0, 2, {0: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port))
    old = Keys("ddprun/job/r1/")
    a.on_workers_started("r2", 0, 2, {0: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port))
    try:
        seen = (old.agent(1), None, time.monotonic() - 13)  # the old neighbour, silent for 13 s
        a._watch_neighbour(a._client(), old, seen)
        assert a.lost is None and _failures_in(store, "r2") == 0 and _failures_in(store, "r1") == 0
        a._watch_neighbour(a._client(), a._keys, (a._keys.agent(1), None, time.monotonic() - 13))
        assert a.lost is not None and _failures_in(store, "r2") == 1  # this attempt's own silent neighbour
    finally:
        a.stop()


def test_a_store_connect_that_fails_across_a_new_attempts_start_is_not_that_attempts_loss(tmp_path, store,
                                                                                          stand_in):
    """Elastic: the workers' store's host (group rank 0) died and torch re-forms the group for longer than
    lost_after (its keep-alive: 15 s by default). A tick that began before the new attempt started, in
    a connect to the dead store, fails after it: its failure must not count against the new attempt's
    store. It used to keep the old failing time and name the new, healthy store lost at once, stopping
    the re-formed job's workers."""
    broken, dialling = threading.Event(), threading.Event()

    def connect():
        if broken.is_set():  # a dead host: the connect fails after a while (its SYNs unanswered)
            dialling.set()
            time.sleep(0.5)
            raise ConnectionRefusedError("the old store's host is gone")
        return breakable(store, broken)()

    first, second = stand_in(), stand_in()
    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", out, lost_after_s=1.0,
                      connect=connect, stop_grace_s=1.0)
    a.on_workers_started("r1", 0, 1, {0: (0, first.pid, "")}, world_size=1)
    try:
        time.sleep(0.8)  # ticks that answer
        broken.set()  # group rank 0's node dies; torch stops this node's workers and re-forms
        a.on_reforming()
        time.sleep(2.0)  # failing ticks, twice lost_after: no loss to name while re-forming
        assert a.lost is None and first.poll() is None, out.getvalue()
        dialling.clear()
        assert dialling.wait(5)  # a tick is in its connect to the dead store ...
        a.on_workers_started("r2", 0, 1, {0: (0, second.pid, "")}, world_size=1, store=("127.0.0.2", store.port))
        broken.clear()  # ... when the new round starts, its store (a new group rank 0's) answering
        time.sleep(1.5)  # the straddling connect fails; then more than lost_after of ticks
        assert second.poll() is None and a.lost is None, out.getvalue()
        assert "stopping this node's workers" not in out.getvalue()
    finally:
        a.stop()


def test_a_connect_to_the_attempt_befores_store_is_dropped_for_the_new_attempts(tmp_path):
    """torch makes a new workers' store where a later round's group rank 0 differs (a late node that
    sorts first, agent/torch_agent.py follow_round_store), while the old one's host lives on. A connect
    dialled to the old store that returns after the new attempt started must not become the client:
    this node would beat in the old store for the whole attempt, and its observers, reading the new
    one, name it lost."""
    old, new = store_server(), store_server()
    clients = {old.port: store_client(old.port), new.port: store_client(new.port)}
    slow, dialling, release = threading.Event(), threading.Event(), threading.Event()
    a: AgentFailures

    def connect():
        dialled = a._port  # what the connect dials: read as it begins
        if slow.is_set():
            dialling.set()
            release.wait(3)
        return clients[dialled]

    slow.set()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", old.port, "job", io.StringIO(),
                      lost_after_s=5.0, connect=connect)
    a.on_workers_started("r1", 0, 1, {0: (0, 0, "")}, world_size=1)
    try:
        assert dialling.wait(5)  # the first tick dials the old store ...
        a.on_workers_started("r2", 0, 1, {0: (0, 0, "")}, world_size=1, store=("127.0.0.1", new.port))
        slow.clear()
        release.set()  # ... and it answers once the new attempt started
        beat = Keys("ddprun/job/r2/").agent(0)
        deadline = time.monotonic() + 3
        while not new.check([beat]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert new.check([beat]), "no beat of the new attempt in its store"
        assert not old.check([beat]), "the new attempt beat in the old store"
    finally:
        a.stop()


def test_a_tick_of_the_attempt_before_does_not_enforce_its_cause_on_this_one(tmp_path, store, stand_in):
    """The tick that enforces the end (SIGKILL of a local worker still running ENFORCE_S after another
    rank's failure ended the job) decides for the attempt it read, under the lock a new attempt starts
    under: a tick of the attempt before, called after the new start, kills none of the new workers nor
    starts the new attempt's ENFORCE_S clock."""
    worker = stand_in()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", io.StringIO(),
                      lost_after_s=30.0, connect=preconnected(store.port))
    a.on_workers_started("r1", 0, 2, {0: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port))
    old = a._keys
    a.on_workers_started("r2", 0, 2, {0: (0, worker.pid, "")}, world_size=2, store=("127.0.0.1", store.port))
    try:
        publish(store, "r2", killed(1, 1))  # the new attempt's cause, read by its own ticks
        a._read_records(a._client(), a._keys, every=True)
        a._enforce_end(old)
        assert a._cause_seen is None and a.stopping_for is None
        a._enforce_end(a._keys)
        assert a._cause_seen is not None  # this attempt's own tick starts the clock
    finally:
        a.stop()


def test_a_beat_held_behind_a_slow_store_call_does_not_overwrite_the_done_stop_said(tmp_path, store):
    """stop() waits 2 s for the thread, then says this node is done. A tick held longer by a slow store
    (its alarm read) beats after that: the heartbeat's last word must still be "done", or a node still
    running (its ranks wait at the end) names this one lost 10 s later. A beat every second tick (even
    ones): the alarm read of the second tick after a beat is held."""
    armed, held = threading.Event(), threading.Event()
    beat, adds = Keys("ddprun/job/r1/").agent(0), [0]

    class Slow:
        def __getattr__(self, name):
            call = getattr(store, name)
            if name not in ("set", "compare_set"):
                return call

            def counted(key, *values):
                if name == "set" and key == beat:
                    adds[0] = 0
                elif name == "compare_set" and key.endswith("/alarm"):  # the alarm's read (read_counter)
                    adds[0] += 1
                    if adds[0] == 2 and armed.is_set():
                        armed.clear()
                        held.set()
                        time.sleep(3.0)
                return call(key, *values)
            return counted

    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", io.StringIO(),
                      connect=Slow)
    a.on_workers_started("r1", 0, 1, {0: (0, 0, "")}, world_size=1)
    time.sleep(1.2)
    armed.set()
    assert held.wait(5)
    a.stop()  # returns after its 2 s wait, the tick still held
    time.sleep(1.5)  # the held tick goes on: its beat
    assert b'"done"' in store.get(beat), store.get(beat)


def test_a_restart_whose_store_host_is_stopped_says_its_line_within_one_store_call(tmp_path, store, monkeypatch):
    """The workers' store's host is stopped (SIGSTOP: it accepts connections, answers nothing): the
    restart line waits for one bounded call (STORE_CALL_S, 1 s here), not for a look at the agents'
    heartbeats too, which needs a store that answers."""
    from ddprun.agent import failures as failures_mod

    monkeypatch.setattr(failures_mod, "STORE_CALL_S", 1.0)
    stopped = threading.Event()

    out = io.StringIO()
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", out, lost_after_s=30.0,
                      connect=stopped_host(stopped))  # store.port listens, as a stopped host's port does
    a.on_workers_started("r1", 0, 2, {0: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port),
                         last_attempt=False)
    try:
        t0 = time.monotonic()
        a.on_restarting(0, 1)
        took = time.monotonic() - t0
    finally:
        stopped.set()
        a.stop()
    assert out.getvalue() == "ddprun: a worker failed; restarting the workers (restart 1 of 1)\n", out.getvalue()
    assert took < 2.0, took


def test_the_probe_names_a_store_that_takes_connections_but_answers_nothing(tmp_path, store, monkeypatch):
    """At the job's end with only echoes known: a stopped store host (SIGSTOP: its kernel still accepts
    connections) is named as the lost store, within one bounded call, without the wait for beats."""
    from ddprun.agent import failures as failures_mod

    monkeypatch.setattr(failures_mod, "STORE_CALL_S", 1.0)
    stopped = threading.Event()

    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", io.StringIO(),
                      lost_after_s=30.0, connect=stopped_host(stopped))  # store.port listens, as a stopped host's port does
    a.on_workers_started("r1", 0, 2, {0: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port),
                         last_attempt=False)
    try:
        t0 = time.monotonic()
        (lost,) = a.probe_lost()
        took = time.monotonic() - t0
    finally:
        stopped.set()
        a.stop()
    assert lost.headline() == f"the node hosting the job store was lost: the job store at 127.0.0.1:{store.port} " \
                              "stopped answering", lost.headline()
    assert took < 2.0, took


def test_a_neighbour_silent_through_a_pause_this_agent_slept_through_too_is_not_lost(tmp_path, store, monkeypatch):
    """The whole job suspended between two ticks (scontrol suspend, a paused VM): the monotonic clock
    ran 400 s while no process ran. The first look at the neighbour's unchanged beat after it is no
    loss: its silence counts from the resume, and a neighbour still silent lost_after later is lost."""
    import types

    from ddprun.agent import failures as failures_mod

    clock = [1000.0]
    monkeypatch.setattr(failures_mod, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    a = AgentFailures(RunDir(str(tmp_path)), "host-a", "127.0.0.1", store.port, "job", io.StringIO(),
                      connect=preconnected(store.port))
    keys = Keys("ddprun/job/r1/")
    a._keys, a._node, a._nnodes, a._started_at = keys, 0, 2, clock[0]
    store_client(store.port).set(keys.agent(1), json.dumps({"host": "host-b", "beat": 2}))
    seen, beat = (None, None, clock[0]), 0
    for step in (0.5, 0.5, 400.0, 0.5, 0.5, 0.5, 0.5):  # ticks, the pause, ticks: the neighbour unchanged
        clock[0] += step
        beat += 1
        seen = a._tick(beat, seen)
        assert a.lost is None, (step, a.lost)
    while a.lost is None and beat < 60:  # still unchanged: lost, its silence counted from the resume
        clock[0] += 0.5
        beat += 1
        seen = a._tick(beat, seen)
    assert a.lost is not None and a.lost.node_rank == 1 and "for 10 s" in a.lost.summary, a.lost


def test_a_node_whose_watch_errs_every_tick_still_beats_and_its_peer_does_not_name_it_lost(tmp_path, store):
    """The heartbeat comes after the tick's other work: an error of the watch's own there (every tick)
    must not stop it, or the neighbour names a healthy node lost after lost_after."""
    from ddprun.agent.noderelay import NodeRelay

    class BrokenRelay(NodeRelay):
        def mirror(self, *args, **kwargs):
            raise TypeError("a bug in the relay")

    agents = [AgentFailures(RunDir(str(tmp_path)), f"host-{node}", "127.0.0.1", store.port, "job", io.StringIO(),
                            lost_after_s=2.5, connect=preconnected(store.port),
                            relay=BrokenRelay(store_server()) if node == 0 else None) for node in (0, 1)]
    for node, a in enumerate(agents):
        a.on_workers_started("r1", node, 2, {node: (0, 0, "")}, world_size=2, store=("127.0.0.1", store.port))
    try:
        time.sleep(4.0)  # past lost_after (beats come every second)
        assert [a.lost for a in agents] == [None, None], [a.lost.headline() for a in agents if a.lost]
    finally:
        for a in agents:
            a.stop()
