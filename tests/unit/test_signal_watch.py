"""The worker's signal thread (worker/signals.py): its agent's stop ends the rank at once, whatever a
store call of the monitor waits on; any other signal goes to the monitor's preemption protocol."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ddprun import preempt
from ddprun.protocol import defaults
from ddprun.protocol import preempt as pp
from ddprun.worker import signals as signals_mod
from tests.helpers import store_client, store_server


class Silent:
    """A job store whose host went silent: every call waits (here until the test ends)."""

    def __init__(self) -> None:
        self.calls, self.release = 0, threading.Event()

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls += 1
            self.release.wait(30)
            raise TimeoutError(f"{name}: the store's host did not answer")
        return call


@pytest.fixture
def rank_1(tmp_path, monkeypatch):
    """(make, node store, relay, died): ``make(job_store)`` starts rank 1's monitor (node 1) with its
    signal thread on a pipe standing in for the wakeup fd; returns (monitor, the pipe's write end).
    ``died`` collects the signals die_by got (the rank stays alive for the test; the thread that called
    it waits there, so nothing it would not have done runs after the test). Under ddprun.fit: a
    preemption request is agreed on, not the end of the rank."""
    from ddprun.agent.noderelay import NodeRelay
    from ddprun.protocol.env import WorkerEnv
    from ddprun.worker import monitor as monitor_mod
    from ddprun.worker.channel import JobChannel

    state = preempt.PreemptState(signals=(signal.SIGUSR1, signal.SIGTERM))
    state.fit_active = True  # something stops at a step: a preemption request does not end the rank
    monkeypatch.setattr(monitor_mod, "PREEMPT", state)
    monkeypatch.setattr(signals_mod, "PREEMPT", state)
    monkeypatch.setattr(preempt, "PREEMPT", state)  # whose handlers the script set (preempt.stops_itself)
    died: list[int] = []

    def die_by(sig: int) -> None:  # as the real one never returns, the thread goes no further (a daemon)
        died.append(sig)
        threading.Event().wait(60)
    monkeypatch.setattr(preempt, "die_by", die_by)
    node = store_server()
    relay = NodeRelay(node)
    started: list = []

    def make(job_store):
        environ = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
        wenv = WorkerEnv(run_dir=str(tmp_path), node_store=f"127.0.0.1:{node.port}", stall_timeout=0)
        ch = JobChannel(environ, wenv, connect=lambda: job_store, connect_node=lambda: store_client(node.port))
        relay.begin(ch.keys, [1])
        r, w = os.pipe()
        mon = monitor_mod.Monitor(ch).start(r)
        started.append(mon)
        return mon, w

    yield make, node, relay, died
    for mon in started:
        mon.stop()


def _within(seconds: float, done) -> float:
    t0 = time.monotonic()
    while not done() and time.monotonic() - t0 < seconds:
        time.sleep(0.02)
    return time.monotonic() - t0


def test_the_agents_stop_ends_the_rank_at_once_while_the_monitor_waits_on_a_silent_job_store(rank_1):
    """A machine that lost power sends no FIN or RST: the monitor's job-store call waits out its
    client's 30 s. Its agent marked the stop in the node store and sent SIGTERM: the rank ends now."""
    make, _, relay, died = rank_1
    silent = Silent()
    mon, w = make(silent)
    try:
        assert _within(5, lambda: silent.calls > 0) < 5  # the monitor thread is in a call that does not return
        relay.mark_stopping(1)
        os.write(w, bytes([signal.SIGTERM]))
        took = _within(5, lambda: died)
        assert died == [signal.SIGTERM] and took < 1.0, (died, took)
        assert silent.calls == 1  # the monitor is still waiting: the signal never went through it
    finally:
        silent.release.set()


def test_a_signal_the_agent_did_not_mark_goes_to_the_monitor_which_asks_the_job_to_stop(rank_1):
    make, *_, died = rank_1
    job = store_server()
    mon, w = make(job)
    os.write(w, bytes([signal.SIGUSR1]))
    keys = mon.ch.keys
    assert _within(5, lambda: job.check([keys.preempt])) < 5
    req = pp.Request.parse(job.get(keys.preempt))
    assert (req.signal, req.by) == ("SIGUSR1", "rank 1") and died == []


def test_a_mark_of_another_node_or_attempt_is_not_this_ranks_stop(rank_1):
    """The node store holds this attempt's keys: a mark left by an earlier attempt or another node's
    key is no stop of this rank's agent."""
    make, node, relay, died = rank_1
    job = store_server()
    mon, w = make(job)
    from ddprun.protocol.store import Keys

    node.set(Keys("ddprun/a/earlier/").stopping(1), "1")
    node.set(mon.ch.keys.stopping(0), "1")
    os.write(w, bytes([signal.SIGUSR1]))
    assert _within(5, lambda: job.check([mon.ch.keys.preempt])) < 5 and died == []


def test_a_frozen_agents_node_store_is_asked_within_a_bound(monkeypatch):
    """A node store that does not answer (its agent is stopped) is no answer: False within the bound,
    and the monitor decides through the job store."""
    monkeypatch.setattr(defaults, "RELAY_STALE_S", 0.3)
    frozen = threading.Event()
    mark = signals_mod.NodeMark(lambda: frozen.wait(10))
    t0 = time.monotonic()
    assert mark("k") == "" and time.monotonic() - t0 < 1.0
    frozen.set()
    assert signals_mod.NodeMark(None)("k") == ""  # no node store: the monitor asks the job store


def test_an_agents_stop_because_nothing_stops_at_a_step_leaves_the_scripts_own_handler_to_end_it(rank_1):
    """Megatron's --exit-signal-handler, a torchrun script's own SIGTERM handler: it sets a flag, and the
    loop saves and exits at its next step. torchrun's agent gives it 30 s; ddprun's worker ended it the
    moment its agent's stop came, and the save never happened. Any other stop still ends it at once."""
    make, node, relay, died = rank_1
    silent = Silent()  # the monitor never acts on what the signal thread hands it: the thread alone decides
    mon, w = make(silent)
    try:
        signals_mod.PREEMPT._previous[signal.SIGTERM] = lambda signum, frame: None  # the script's own handler
        signals_mod.PREEMPT.handled.set()  # which ran and returned (preempt._handler, on the main thread)
        node.set(mon.ch.keys.stopping(1), pp.STOPPING_FOR_NONE)
        os.write(w, bytes([signal.SIGTERM]))  # left to the script's handler
        os.write(w, bytes([signal.SIGUSR1]))  # no handler of the script's: ended at once
        assert _within(5, lambda: died) < 5 and died == [signal.SIGUSR1]
    finally:
        silent.release.set()


def test_a_scripts_handler_that_does_not_return_decides_nothing_and_the_rank_ends_by_the_signal(rank_1, monkeypatch):
    """Lightning 2.6's SIGTERM handler broadcasts from the signalled rank alone, a collective no other
    rank joins: left to it, the job hung (tests/integrations/test_lightning.py). A handler that has not
    returned within OWN_HANDLER_WAIT_S decides nothing: the rank ends by the signal, as before."""
    make, node, relay, died = rank_1
    monkeypatch.setattr(defaults, "OWN_HANDLER_WAIT_S", 0.2)
    silent = Silent()
    mon, w = make(silent)
    try:
        signals_mod.PREEMPT._previous[signal.SIGTERM] = lambda signum, frame: None  # never returned: handled unset
        node.set(mon.ch.keys.stopping(1), pp.STOPPING_FOR_NONE)
        os.write(w, bytes([signal.SIGTERM]))
        assert _within(5, lambda: died) < 5 and died == [signal.SIGTERM]
    finally:
        silent.release.set()


def test_an_agents_stop_for_a_failure_or_a_restart_ends_the_rank_at_once_whatever_its_script_set(rank_1):
    make, node, relay, died = rank_1
    silent = Silent()
    mon, w = make(silent)
    try:
        signals_mod.PREEMPT._previous[signal.SIGTERM] = lambda signum, frame: None
        relay.mark_stopping(1)
        os.write(w, bytes([signal.SIGTERM]))
        assert _within(5, lambda: died) < 5 and died == [signal.SIGTERM]
    finally:
        silent.release.set()


def test_a_request_nothing_stops_at_leaves_a_rank_whose_script_handles_the_signal_to_its_handler(rank_1, monkeypatch):
    """SLURM signals every process: the rank's own SIGTERM reaches its monitor, the job answers that
    nothing stops at a step (no ddprun.fit, no on_preempt), and the script's handler decides."""
    make, node, relay, died = rank_1
    monkeypatch.setattr(defaults, "OWN_HANDLER_WAIT_S", 0.1)  # before: the rank ended once its handler ran
    signals_mod.PREEMPT.fit_active = False
    signals_mod.PREEMPT._previous[signal.SIGTERM] = lambda signum, frame: None
    signals_mod.PREEMPT.handled.set()  # the script's handler ran and returned
    job = store_server()
    mon, w = make(job)
    os.write(w, bytes([signal.SIGTERM]))
    assert _within(5, lambda: signals_mod.PREEMPT.requested) < 5
    assert job.get(mon.ch.keys.preempt_stop) == pp.NO_STEP.encode()
    assert _within(0.5, lambda: died) >= 0.5 and died == []  # before: ended right after the handler returned


def test_a_peers_stop_because_nothing_stops_at_a_step_is_left_to_a_script_that_handles_that_signal(monkeypatch):
    """Kubernetes deletes every pod: the first agent's record of its SIGTERM reached the other ranks
    before their own agents' SIGTERM, and stopped them before their handlers agreed on a step to save at."""
    from ddprun.protocol import failure as fr
    from ddprun.worker.monitor import left_to_handler

    state = preempt.PreemptState(signals=(signal.SIGTERM,))
    monkeypatch.setattr(preempt, "PREEMPT", state)
    agent_stop = fr.FailureRecord(fr.SIGNAL, -1, "its agent got SIGTERM and stopped its workers", 1, "h1",
                                  signal="SIGTERM", by="agent", stop_step=pp.NO_STEP)
    assert not left_to_handler(agent_stop)  # the script has no handler of its own: stopped as ever
    state._previous[signal.SIGTERM] = lambda signum, frame: None
    assert left_to_handler(agent_stop)
    import dataclasses

    assert not left_to_handler(dataclasses.replace(agent_stop, stop_step="14"))  # a step: ddprun's stop
    assert not left_to_handler(dataclasses.replace(agent_stop, stop_step=None))  # no request: a kill
    assert not left_to_handler(dataclasses.replace(agent_stop, signal="SIGUSR1"))  # not the one it handles
    assert not left_to_handler(dataclasses.replace(agent_stop, kind=fr.EXIT, by="worker"))


def test_a_peers_stop_left_to_the_scripts_handler_stops_this_rank_after_the_agents_stop_grace(monkeypatch):
    """Left to the script's handler for as long as an agent gives one (STOP_GRACE_S), not for ever: a
    peer's agent stopped its workers and this rank's own agent was never signalled (its handler never
    runs), so this rank is stopped as ever once that time is past."""
    import threading
    import types

    from ddprun.protocol import defaults
    from ddprun.protocol import failure as fr
    from ddprun.worker import monitor as monitor_mod

    state = preempt.PreemptState(signals=(signal.SIGTERM,))
    state._previous[signal.SIGTERM] = lambda signum, frame: None  # the script's own handler
    monkeypatch.setattr(preempt, "PREEMPT", state)
    agent_stop = fr.FailureRecord(fr.SIGNAL, -1, "its agent got SIGTERM and stopped its workers", 1, "h1",
                                  signal="SIGTERM", by="agent", stop_step=pp.NO_STEP)
    now = [1000.0]
    monkeypatch.setattr(monitor_mod.time, "monotonic", lambda: now[0])
    stopped = []
    mon = types.SimpleNamespace(ch=types.SimpleNamespace(last_attempt=True, cause=lambda store: agent_stop),
                                _stop=threading.Event(), _left_since=None, _echo_seen=None,
                                _stopped_by=lambda cause, store: stopped.append(cause))
    watch = monitor_mod.Monitor._watch_failures
    watch(mon, None)
    now[0] += defaults.STOP_GRACE_S - 0.1
    watch(mon, None)
    assert stopped == []  # left to the handler, within the grace
    now[0] += 0.2
    watch(mon, None)
    assert stopped == [agent_stop]
