"""The node store (agent/noderelay.py): a worker's quiet poll costs the job's store nothing, its
agent relays the alarm, the node's progress and its timings, and a worker whose relay stops
beating talks to the job store itself; on real TCPStores."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from ddprun.agent.failures import AgentFailures
from ddprun.agent.noderelay import NodeRelay
from ddprun.errors import ConfigError
from ddprun.preempt import PreemptState
from ddprun.protocol import defaults
from ddprun.protocol import failure as fr
from ddprun.protocol import preempt as pp
from ddprun.protocol.env import WorkerEnv
from ddprun.protocol.rundir import RunDir
from ddprun.protocol.store import (
    Announced,
    Keys,
    parse_announced,
    parse_relay,
    parse_relayed,
    publish_failure,
    raise_alarm,
    relay_value,
    relayed_value,
)
from ddprun.telemetry import PROGRESS
from ddprun.worker import monitor as monitor_mod
from ddprun.worker.channel import JobChannel
from tests.helpers import Counting, await_bounded_calls, fork, preconnected, store_client, store_server

pytestmark = pytest.mark.timeout(30)


def server():
    return store_server()


def client(port):
    return Counting(store_client(port))


@pytest.fixture
def job():
    return server()


@pytest.fixture
def relay():
    r = NodeRelay()
    yield r
    r.close()


def worker(tmp_path, job, relay, rank=1, world=4, nnodes=2):
    """Rank ``rank`` of a 2-node job on node ``rank // 2``: its channel, monitor and two counted clients."""
    environ = {"RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": str(world), "GROUP_RANK": str(rank // 2),
               "GROUP_WORLD_SIZE": str(nnodes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job.port),
               "TORCHELASTIC_RUN_ID": "job", "DDPRUN_ATTEMPT": "r1"}
    jc, nc = client(job.port), client(int(relay.address.rsplit(":", 1)[1]))
    wenv = WorkerEnv(run_dir=str(tmp_path), node_store=relay.address)
    ch = JobChannel(environ, wenv, connect=lambda: jc, connect_node=lambda: nc)
    return monitor_mod.Monitor(ch), jc, nc


def agent(tmp_path, job, relay, node=0):
    a = AgentFailures(RunDir(str(tmp_path)), f"host-{node}", "127.0.0.1", job.port, "job", io.StringIO(), relay=relay,
                      connect=preconnected(job.port, client))
    a.on_workers_started("r1", node, 2, {2 * node: (0, 0, ""), 2 * node + 1: (1, 0, "")}, world_size=4,
                         store=("127.0.0.1", job.port), last_attempt=True)
    a._stop.set()  # no thread of its own: the test calls its beats
    return a


def test_a_quiet_poll_costs_the_job_store_nothing_and_the_relayed_alarm_brings_the_failure(tmp_path, job, relay,
                                                                                          monkeypatch):
    a = agent(tmp_path, job, relay)
    m, jc, nc = worker(tmp_path, job, relay, rank=1)
    seen = []
    monkeypatch.setattr(m, "_stopped_by", lambda cause, store: seen.append(cause))
    a._tick(1, (None, 0.0))
    m._tick(jc)  # the first poll reads everything once
    jc.calls.clear()
    PROGRESS.steps += 1
    a._tick(3, (None, 0.0))
    m._tick(jc)
    assert jc.calls == [] and not seen
    assert nc.store.get(m.ch.keys.progress(1)) == str(PROGRESS.total).encode()  # every poll it changed
    rec = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 1, "host-1")
    publish_failure(job, m.ch.keys, rec)
    m._tick(jc)
    assert not seen and jc.calls == []  # the relay has not read the new alarm yet
    a._tick(5, (None, 0.0))
    m._tick(jc)
    assert seen == [rec]  # once the relayed alarm moved: the cause the relay read with it
    assert "multi_get" not in jc.calls and "add" not in jc.calls, jc.calls  # no read of the job's records


def test_a_stall_request_and_its_end_reach_a_rank_through_its_relay_and_its_answer_is_its_only_job_store_calls(
        tmp_path, job, relay):
    """Before: each rank read the ``stall`` key in the job store itself at every move of the alarm (a
    check, and a get when there is one), and the ``preempt`` key too: 2-3 calls a rank a move."""
    a = agent(tmp_path, job, relay)
    m, jc, nc = worker(tmp_path, job, relay, rank=1)  # not an observer (ranks 0 and 3 are)
    keys = m.ch.keys
    a._tick(1, (None, 0.0))
    m._tick(jc)
    jc.calls.clear()
    job.set(keys.stall, json.dumps({"by": 0, "t": 1.0}))
    raise_alarm(job, keys)
    m._tick(jc)
    assert jc.calls == [] and not job.check([keys.place(1)])  # the relay has not read the new alarm yet
    a._tick(3, (None, 0.0))
    m._tick(jc)
    answer = ["set", "add"]  # its place and the count of answers: its only calls
    assert jc.calls == answer and json.loads(job.get(keys.place(1)))["where"]
    for beat in (5, 7):  # the claimant's summary moves the alarm again: answered once
        raise_alarm(job, keys)
        a._tick(beat, (None, 0.0))
        m._tick(jc)
    assert jc.calls == answer
    job.delete_key(keys.stall)  # progress resumed (the claimant's end of the report)
    raise_alarm(job, keys)
    a._tick(9, (None, 0.0))
    m._tick(jc)
    assert jc.calls == answer and m._answered == ""
    job.set(keys.stall, json.dumps({"by": 3, "t": 2.0}))  # the next stall: answered again
    raise_alarm(job, keys)
    a._tick(11, (None, 0.0))
    m._tick(jc)
    assert jc.calls == answer * 2


def test_a_preemption_request_reaches_a_rank_through_its_relay_and_it_only_proposes_its_stop_step(
        tmp_path, job, relay, monkeypatch):
    state = PreemptState(fit_active=True)
    monkeypatch.setattr(monitor_mod, "PREEMPT", state)
    a = agent(tmp_path, job, relay)
    m, jc, nc = worker(tmp_path, job, relay, rank=1)
    keys = m.ch.keys
    a._tick(1, (None, 0.0))
    m._tick(jc)
    jc.calls.clear()
    job.set(keys.preempt, pp.Request("SIGTERM", "rank 3", 1, "host-1", 1.0).to_json())
    raise_alarm(job, keys)
    a._tick(3, (None, 0.0))
    m._tick(jc)
    assert jc.calls == ["compare_set"] and state.requested and state.signame == "SIGTERM"
    assert state.stop_step == int(job.get(keys.preempt_stop))  # the step this rank proposed, the first
    assert a.preempt_request == pp.Request("SIGTERM", "rank 3", 1, "host-1", 1.0)


def test_a_malformed_relayed_request_is_read_in_the_job_store(tmp_path, job, relay):
    a = agent(tmp_path, job, relay)
    m, jc, nc = worker(tmp_path, job, relay, rank=1)
    keys = m.ch.keys
    a._tick(1, (None, 0.0))
    m._tick(jc)
    job.set(keys.stall, json.dumps({"by": 0, "t": 1.0}))
    raise_alarm(job, keys)
    a._tick(3, (None, 0.0))
    # through the relay's own connection: a TCPStore set is not acknowledged, so a set on another
    # client could reach the server before the relay's own (seen once in 18 runs)
    relay._store.set(keys.relayed_announced, "{not an object")
    jc.calls.clear()
    m._tick(jc)
    assert jc.calls == ["check", "check", "get", "set", "add"], jc.calls  # preempt and stall read there, then answered
    assert parse_announced(json.dumps({"preempt": "", "stall": "x"})) == Announced("", "x")
    assert parse_announced('{"preempt": 1, "stall": ""}') is None and parse_announced(None) is None


def test_a_rank_reads_a_failure_from_the_job_store_when_its_node_store_cannot_tell(tmp_path, job, relay, monkeypatch):
    """The relayed records leave out the rank's own; a malformed relayed value (a bad value in the node
    store) is not "no failure": the job store's records are read, as without a relay."""
    a = agent(tmp_path, job, relay)
    m, jc, nc = worker(tmp_path, job, relay, rank=1)
    seen = []
    monkeypatch.setattr(m, "_stopped_by", lambda cause, store: seen.append(cause))
    a._tick(1, (None, 0.0))
    m._tick(jc)
    own = fr.FailureRecord(fr.ERROR, 1, "its own: not a cause for it", 0, "host-0", t=1.0)
    publish_failure(job, m.ch.keys, own)
    a._tick(3, (None, 0.0))
    m._tick(jc)
    assert seen == [] and nc.store.check([m.ch.keys.relayed_causes])  # relayed, and its own record only
    other = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 1, "host-1", t=2.0)
    publish_failure(job, m.ch.keys, other)
    a._tick(5, (None, 0.0))
    relay._store.set(m.ch.keys.relayed_causes, "{not a list")  # after the relay's own write (one connection)
    jc.calls.clear()
    m._tick(jc)
    assert seen == [other] and "multi_get" in jc.calls  # read in the job store


def test_the_heartbeat_carries_the_nodes_progress_and_the_observer_sums_every_node(tmp_path, job, relay):
    a = agent(tmp_path, job, relay)
    m, jc, nc = worker(tmp_path, job, relay, rank=0)
    keys = m.ch.keys
    nc.store.set(keys.progress(0), "7")
    nc.store.set(keys.progress(1), "not a number")  # a bad value in the store is skipped
    a._tick(2, (None, 0.0))
    beat = json.loads(job.get(keys.agent(0)))
    assert beat["host"] == "host-0" and beat["progress"] == {"0": 7}
    job.set(keys.agent(1), json.dumps({"host": "host-1", "beat": 9, "progress": {"2": 5, "3": 4, "x": 1}}))
    assert m._progress(jc) == {0: 7, 2: 5, 3: 4}


def test_timings_go_to_the_job_once_a_node_when_they_change(tmp_path, job, relay):
    a = agent(tmp_path, job, relay)
    keys = Keys("ddprun/job/r1/")
    relay.begin(keys, [0, 1])
    window = {"n": 5, "step_s": 0.1, "w": 1}
    relay._store.set(keys.timing(0), json.dumps(window))
    a._tick(2, (None, 0.0))
    assert json.loads(job.get(keys.node_timing(0))) == {"0": window}
    job.delete_key(keys.node_timing(0))
    a._tick(4, (None, 0.0))
    assert not job.check([keys.node_timing(0)])  # unchanged: not sent again
    relay._store.set(keys.timing(1), json.dumps({**window, "w": 2}))
    a._tick(6, (None, 0.0))
    assert set(json.loads(job.get(keys.node_timing(0)))) == {"0", "1"}


def test_a_worker_whose_relay_stops_beating_reports_to_the_job_store_and_the_observer_reads_it(tmp_path, job, relay,
                                                                                              monkeypatch):
    a = agent(tmp_path, job, relay)
    a._tick(1, (None, 0.0))
    m, jc, nc = worker(tmp_path, job, relay, rank=3)
    observer, ojc, _ = worker(tmp_path, job, relay, rank=0)
    m._tick(jc)
    assert not m._direct
    clock = [monitor_mod.time.monotonic()]
    monkeypatch.setattr(monitor_mod.time, "monotonic", lambda: clock[0])
    for _ in range(int(defaults.RELAY_STALE_S / defaults.MONITOR_POLL_S) - 1):  # the agent froze (SIGSTOP): no beat
        clock[0] += defaults.MONITOR_POLL_S  # since, while this rank polls on
        m._tick(jc)
    assert not m._direct
    clock[0] += defaults.MONITOR_POLL_S
    PROGRESS.steps += 1
    m._tick(jc)
    assert m._direct and int(job.add(m.ch.keys.directs, 0)) == 1
    assert int(job.get(m.ch.keys.progress(3))) == PROGRESS.total
    assert observer._progress(ojc)[3] == PROGRESS.total
    m._tick(jc)
    assert int(job.add(m.ch.keys.directs, 0)) == 1  # registered once


def test_a_job_suspended_and_resumed_is_no_hang_and_no_frozen_relay_to_its_ranks(tmp_path, job, relay, monkeypatch):
    """The whole job suspended (scontrol suspend, a paused VM): this rank's monotonic clock ran 400 s
    while nothing ran, its agent's relay included. At the first poll after it neither the relay's
    unchanged beat (the rank would leave its node store for the attempt) nor the job's unchanged
    progress (a hang report) is judged over the pause; both count from the resume."""
    a = agent(tmp_path, job, relay)
    a._tick(2, (None, 0.0))
    m, jc, _ = worker(tmp_path, job, relay, rank=0)
    m.observer = monitor_mod.StallObserver(5.0, 30.0)
    reported: list[float] = []
    monkeypatch.setattr(m, "_report", lambda store, stalled: reported.append(stalled))
    clock = [monitor_mod.time.monotonic()]
    monkeypatch.setattr(monitor_mod.time, "monotonic", lambda: clock[0])
    m._tick(jc)
    for step in (400.0, defaults.STALL_CHECK_S, defaults.STALL_CHECK_S):  # the pause, then two checks
        clock[0] += step
        m._tick(jc)
    assert not m._direct and reported == []
    bound = monitor_mod.stall_threshold(5.0, armed=PROGRESS.began)
    relayed = parse_relay(relay._store.get(m.ch.keys.relay))
    assert relayed is not None
    for beat in range(int(bound / defaults.STALL_CHECK_S) - 2):  # still no progress: a stall, from the resume
        relay._store.set(m.ch.keys.relay, relay_value(relayed[0] + 1 + beat, relayed[1]))  # its agent beats again
        clock[0] += defaults.STALL_CHECK_S
        m._tick(jc)
    assert reported == [pytest.approx(bound)]


def test_a_monitors_own_waits_while_the_job_store_is_gone_are_no_suspend(tmp_path, job, relay):
    """Polls RETRY_S (5 s) apart while the job store is gone are this thread's own waits, not the job
    suspended (HELD_GAP_S, 3 s): a hang that outlasts a store outage is still timed from its start."""
    m, _, _ = worker(tmp_path, job, relay, rank=0)
    m.observer = monitor_mod.StallObserver(5.0, 30.0)
    now = monitor_mod.time.monotonic()
    m.observer.since, m._alive_at = now - 60.0, now
    m._interval = monitor_mod.RETRY_S
    m._held(now + monitor_mod.RETRY_S + 0.5)
    assert m.observer.since == now - 60.0  # before: reset to now, the hang's report put off
    m._held(now + monitor_mod.RETRY_S + defaults.HELD_GAP_S + 1.0)  # a real hold on top of the wait
    assert m.observer.since == now + monitor_mod.RETRY_S + defaults.HELD_GAP_S + 1.0


def test_relay_values_and_a_malformed_node_store_variable():
    assert parse_relay(relay_value(3, 17).encode()) == (3, 17)
    rec = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 1, "host-1")
    assert parse_relayed(relayed_value([rec]).encode()) == [rec] and parse_relayed(relayed_value([])) == []
    for bad in (b"{not json", b'{"a": 1}', b"[1]", b'["not a record"]', b"\xff\x00", json.dumps([rec.to_json(), "x"])):
        assert parse_relayed(bad) is None, bad  # not "no failure": the reader goes to the job store
    assert parse_relay(b"garbage") is None and parse_relay(None) is None
    assert WorkerEnv.from_environ({"DDPRUN_RUN_DIR": "/r", "DDPRUN_NODE_STORE": "127.0.0.1:5"}).node_store == "127.0.0.1:5"
    with pytest.raises(ConfigError, match="DDPRUN_NODE_STORE must be HOST:PORT"):
        WorkerEnv.from_environ({"DDPRUN_RUN_DIR": "/r", "DDPRUN_NODE_STORE": "localhost"})


def test_a_node_that_cannot_host_its_store_says_so_and_runs_without_it(monkeypatch):
    from ddprun.agent import noderelay, run

    def refuse():
        raise RuntimeError("The server socket has failed to listen on any local network address.")

    monkeypatch.setattr(noderelay, "NodeRelay", refuse)
    console = io.StringIO()
    assert run.node_relay(console) is None
    assert console.getvalue() == (
        "ddprun: warning: no node store on 127.0.0.1 (RuntimeError: The server socket has failed to listen on any "
        "local network address.); this node's ranks talk to the job's store themselves. HINT: bring the loopback "
        "interface up (ip link set lo up).\n")


def test_a_rank_whose_agent_gave_no_node_store_is_read_by_the_observers_of_a_job_with_them(tmp_path, job, relay):
    observer, ojc, _ = worker(tmp_path, job, relay, rank=0)
    environ = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job.port), "TORCHELASTIC_RUN_ID": "job",
               "DDPRUN_ATTEMPT": "r1"}
    jc = client(job.port)
    plain = monitor_mod.Monitor(JobChannel(environ, WorkerEnv(run_dir=str(tmp_path)), connect=lambda: jc))
    plain._tick(jc)
    assert observer._progress(ojc) == {3: PROGRESS.total}


@pytest.fixture
def frozen_port():
    """A port whose server accepts and never answers: what a TCPStore client sees of an agent that is
    stopped (SIGSTOP): torch's client then waits for ever, whatever its timeout."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield listener.getsockname()[1]
    listener.close()
    # the clients' connects to it end at their own timeouts: not while this process exits (an abort)
    assert await_bounded_calls(15) == 0


def test_a_call_to_a_frozen_store_is_bounded_and_its_client_is_not_used_again(frozen_port):
    import threading
    import time

    from ddprun._util import Bounded, within

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not return within 0.5 s"):
        within(0.5, TCPStore, "127.0.0.1", frozen_port, None, False, timedelta(seconds=1), False)
    assert 0.5 <= time.monotonic() - t0 < 1.5
    with pytest.raises(ValueError):  # an exception of the call is the caller's
        within(1, int, "x")
    release = threading.Event()

    class Stuck:
        def check(self, keys):
            release.wait(30)
            return True

    wrapped = Bounded(SimpleStore(), 1)
    assert wrapped.port == 29500 and wrapped.get("k", default=b"d") == b"d"  # attributes; keyword arguments
    import copy

    assert copy.copy(wrapped).port == 29500
    stuck = Bounded(Stuck(), 0.3)
    with pytest.raises(TimeoutError):
        stuck.check(["a"])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="an earlier call"):
        stuck.check(["a"])  # at once: the first call still holds the client
    assert time.monotonic() - t0 < 0.1
    release.set()


def test_a_worker_whose_agent_is_frozen_reports_to_the_job_store_and_hands_over_its_record(
        tmp_path, job, frozen_port, monkeypatch):
    import time

    from ddprun.worker import channel as channel_mod

    monkeypatch.setattr(defaults, "RELAY_STALE_S", 0.5)
    monkeypatch.setattr(defaults, "NODE_RECORD_TIMEOUT_S", 0.5)
    environ = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job.port), "TORCHELASTIC_RUN_ID": "job",
               "DDPRUN_ATTEMPT": "r1"}
    jc = client(job.port)
    ch = JobChannel(environ, WorkerEnv(run_dir=str(tmp_path), node_store=f"127.0.0.1:{frozen_port}"),
                    connect=lambda: jc)  # the node store's client is torch's own, to the frozen port
    m = monitor_mod.Monitor(ch)
    t0 = time.monotonic()
    m._tick(jc)  # the node store never answers: the monitor goes direct instead of waiting for ever
    assert m._direct and time.monotonic() - t0 < 3
    assert int(job.add(ch.keys.directs, 0)) == 1
    t0 = time.monotonic()
    ch.record_failure(ch.me(fr.ERROR, "RuntimeError: boom"))  # the hand-over to the frozen agent is bounded
    assert time.monotonic() - t0 < 0.5 + defaults.ACK_WAIT_S + 1  # then the first cause waits for the others' acks
    assert channel_mod.read_causes(job, ch.keys)  # and the job's copy is there


class SimpleStore:
    port = 29500

    def get(self, key, default=None):
        return default



def test_a_bounded_client_makes_its_calls_on_one_reused_thread_that_ends_when_idle(monkeypatch):
    """Bounded keeps one helper thread (not one per call: a thread start waits for the new thread to
    run, which hundreds of polling threads in one process make slow); it ends after an idle spell and
    the next call starts another; calls from several threads each get their own answer."""
    import threading

    from ddprun import _util

    monkeypatch.setattr(_util._Caller, "IDLE_S", 0.3)

    class Who:
        def ident(self, tag):
            return threading.current_thread(), tag

    wrapped = _util.Bounded(Who(), 2)
    first = {wrapped.ident(i)[0] for i in range(20)}
    assert len(first) == 1 and threading.current_thread() not in first  # one helper, not the caller's thread
    answers: dict[int, tuple] = {}

    def ask(i: int) -> None:
        answers[i] = wrapped.ident(i)

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(5)
    assert {i: tag for i, (_, tag) in answers.items()} == {i: i for i in range(8)}
    assert {who for who, _ in answers.values()} == first
    (helper,) = first
    helper.join(5)
    assert not helper.is_alive(), "the idle helper thread did not end"
    later, _ = wrapped.ident("again")
    assert later not in first  # a new helper served it


def test_a_bounded_call_that_raises_timeout_itself_does_not_mark_the_client_stuck():
    from ddprun._util import Bounded

    class Raises:
        def get(self, key):
            raise TimeoutError(f"the store's own timeout for {key}")

    wrapped = Bounded(Raises(), 2)
    for _ in range(2):  # the call returned (with its error): the client is free, and not given up on
        with pytest.raises(TimeoutError, match="the store's own timeout for k"):
            wrapped.get("k")
    assert wrapped.stuck_at is None


def test_the_relay_writes_the_records_it_read_before_the_alarm_only_when_they_changed_and_never_across_attempts():
    from ddprun.protocol.store import ECHOES_READ, relayable

    class Writes(Counting):  # the key of every set, in order
        def set(self, key, value):
            self.calls.append(key.rsplit("/", 1)[1])
            return self.store.set(key, value)

    store = Writes(server())
    relay = NodeRelay(server=store)
    keys = Keys("ddprun/job/r1/")
    relay.begin(keys, [0, 1])
    cause = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 1, "host-1")
    echoes = [fr.stopped_by(cause, rank=r, node_rank=r // 2, host="h", local_rank=r % 2, t=5.0) for r in range(40)]
    relay.mirror(1, 0, [])
    assert store.calls == ["relay"] and not store.store.check([keys.relayed_causes])  # nothing read: nothing relayed
    relay.mirror(2, 1, echoes)
    assert store.calls[1:] == ["relayed-causes", "relay"] and parse_relayed(store.store.get(keys.relayed_causes)) == \
        echoes[:ECHOES_READ]  # while there is no first-hand record: the first echoes, bounded
    relay.mirror(3, 2, [*echoes, cause])
    assert parse_relayed(store.store.get(keys.relayed_causes)) == [cause] == relayable([*echoes, cause])
    store.calls.clear()
    relay.mirror(4, 2, [*echoes, cause])
    assert store.calls == ["relay"] and parse_relay(store.store.get(keys.relay)) == (4, 2)  # unchanged: the beat only
    store.calls.clear()
    new = Keys("ddprun/job/r2/")
    relay.begin(new, [0, 1])  # a restart, while a beat of the ended attempt was on its way
    relay.mirror(5, 2, [cause], keys)
    assert store.calls == [] and not store.store.check([new.relayed_causes])  # nothing of it under the new keys
    relay.mirror(6, 0, [cause], new)
    assert store.calls == ["relayed-causes", "relay"]  # the same records, in the new attempt: written again


def test_a_bounded_client_whose_helper_could_not_start_tries_again_on_the_next_call(monkeypatch):
    import threading

    from ddprun._util import Bounded

    real, failed = threading.Thread.start, []

    def start_once_fails(self):
        if self.name == "ddprun-bounded-call" and not failed:
            failed.append(self)
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_fails)
    wrapped = Bounded(SimpleStore(), 1)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        wrapped.get("k", default=b"d")
    assert wrapped.get("k", default=b"d") == b"d" and wrapped.stuck_at is None  # served, not given up on


def test_a_child_forked_while_another_thread_held_a_bounded_clients_lock_can_still_call():
    """A fork (a DataLoader worker's, a user's os.fork) while another thread was inside a Bounded
    call's hand-over: that thread does not exist in the child, and its lock would stay held there."""
    import os
    import time
    from types import SimpleNamespace

    from ddprun._util import Bounded

    wrapped = Bounded(SimpleNamespace(answer=lambda: 7), 5)
    assert wrapped.answer() == 7
    wrapped._caller._lock.acquire()  # as another thread inside submit at the fork
    pid = fork()
    if pid == 0:  # the child: one call, its result as the exit code
        try:
            os._exit(0 if wrapped.answer() == 7 else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    wrapped._caller._lock.release()
    deadline, status = time.monotonic() + 10, None
    while status is None and time.monotonic() < deadline:
        done, code = os.waitpid(pid, os.WNOHANG)
        status = code if done else None
        time.sleep(0.02)
    if status is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert status is not None and os.waitstatus_to_exitcode(status) == 0, "the forked child's call hung or failed"


def test_a_nodes_stopped_ranks_reach_the_job_store_in_one_batch_from_their_agent_with_their_acks(tmp_path, job,
                                                                                                   relay):
    """A rank another rank's failure stopped leaves its record with its agent (no job-store call of its
    own); the agent's next beat writes the node's records in one batch and acknowledges them: 4
    job-store calls for the node, where each rank recording itself made 4 (#18)."""
    jcs = []
    a = AgentFailures(RunDir(str(tmp_path)), "host-1", "127.0.0.1", job.port, "job", io.StringIO(), relay=relay,
                      connect=lambda: jcs.append(client(job.port)) or jcs[-1])
    a.on_workers_started("r1", 1, 2, {2: (0, 0, ""), 3: (1, 0, "")}, world_size=4, store=("127.0.0.1", job.port))
    a._stop.set()
    keys = Keys("ddprun/job/r1/")
    cause = fr.FailureRecord(fr.ERROR, 0, "ValueError: bad batch", 0, "host-0", t=1.0)
    publish_failure(job, keys, cause)
    a._tick(1, (None, 0.0))  # reads the cause
    workers = [worker(tmp_path, job, relay, rank=r) for r in (2, 3)]
    for m, jc, _ in workers:
        m._record_stopped(m.ch.stopped(cause), jc)
        assert jc.calls == []  # nothing of its own in the job store
    assert int(job.add(keys.failures, 0)) == 1 and int(job.add(keys.acks, 0)) == 0
    jcs[0].calls.clear()
    a._tick(2, (None, 0.0))
    forwarded = jcs[0].calls[jcs[0].calls.index("multi_set") - 1:][:4]
    assert forwarded == ["add", "multi_set", "add", "add"], jcs[0].calls  # failures, the records, alarm, acks
    assert int(job.add(keys.failures, 0)) == 3 and int(job.add(keys.acks, 0)) == 2
    recs = fr.parse_many(job.multi_get([keys.failure(2), keys.failure(3)]))
    assert sorted(r.rank for r in recs) == [2, 3] and all(r.is_echo and r.cause_rank == 0 for r in recs)
    a._tick(3, (None, 0.0))  # each once
    assert int(job.add(keys.failures, 0)) == 3 and int(job.add(keys.acks, 0)) == 2
    rec = a.local_record(2)  # no error file: the copy a full disk cannot take is in the node store too
    assert rec is not None and rec.rank == 2 and rec.is_echo


def test_a_rank_without_a_live_relay_records_its_stop_in_the_job_store_and_linger_forwards_what_no_beat_did(
        tmp_path, job, relay):
    a = agent(tmp_path, job, relay, node=0)  # ranks 0 and 1
    keys = Keys("ddprun/job/r1/")
    cause = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 1, "host-1", t=1.0)
    publish_failure(job, keys, cause)
    m0, jc0, _ = worker(tmp_path, job, relay, rank=0)
    m0._direct = True  # its relay stopped beating: it talks to the job store itself
    m0._record_stopped(m0.ch.stopped(cause), jc0)
    assert int(job.add(keys.failures, 0)) == 2 and int(job.add(keys.acks, 0)) == 1
    m1, jc1, _ = worker(tmp_path, job, relay, rank=1)
    m1._record_stopped(m1.ch.stopped(cause), jc1)
    assert int(job.add(keys.failures, 0)) == 2
    a.linger(timeout_s=0.2)  # the launch ended before another beat: linger forwards it first
    assert int(job.add(keys.failures, 0)) == 3 and int(job.add(keys.acks, 0)) == 2
    assert {r.rank for r in fr.parse_many(job.multi_get([keys.failure(k) for k in (2, 3)]))} == {0, 1}


def test_a_record_whose_count_never_arrived_is_forwarded_at_the_agents_end(tmp_path, job, relay):
    # a node too loaded for the rank's second call (the count) within its bound: the record is in the
    # node store, and only the agent's end, which reads it whatever the count, can forward it
    a = agent(tmp_path, job, relay, node=0)  # ranks 0 and 1
    keys = Keys("ddprun/job/r1/")
    cause = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 1, "host-1", t=1.0)
    publish_failure(job, keys, cause)
    m1, _, _ = worker(tmp_path, job, relay, rank=1)
    assert m1.ch._hand_to_node(m1.ch.stopped(cause), True) is not None  # the record, and no count after it
    a._tick(1, (None, 0.0))  # a beat reads the node store only when the count moved
    assert int(job.add(keys.failures, 0)) == 1
    a.linger(timeout_s=0.2)
    assert int(job.add(keys.failures, 0)) == 2 and int(job.add(keys.acks, 0)) == 1
    assert [r.rank for r in fr.parse_many(job.multi_get([keys.failure(2)]))] == [1]


def test_the_agent_forwards_no_malformed_or_first_hand_left_record_and_none_across_attempts(relay):
    local = Counting(relay._store)
    relay._store = local
    keys = Keys("ddprun/job/r1/")
    relay.begin(keys, [2, 3])
    assert relay.left(keys) == (0, []) and local.calls == ["compare_set"]  # nothing left: one local read
    local.store.set(keys.left(2), "{not a record")
    own = fr.FailureRecord(fr.ERROR, 3, "its own failure: it records that itself", 1, "host-1")
    local.store.set(keys.left(3), own.to_json())
    local.store.add(keys.lefts, 2)
    assert relay.left(keys) == (2, [])
    relay.forwarded(keys, 2, [])
    local.calls.clear()
    assert relay.left(keys) == (2, []) and local.calls == ["compare_set"]  # not read again
    stopped = fr.stopped_by(own, rank=2, node_rank=1, host="host-1", local_rank=0, t=2.0)
    local.store.set(keys.left(2), stopped.to_json())
    local.store.add(keys.lefts, 1)
    relay.begin(Keys("ddprun/job/r2/"), [2, 3])  # a new attempt: the last one's records are not its
    assert relay.left(keys) == (0, [])


def test_a_left_count_that_holds_no_number_neither_closes_the_node_stores_client_nor_hides_a_record(relay):
    """The count is read without add(key, 0), which on a value that is not a number closes the client
    (every later call of the relay's would fail); the records are read whatever the count says."""
    keys = Keys("ddprun/job/r1/")
    relay.begin(keys, [2, 3])
    cause = fr.FailureRecord(fr.ERROR, 5, "ValueError: bad batch", 2, "host-2")
    relay._store.set(keys.left(2), fr.stopped_by(cause, rank=2, node_rank=1, host="h", local_rank=0, t=2.0).to_json())
    relay._store.set(keys.lefts, "garbage")
    n, recs = relay.left(keys)
    assert [r.rank for r in recs] == [2]
    assert relay._store.get(keys.left(2))  # the client still answers


class FailOnce:
    """A store client whose first call of ``name`` raises (a timed-out call: it may or may not have
    reached the server; here it did not)."""

    def __init__(self, store, name):
        self.store, self.name, self.failed = store, name, False

    def __getattr__(self, attr):
        fn = getattr(self.store, attr)
        if attr == self.name and not self.failed:
            def fail(*args):
                self.failed = True
                raise TimeoutError(f"{attr} did not return")
            return fail
        return fn


@pytest.mark.parametrize("fails", ["multi_set", "add_acks"])
def test_a_forward_that_failed_part_way_is_finished_at_its_reserved_place_without_a_second_ack(tmp_path, job, relay,
                                                                                             fails):
    a = agent(tmp_path, job, relay, node=0)
    keys = a._keys  # the attempt's own (a new attempt's keys are another object)
    cause = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 1, "host-1", t=1.0)
    publish_failure(job, keys, cause)
    for r in (0, 1):
        m, jc, _ = worker(tmp_path, job, relay, rank=r)
        m._record_stopped(m.ch.stopped(cause), jc)
    flaky = FailOnce(job, "multi_set") if fails == "multi_set" else None
    if fails == "add_acks":  # the acknowledgement's add fails: the records are in, their count too
        class AcksFail(FailOnce):
            def __getattr__(self, attr):
                if attr == "add":
                    return lambda key, n: (FailOnce.__getattr__(self, "add") if key == keys.acks else job.add)(key, n)
                return getattr(job, attr)
        flaky = AcksFail(job, "add")
    with pytest.raises(TimeoutError):
        a._forward_left(flaky, keys)
    a._forward_left(client(job.port), keys)  # the next tick
    assert int(job.add(keys.failures, 0)) == 3  # the cause and the two, numbered once
    assert int(job.add(keys.acks, 0)) == 2
    assert {r.rank for r in fr.parse_many(job.multi_get([keys.failure(2), keys.failure(3)]))} == {0, 1}
    a._forward_left(client(job.port), keys)
    assert int(job.add(keys.failures, 0)) == 3 and int(job.add(keys.acks, 0)) == 2


def test_linger_makes_no_job_store_client_for_nothing_to_forward_or_for_a_store_that_is_gone(tmp_path, relay):
    import time

    gone = server()
    port = gone.port
    made = []
    a = AgentFailures(RunDir(str(tmp_path)), "host-1", "127.0.0.1", port, "job", io.StringIO(), relay=relay,
                      connect=lambda: made.append(1) or client(port))
    a.on_workers_started("r1", 1, 2, {2: (0, 0, ""), 3: (1, 0, "")}, world_size=4, store=("127.0.0.1", port))
    a._stop.set()
    a.linger(timeout_s=0.2)
    assert made == []  # nothing left: no client
    keys = Keys("ddprun/job/r1/")
    cause = fr.FailureRecord(fr.ERROR, 0, "ValueError: bad batch", 0, "host-0", t=1.0)
    relay._store.set(keys.left(2), fr.stopped_by(cause, rank=2, node_rank=1, host="h", local_rank=0, t=2.0).to_json())
    relay._store.add(keys.lefts, 1)
    del gone  # the store's host is gone: its port refuses
    t0 = time.monotonic()
    a.linger(timeout_s=0.2)
    assert made == [] and time.monotonic() - t0 < 1


def test_a_rank_whose_count_for_its_agent_fails_after_its_record_is_in_leaves_it_to_the_agent(tmp_path, job, relay):
    m, jc, nc = worker(tmp_path, job, relay, rank=1)

    class NoAdd:
        def __getattr__(self, attr):
            if attr == "add":
                def add(*args):
                    raise TimeoutError("add did not return")
                return add
            return getattr(nc, attr)

    m.ch._connect_node_fn = NoAdd
    cause = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 1, "host-1", t=1.0)
    m._record_stopped(m.ch.stopped(cause), jc)
    assert jc.calls == []  # not recorded twice: the agent has it
    assert nc.store.check([m.ch.keys.left(1)])
