"""ddprun's hooks in torch's agent (agent/torch_agent.py) that unit tests can reach without a job."""

import signal
from types import SimpleNamespace

import pytest

from ddprun.agent.torch_agent import AgentHooks, DdprunAgent


def test_the_node_is_marked_stopping_before_the_first_close_of_its_workers_only():
    """torch's poll closes the process context when a worker failed (SIGTERM to the others): exits are
    reported and the node marked first. A second close of the same context (torch's _shutdown after a
    failed rendezvous) must not report the workers that the first close stopped as failures."""
    said, closes = [], []
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(on_stopping=lambda why="1": said.append("stopping"))
    agent._report_exits = lambda group: said.append("exits")
    agent._pcontext = SimpleNamespace(close=lambda *a, **kw: closes.append(a))
    agent._say_before_close(SimpleNamespace())
    agent._pcontext.close()
    assert said == ["exits", "stopping"] and closes == [()]
    agent._pcontext.close(15, 30)
    assert said == ["exits", "stopping"] and closes == [(), (15, 30)]


def test_a_node_whose_round_the_rendezvous_moved_past_restarts_once_under_its_own_line(monkeypatch):
    """torch's c10d state removes a participant whose keep-alive went stale (a frozen agent); when
    that empties its round, the round number moves on and a new round may form without it, while its
    workers still train: torch's agent never notices. Its healthy check (num_nodes_waiting) answers 1
    then, once, and the restart is announced as a drop. A drop that leaves others in the round (only
    the record changed; one group still trains) restarts nothing."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ddprun.agent.torch_agent import round_moved_on

    me, other = object(), object()
    state = SimpleNamespace(participants={me: 0, other: 1}, wait_list=set(), round=4)
    handler = SimpleNamespace(_this_node=me, _state_holder=SimpleNamespace(state=state),
                              num_nodes_waiting=lambda: len(state.wait_list), shutdown=lambda: True)
    said = []
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(on_dropped=lambda: said.append("dropped"),
                              on_membership_change=lambda: said.append("a node waits"))
    agent._dropped, agent._joined_round, agent._pcontext = False, 4, None  # no workers started
    agent._preempt_said = None
    agent._watch_dropped(handler)
    agent._watch_dropped(handler)  # every rendezvous: wrapped once
    assert handler.num_nodes_waiting() == 0 and not round_moved_on(handler, 4)
    state.participants = {other: 1}  # dropped from the record, the round goes on with the other node
    assert handler.num_nodes_waiting() == 0
    state.participants, state.round = {}, 5  # the round emptied: the next one can form without it
    assert round_moved_on(handler, 4)
    assert handler.num_nodes_waiting() == 1 and handler.num_nodes_waiting() == 0  # once: torch restarts now
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda self, group: said.append("restart"))
    agent._restart_workers(SimpleNamespace(state=WorkerState.HEALTHY))
    agent._restart_workers(SimpleNamespace(state=WorkerState.HEALTHY))  # a later one: a node joining
    assert said == ["dropped", "restart", "a node waits", "restart"]
    assert not round_moved_on(SimpleNamespace(), 4) and not round_moved_on(handler, None)  # static; unknown


def test_a_group_whose_worker_failed_while_the_agent_was_frozen_is_not_restarted_as_dropped_or_joined(tmp_path):
    """Frozen (SIGSTOP) inside torch's healthy check, the agent is thawed after its worker failed and the
    rendezvous moved on: the failure is handled first (torch's next poll sees the group FAILED: with no
    restart left the node ends and says why), not a drop that stops the group and joins a rendezvous
    the others have left; nor is a node waiting to join taken for a reason to restart it."""
    me = object()
    state = SimpleNamespace(participants={}, wait_list={object()}, round=5)
    handler = SimpleNamespace(_this_node=me, _state_holder=SimpleNamespace(state=state),
                              num_nodes_waiting=lambda: len(state.wait_list), shutdown=lambda: True)
    said, codes = [], {0: None, 1: None}
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(on_dropped=lambda: said.append("dropped"))
    agent._dropped, agent._joined_round = False, 4
    agent._pcontext = SimpleNamespace(subprocess_handlers={
        rank: SimpleNamespace(proc=SimpleNamespace(poll=lambda rank=rank: codes[rank])) for rank in codes})
    agent._watch_dropped(handler)
    codes[1] = 0  # a rank that finished is no failure
    assert handler.num_nodes_waiting() == 1  # a node waits to join: taken in
    codes[0] = 1
    assert handler.num_nodes_waiting() == 0 and not agent._dropped
    state.wait_list = set()
    assert handler.num_nodes_waiting() == 0 and not agent._dropped and said == []
    codes[0] = 0  # every rank finished: torch's next poll sees SUCCEEDED, no rejoin of a finished job
    assert handler.num_nodes_waiting() == 0 and not agent._dropped
    codes[0] = None
    error_file = tmp_path / "rank-0.error.json"  # its main thread failed; another thread still runs
    agent._pcontext.error_files = {0: str(error_file)}
    assert handler.num_nodes_waiting() == 1 and agent._dropped
    agent._dropped = False
    error_file.write_text("{}")
    assert handler.num_nodes_waiting() == 0 and not agent._dropped
    error_file.unlink()

    def frozen_while_asked():  # the agent was stopped while it waited for the store; its worker failed meanwhile
        codes[0] = 1
        return 0

    handler_asked, handler._ddprun_watches_drop = handler.num_nodes_waiting, False
    handler.num_nodes_waiting = frozen_while_asked
    agent._watch_dropped(handler)
    assert handler.num_nodes_waiting() == 0 and not agent._dropped and said == []
    handler.num_nodes_waiting, codes[0] = handler_asked, None
    assert handler.num_nodes_waiting() == 1 and agent._dropped  # healthy and dropped: restarted as a drop


def test_an_answer_of_the_last_round_is_not_given_in_the_next(monkeypatch):
    """A node waited to join: torch restarted the group (membership change). In the next round the
    first healthy check is slow (a large job's store): the answer meanwhile is 'none waiting', not the
    last round's 1, which would restart the new group again, and again."""
    import threading

    from ddprun.agent import torch_agent

    monkeypatch.setattr(torch_agent, "ANSWER_WAIT_S", 0.05)
    slow, answers = threading.Event(), iter([1])
    handler = SimpleNamespace(num_nodes_waiting=lambda: next(answers, None) or (slow.wait(10) and 0),
                              shutdown=lambda: True)
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks()
    agent._dropped, agent._joined_round, agent._pcontext = False, None, None
    agent._watch_dropped(handler)
    assert handler.num_nodes_waiting() == 1  # torch restarts the group, rendezvous again
    agent._watch_dropped(handler)  # the next round
    assert [handler.num_nodes_waiting() for _ in range(3)] == [0, 0, 0]
    slow.set()


def test_a_worker_that_died_before_the_agent_was_signalled_or_the_grace_ended_is_reported_first(monkeypatch):
    """torch's _shutdown (a signal to the agent) and a preemption grace that ends in the monitor's
    poll: a worker already dead (SIGKILL: it wrote nothing) is reported as what it was before the
    agent says that it stops its workers, so its death is not recorded as stopped by the signal."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    said = []
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(on_worker_exit=lambda *a: said.append(("exit", a[0], a[3])),
                              on_stopping=lambda why="1": said.append("stopping"),
                              on_signal=lambda sig: said.append(("signal", sig)),
                              preempt_check=lambda: 15)
    agent._hooks_said_signal, agent._worker_group = None, SimpleNamespace(workers=[SimpleNamespace(global_rank=3)])
    agent._stop_grace_s = 30
    agent._pcontext = SimpleNamespace(subprocess_handlers={0: SimpleNamespace(
        proc=SimpleNamespace(poll=lambda: -9, pid=4242))}, close=lambda *a: None)  # torch < 2.12: ddprun closes
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", lambda self, *a, **kw: said.append("torch stops"))
    with pytest.raises(Exception, match="got signal: 15"):
        agent._monitor_workers(agent._worker_group)
    assert said == [("exit", 3, -9)]
    said.clear()
    agent._hooks.seen.clear()
    agent._shutdown(15)
    assert said == [("exit", 3, -9), "stopping", ("signal", 15), "torch stops"]


def test_a_stop_because_nothing_stops_at_a_step_is_marked_so_for_its_workers(monkeypatch):
    """The job answered NO_STEP: the agent stops its workers as torch's does, its mark saying why
    (a script's own handler for the signal then decides: worker/signals.py); other stops mark "1"."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ddprun.protocol import preempt as pp

    for none, mark in ((True, pp.STOPPING_FOR_NONE), (False, "1")):
        marks: list[str] = []
        agent = DdprunAgent.__new__(DdprunAgent)
        agent._hooks = AgentHooks(on_stopping=lambda why="1", marks=marks: marks.append(why),
                                  on_signal=lambda sig: None, preempt_check=lambda: 15,
                                  answered_none=lambda none=none: none)
        agent._hooks_said_signal, agent._worker_group = None, SimpleNamespace(workers=[])
        agent._stop_grace_s = 30
        agent._pcontext = SimpleNamespace(subprocess_handlers={}, close=lambda *a: None)
        monkeypatch.setattr(LocalElasticAgent, "_shutdown", lambda self, *a, **kw: None)
        with pytest.raises(Exception, match="got signal: 15"):
            agent._monitor_workers(agent._worker_group)
        agent._shutdown(15)
        assert marks == [mark]


def test_a_node_left_waiting_as_a_spare_when_the_job_closed_gets_a_rendezvous_error_not_a_crash(monkeypatch):
    """torch's agent returns None (RendezvousGracefulExitError) to a node in the rendezvous'
    redundancy list when the job closes; torch's own launcher then fails on None.is_failed()."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from ddprun.agent import torch_agent

    closed = []
    handler = SimpleNamespace(shutdown=lambda: closed.append(True) or True)
    monkeypatch.setattr(torch_agent.rdzv_registry, "get_rendezvous_handler", lambda params: handler)
    monkeypatch.setattr(torch_agent, "bind_workers_store", lambda h: None)
    monkeypatch.setattr(DdprunAgent, "__init__", lambda self, **kw: None)
    monkeypatch.setattr(DdprunAgent, "run", lambda self: None)
    config = SimpleNamespace(rdzv_backend="c10d", role="trainer", nproc_per_node=1, max_restarts=0,
                             monitor_interval=0.1, local_addr=None, logs_specs=None, start_method="spawn")
    with pytest.raises(RendezvousClosedError, match="waited in it as a spare"):
        torch_agent._run(config, "x.py", [], AgentHooks(), params=None)
    assert closed == [True]


def test_a_rendezvous_store_that_never_answers_neither_holds_torchs_loop_nor_lets_it_run_for_ever(monkeypatch):
    """A stopped (SIGSTOP) endpoint host: torch's TCPStore client waits for ever. torch's healthy check
    gets the last answer while one call is pending (its loop goes on: it sees its workers end), and
    torch's RendezvousConnectionError once that call has been pending for the bound (its agent then
    ends, and ddprun names the cause); shutdown gives up after its own bound. A slow answer is waited
    for, a fresh one given, an error raised."""
    import itertools
    import threading
    import time

    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from ddprun.agent import torch_agent

    monkeypatch.setattr(torch_agent, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setattr(torch_agent, "RENDEZVOUS_CALL_S", 0.5)
    monkeypatch.setattr(torch_agent, "SHUTDOWN_S", 0.3)
    frozen, answers = threading.Event(), itertools.chain([2], itertools.repeat(0))
    handler = SimpleNamespace(num_nodes_waiting=lambda: frozen.wait(30) and 0, shutdown=lambda: frozen.wait(30))
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks()
    agent._dropped, agent._joined_round, agent._pcontext = False, 4, None
    agent._watch_dropped(handler)
    t0, seen = time.monotonic(), []
    with pytest.raises(RendezvousConnectionError, match="did not answer for"):
        while time.monotonic() - t0 < 5:
            seen.append(handler.num_nodes_waiting())
    assert seen and set(seen) == {0} and 0.5 <= time.monotonic() - t0 < 1.5  # the last answer meanwhile
    assert handler.shutdown() is False and time.monotonic() - t0 < 2.5
    frozen.set()

    slow = SimpleNamespace(num_nodes_waiting=lambda: time.sleep(0.2) or next(answers), shutdown=lambda: True)
    agent._watch_dropped(slow)
    got = [slow.num_nodes_waiting() for _ in range(6)]
    assert got[0] == 0 and 2 in got  # pending: the last answer (none yet: 0); then the fresh one
    broken = SimpleNamespace(num_nodes_waiting=lambda: 1 / 0, shutdown=lambda: True)
    agent._watch_dropped(broken)
    with pytest.raises(ZeroDivisionError):
        broken.num_nodes_waiting()


def test_every_round_trains_on_its_group_rank_0s_store_also_when_rank_0_moves():
    """torch keeps a node's first-round store address for ever, but makes a new store on a node that
    becomes rank 0 later. Node A: rank 0 in round 0 (its server, port 1111), rank 1 in round 1 (B,
    a late node that sorts first, made port 2222), rank 0 again in round 2 (B gone): each round,
    the store its rank 0 has."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    from ddprun.agent.torch_agent import follow_round_store

    rounds = [HashStore() for _ in range(3)]
    rounds[1].set(RendezvousStoreInfo.MASTER_ADDR_KEY, "10.0.0.2")  # B, rank 0 of round 1, published it
    rounds[1].set(RendezvousStoreInfo.MASTER_PORT_KEY, "2222")
    a_server = SimpleNamespace(port=1111)
    handler = SimpleNamespace(_shared_tcp_store_server=a_server, _this_node=SimpleNamespace(addr="10.0.0.1"),
                              _bootstrap_store_info=RendezvousStoreInfo("10.0.0.1", 1111))
    ranks = iter([0, 1, 0])

    def torchs(round_=iter(range(3))):  # torch 2.13: the info it keeps, once it has one
        r = next(round_)
        return RendezvousInfo(rounds[r], next(ranks), 2, handler._bootstrap_store_info)

    handler.next_rendezvous = torchs
    follow_round_store(handler)
    seen = [(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
            for i in (handler.next_rendezvous() for _ in range(3))]
    assert seen == [("10.0.0.1", 1111), ("10.0.0.2", 2222), ("10.0.0.1", 1111)]
    assert (handler._bootstrap_store_info.master_addr, handler._bootstrap_store_info.master_port) == \
        ("10.0.0.1", 1111)  # what share_bootstrap publishes for the others in round 2


def test_another_backends_handler_is_left_as_it_is():
    from ddprun.agent.torch_agent import follow_round_store

    def own():
        return "static"

    handler = SimpleNamespace(next_rendezvous=own)
    follow_round_store(handler)
    assert handler.next_rendezvous is own


def test_a_workers_store_that_cannot_be_bound_falls_back_to_torchs_and_says_so(capsys):
    """An address this node cannot bind (not one of its own): torch's every-interface server, and one
    line in the agent's log (its stderr) that says so (SECURITY.md)."""
    from ddprun.agent.torch_agent import bind_workers_store

    made = []

    class Handler:
        def _create_tcp_store_server(self, addr, port):
            made.append((addr, port))
            return "torch's server"

    handler = Handler()
    bind_workers_store(handler)
    assert handler._create_tcp_store_server("192.0.2.77", 0) == "torch's server"
    assert made == [("192.0.2.77", 0)]
    err = capsys.readouterr().err
    assert err.startswith("ddprun: note: the workers' store listens on every interface: 192.0.2.77 could not be bound")


def test_a_node_waiting_to_join_while_the_job_stops_for_a_preemption_restarts_nothing():
    """torch restarts a healthy group when num_nodes_waiting > 0 (a membership change, which no
    restart budget bounds). During a preemption that restart would give the job a new attempt whose
    workers never heard of the agreed stop step: the grace would then force the stop, without the
    checkpoint. The waiting node joins the next launch instead."""
    state = SimpleNamespace(participants={}, wait_list={"late"}, round=4)
    handler = SimpleNamespace(_this_node=object(), _state_holder=SimpleNamespace(state=state),
                              num_nodes_waiting=lambda: len(state.wait_list), shutdown=lambda: True)
    preempting = [True]
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(preempting=lambda: preempting[0])
    agent._dropped, agent._joined_round, agent._pcontext = False, 4, None
    agent._watch_dropped(handler)
    assert handler.num_nodes_waiting() == 0
    preempting[0] = False  # no preemption: the node is taken in
    assert handler.num_nodes_waiting() == 1


@pytest.mark.parametrize(("forbidden", "left"), [(False, 2), (True, 0)])
def test_a_failed_group_is_restarted_unless_forbidden_when_it_failed(monkeypatch, forbidden, left):
    """Whether a preemption forbids the restart is asked when the group failed (restart_forbidden,
    which reads the job's answer then), not on a poll while only the request is known: a peer's
    SIGTERM that its ranks answered NO_STEP is a failure an elastic job restarts from."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(preempting=lambda: True, restart_forbidden=lambda: forbidden)
    agent._remaining_restarts, agent._preempt_said = 2, None
    agent._report_exits = lambda group: None
    states = iter([WorkerState.HEALTHY, WorkerState.FAILED])
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: RunResult(state=next(states)))
    agent._monitor_workers(SimpleNamespace())  # healthy, asked (the beat read the request only)
    assert agent._remaining_restarts == 2
    agent._monitor_workers(SimpleNamespace())
    assert agent._remaining_restarts == left


@pytest.mark.parametrize("agreed", [False, True])
def test_a_group_that_died_of_this_agents_own_signal_ends_the_agent_as_a_signal_unless_the_job_stops_at_a_step(
        monkeypatch, agreed):
    """SIGTERM to every process of a node, the job answering that nothing stops at a step: its workers
    die of it in the poll where the agent reads that answer. The agent ends as on a signal (torch then
    leaves the rendezvous open for an elastic job's other nodes), not as a failed group (which closes
    it). Where the job stops at a step, a failed group is a failure of the stop, said as such."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(preempting=lambda: agreed, restart_forbidden=lambda: True)
    agent._remaining_restarts, agent._preempt_said = 2, 15
    agent._report_exits = lambda group: None
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: RunResult(state=WorkerState.FAILED))
    if agreed:
        assert agent._monitor_workers(SimpleNamespace()).state == WorkerState.FAILED
    else:
        with pytest.raises(SignalException, match="got signal: 15"):
            agent._monitor_workers(SimpleNamespace())
    assert agent._remaining_restarts == 0


def test_a_preemption_signal_during_a_restart_or_flagged_before_it_ends_the_agent_at_once(monkeypatch):
    """While workers run, a first preemption signal is a flag; once a restart begins (the old workers
    stopping, the rendezvous again) there is no step to stop at: a signal ends the agent, and one
    flagged before the restart ends it before torch stops anything."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    said: list[str] = []
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(on_preempt_signal=lambda sig: said.append(f"flag {sig}"))
    agent._preempt_said, agent._workers_run, agent._dropped = None, True, False
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda self, group: said.append("restart"))
    agent._restart_workers(SimpleNamespace(state=WorkerState.HEALTHY))  # a node joins: the new workers not yet run
    with pytest.raises(SignalException, match="got signal: 15"):
        agent._preempt_signal(signal.SIGTERM, None)
    agent._workers_run = True  # the new workers run: a flag again
    agent._preempt_signal(signal.SIGTERM, None)
    with pytest.raises(SignalException, match="got signal: 15"):
        agent._restart_workers(SimpleNamespace(state=WorkerState.HEALTHY))
    assert said == ["restart", "flag 15"]


def test_on_a_torch_without_shutdown_timeout_the_agent_starts_and_a_signal_stop_keeps_ddprun_grace(monkeypatch):
    """torch 2.6-2.11's LocalElasticAgent takes no ``shutdown_timeout`` (seen on 2.11 on an H200: every
    ``ddprun run`` failed at start with a TypeError); its ``_shutdown`` closes with a fixed 30 s."""
    import signal

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ddprun.agent import torch_agent

    init: dict = {}
    monkeypatch.setattr(torch_agent, "TORCH_TAKES_SHUTDOWN_TIMEOUT", False)
    monkeypatch.setattr(LocalElasticAgent, "__init__", lambda self, **kw: init.update(kw))
    agent = DdprunAgent(hooks=AgentHooks(exit_barrier_s=7), shutdown_timeout=45, spec=None, logs_specs=None)
    assert "shutdown_timeout" not in init and init["exit_barrier_timeout"] == 7, init
    closes: list = []
    agent._pcontext = SimpleNamespace(close=lambda sig, timeout: closes.append((sig, timeout)))
    agent._worker_group, agent._hooks_said_signal = SimpleNamespace(workers=[]), None
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", lambda self, sig: closes.append(("torch", sig)))
    agent._shutdown(signal.SIGTERM)  # a signal to the agent: the workers get ddprun's grace
    assert closes == [(signal.SIGTERM, 45), ("torch", signal.SIGTERM)]
    closes.clear()
    agent._shutdown()  # any other stop: torch's 30 s, as torch >= 2.12 gives it
    assert closes == [(signal.SIGTERM, 30), ("torch", signal.SIGTERM)]


def test_under_nohup_torchs_agent_is_told_every_signal_it_handles_but_sighup():
    from ddprun.agent.torch_agent import without_hangup

    assert without_hangup(None) == "SIGTERM,SIGINT,SIGQUIT"  # torch's default, less SIGHUP
    assert without_hangup("SIGTERM, SIGHUP,SIGUSR1") == "SIGTERM,SIGUSR1"  # the user's own list, less SIGHUP
    assert without_hangup("SIGHUP") == ""


def test_a_worker_of_a_new_attempt_whose_pid_an_earlier_failed_worker_had_is_reported(monkeypatch):
    """pids wrap: a restarted group's worker may get the pid of one reported in an attempt before. Its
    death is reported all the same (its agent's record is the only one a SIGKILLed worker gets)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    said = []
    agent = DdprunAgent.__new__(DdprunAgent)
    agent._hooks = AgentHooks(on_worker_exit=lambda *a: said.append((a[0], a[2], a[3])))
    agent._pcontext, agent._remaining_restarts = None, 1
    group = SimpleNamespace(workers=[SimpleNamespace(global_rank=1)])
    monkeypatch.setattr(LocalElasticAgent, "_start_workers", lambda self, g: {0: 4242})
    for _ in range(2):  # two attempts
        agent._start_workers(group)
        agent._pcontext = SimpleNamespace(subprocess_handlers={0: SimpleNamespace(
            proc=SimpleNamespace(poll=lambda: -9, pid=4242))})
        agent._report_exits(group)
        agent._report_exits(group)  # torch's poll and its close: one report an attempt
        agent._pcontext = None
    assert said == [(1, 4242, -9), (1, 4242, -9)]
