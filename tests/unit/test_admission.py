"""Who may join the job at an endpoint, and the run id the nodes agree on (agent/admission.py),
on a real TCPStore."""

from __future__ import annotations

import io
import re
import threading
import time

import pytest
from torch.distributed import TCPStore

from ddprun.agent import admission
from ddprun.errors import LaunchError
from ddprun.protocol import store as keys
from ddprun.protocol.store import JobRecord
from tests.helpers import store_server

pytestmark = pytest.mark.timeout(30)


def me(explicit=False, token="", proposal="20261201-000000-aaaaaa", rdzv_id="ddprun", nnodes=None, agent=("?", 0)):
    return admission.Newcomer("h:1", rdzv_id, token, explicit, proposal, nnodes, agent)


def job(nnodes=2, lo=2, hi=2, round_=0):
    return JobRecord("run-a", round_, nnodes, lo, hi, time.time() - 60)


@pytest.fixture
def store():
    return store_server()


def test_a_full_job_refuses_everyone_and_an_elastic_one_with_room_takes_its_nodes():
    assert "it is full (2 of 2 node(s))" in admission.refusal_reason(job(), -1)
    # an elastic job with room: a node with its identity (the claim passed, whatever it is) arrives late
    assert admission.refusal_reason(job(2, 1, 3), -1) is None
    assert admission.refusal_reason(None, -1) is None  # forming: torch's rendezvous decides
    assert admission.refusal_reason(job(round_=3), 3) is None  # re-forming after a failure


def test_an_elastic_job_of_default_identity_says_who_it_takes_in():
    assert "takes in any node started with the same command" in admission.elastic_note(me(), 1, 3)
    assert admission.elastic_note(me(token="t"), 1, 3) is None and admission.elastic_note(me(explicit=True), 1, 3) \
        is None
    assert admission.elastic_note(me(), 2, 2) is None and admission.elastic_note(me(), 1, 1) is None


def test_a_bad_job_record_is_no_job():
    for raw in (b"", b"{", b"[]", b'{"run_id": "x"}', b'{"run_id":1,"round":"a","nnodes":2,"min_nodes":1,'
                                                       b'"max_nodes":2,"since":0}', b"\xff"):
        assert JobRecord.parse(raw) is None, raw
    j = job()
    assert JobRecord.parse(j.to_json()) == JobRecord.parse(j.to_json().encode()) == j


def test_every_node_takes_the_first_proposal_and_an_explicit_id_as_given(store):
    assert admission.admit(store, me(proposal="first")) == "first"
    assert admission.admit(store, me(proposal="second")) == "first"
    other = store_server()
    assert admission.admit(other, me(explicit=True, rdzv_id="job1")) == "job1"


@pytest.mark.parametrize("planted", ["../../home/user/.ssh", "/etc", ".."])
def test_a_run_id_in_the_store_that_is_a_path_is_refused_not_used_as_the_run_directory(store, planted):
    store.set(keys.RUN_ID_KEY, planted)  # written by something other than the job's nodes
    with pytest.raises(LaunchError) as e:
        admission.admit(store, me(proposal="mine"))
    msg = str(e.value)
    assert "cannot name a run directory" in msg and f"run id {planted!r} in the store" in msg and "HINT" in msg


def beating(store, nodes, moving=True):
    """The nodes' endpoint beats; ``moving``: they advance 0.5 s later (alive agents)."""
    for n in nodes:
        store.set(keys.job_beat_key(n), "1")
    if moving:
        t = threading.Timer(0.5, lambda: [store.set(keys.job_beat_key(n), "2") for n in nodes])
        t.start()
        return t
    return None


def test_a_running_full_job_refuses_with_its_run_nodes_and_age(store):
    admission.admit(store, me())
    admission.publish_start(store, job(), 0, "node-a", 11)
    admission.publish_start(store, job(), 1, "node-b", 22)
    beating(store, (0, 1))
    with pytest.raises(LaunchError) as e:
        admission.admit(store, me())
    msg = str(e.value)
    assert msg.startswith("Refused: the job at the rendezvous endpoint h:1 runs already, and it is full"), msg
    assert "Seen: run run-a, 2 node(s): node-a (agent pid 11), node-b (agent pid 22); running since " in msg, msg
    assert re.search(r"\(6\d s\)", msg) and "HINT: " in msg


def test_a_full_job_with_a_node_gone_lets_torch_decide(store):
    # node 1's agent died and is being restarted: its beat stands still; refusing it would leave the
    # job waiting for it until the join timeout
    admission.publish_start(store, job(), 0, "node-a", 11)
    admission.publish_start(store, job(), 1, "node-b", 22)
    store.set(keys.job_beat_key(0), "1")
    threading.Timer(0.5, lambda: store.set(keys.job_beat_key(0), "2")).start()
    store.set(keys.job_beat_key(1), "7")
    assert admission.admit(store, me(proposal="p")) == "p"


def test_an_ended_job_says_its_host_is_closing(store):
    admission.publish_end(store, job())
    with pytest.raises(LaunchError, match="it has ended and the node hosting its store is closing"):
        admission.admit(store, me())


def test_a_job_re_forming_is_not_refused_for_an_end_its_node_0_published():
    ended = JobRecord("run-a", 3, 2, 2, 2, time.time() - 60, ended=True)
    assert admission.refusal_reason(ended, 3) is None  # re-forming round 3: node 0 comes back
    assert "it has ended" in admission.refusal_reason(ended, 2)  # an older restart's mark: it has ended


def test_a_job_whose_restart_could_not_re_form_and_ended_tells_a_relaunch_it_ended(store):
    # a restart marked round 1 re-forming, its rendezvous then timed out and node 0's agent ended
    admission.admit(store, me(proposal="p"))
    admission.publish_start(store, job(round_=1), 0, "node-a", 11)
    admission.publish_reforming(store, 1)
    admission.publish_end(store, job(round_=1))
    with pytest.raises(LaunchError, match="it has ended and the node hosting its store is closing"):
        admission.admit(store, me(proposal="q"))


def test_node_0_relaunched_after_a_signal_ended_its_agent_is_taken_back_by_the_re_forming_job(store):
    # node 0's agent died of a signal (SIGQUIT, say) and published the job's end on its way out; the
    # other node re-forms with --max-restarts: refusing the relaunched node 0 would leave it waiting
    admission.admit(store, me(proposal="p"))
    admission.publish_start(store, job(round_=1), 0, "node-a", 11)
    admission.publish_start(store, job(round_=1), 1, "node-b", 22)
    admission.publish_end(store, job(round_=1))
    admission.publish_reforming(store, 1)
    assert admission.admit(store, me(proposal="q")) == "p"


def test_a_node_started_with_another_nnodes_is_refused_at_once_naming_both_and_who_set_the_jobs(store):
    assert admission.admit(store, me(proposal="p", nnodes=(2, 2), agent=("node-a", 11))) == "p"
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        admission.admit(store, me(proposal="q", nnodes=(3, 3), agent=("node-b", 22)))
    assert time.monotonic() - t0 < 1.0
    assert str(e.value).splitlines() == [
        "Refused: this node was started with --nnodes 3, the job at the rendezvous endpoint h:1 with --nnodes 2.",
        "Seen: --nnodes 2 from node-a (agent pid 11), the job's first node; --nnodes 3 on this node",
        "HINT: Give every node of the job the same --nnodes: 2 to join this job, or stop its nodes and start every "
        "one with 3. If that job has just ended, start again in a few seconds."]
    assert admission.parse_nnodes(store.get(keys.NNODES_REFUSED_KEY)) == ((3, 3), "node-b (agent pid 22)")
    # a node with the job's --nnodes (a relaunch of one of its nodes, a late elastic one) is let in
    assert admission.admit(store, me(proposal="r", nnodes=(2, 2), agent=("node-a", 33))) == "p"
    elastic = store_server()
    admission.admit(elastic, me(nnodes=(1, 3), agent=("node-a", 11)))
    with pytest.raises(LaunchError, match=r"started with --nnodes 2:3, .* with --nnodes 1:3\."):
        admission.admit(elastic, me(nnodes=(2, 3), agent=("node-b", 22)))


def test_another_job_at_the_endpoint_is_refused_before_the_job_record_is_read(store):
    admission.admit(store, me(token="a"))
    with pytest.raises(LaunchError, match="different DDPRUN_JOB_TOKEN"):
        admission.admit(store, me(token="b"))


def test_a_job_re_forming_after_a_failure_takes_a_node_back(store):
    admission.publish_start(store, job(round_=1), 0, "node-a", 11)
    admission.publish_reforming(store, 1)
    assert admission.admit(store, me(proposal="p")) == "p"


def test_the_first_start_time_is_kept_across_rounds(store):
    admission.publish_start(store, JobRecord("r", 0, 2, 2, 2, 100.0), 0, "a", 1)
    admission.publish_start(store, JobRecord("r", 1, 2, 2, 2, 200.0), 0, "a", 1)
    assert JobRecord.parse(store.get(keys.JOB_KEY)) == JobRecord("r", 1, 2, 2, 2, 100.0)


def test_a_node_left_out_of_a_complete_round_knows_it(store):
    admission.publish_start(store, job(), 0, "node-a", 11)
    assert admission.left_out(store, "node-c", 33) is None  # round not complete yet: it may be in it
    admission.publish_start(store, job(), 1, "node-b", 22)
    assert admission.left_out(store, "node-b", 22) is None
    seen = admission.left_out(store, "node-c", 33)
    assert seen is not None and seen[1] == ["node-a (agent pid 11)", "node-b (agent pid 22)"]


def test_nothing_at_the_endpoint_is_said_while_waiting_and_named_at_the_bound():
    out = io.StringIO()
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"the rendezvous host 127.0.0.1:1 was never reachable"):
        admission.connect("127.0.0.1", 1, False, 1.5, out, line_every_s=0.5)
    assert time.monotonic() - t0 < 4
    assert "ddprun: rendezvous host 127.0.0.1:1 not reachable yet" in out.getvalue()


@pytest.fixture
def not_a_store():
    """A port another program holds: it takes connections, answers garbage and hangs up."""
    import socket

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            with c:
                c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    done.set()
    t.join(5)
    srv.close()


def test_a_host_whose_endpoint_port_another_program_holds_names_it_long_before_the_join_timeout(not_a_store,
                                                                                                 monkeypatch):
    # it waited out the join timeout, then said the endpoint "was never reachable" and to start ddprun
    # on the node that hosts it: the node it ran on
    from ddprun.protocol import defaults

    monkeypatch.setattr(defaults, "SELF_CONNECT_S", 1.0)  # a client's connect bound: max of these (60 s)
    monkeypatch.setattr(admission, "STORE_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        admission.connect("127.0.0.1", not_a_store, True, 120, io.StringIO(), line_every_s=0.5)
    assert time.monotonic() - t0 < 8  # one client's bound, not the join timeout
    msg = str(e.value)
    assert msg.startswith(f"The rendezvous endpoint 127.0.0.1:{not_a_store} takes connections, but no rendezvous "
                          "store answers there.\nSeen: ")
    assert "this node is the endpoint's host, and the port is taken" in msg and "another --rdzv-endpoint port" in msg
    # a node that only dials it says the same at its join timeout, not "never reachable"
    with pytest.raises(LaunchError, match="takes connections, but no rendezvous store answers there"):
        admission.connect("127.0.0.1", not_a_store, False, 1.0, io.StringIO(), line_every_s=0.5)


def test_the_host_hosts_a_store_that_torch_can_share():
    from ddprun.agent.endpoint import free_port

    port = free_port("127.0.0.1")
    store, hosted = admission.connect("127.0.0.1", port, True, 5, io.StringIO())
    assert hosted
    # torch's c10d handler asks for the same server (multi_tenant): it gets this one
    shared = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    store.set("k", "v")
    assert shared.get("k") == b"v"


def test_a_store_hosted_on_every_interface_is_said_and_one_bound_to_an_address_is_not():
    from ddprun.agent.endpoint import free_port

    said = {}
    for bind in ("127.0.0.1", None):
        out, port = io.StringIO(), free_port("127.0.0.1")
        store, hosted = admission.connect("127.0.0.1", port, True, 5, out, bind=bind)
        assert hosted
        said[bind] = out.getvalue()
        del store
    assert said["127.0.0.1"] == ""
    assert said[None].startswith("ddprun: note: the rendezvous store listens on every interface, port ")


def test_the_host_listens_where_its_name_resolves_here_or_on_the_plans_address():
    from ddprun.agent.endpoint import store_bind

    assert store_bind("127.0.0.1", "127.0.0.1", False) == "127.0.0.1"  # every node on this machine
    assert store_bind("localhost", None, False) == "127.0.0.1"
    # a multi-node job whose endpoint name is loopback here (a container's own name): the plan's address,
    # unless the user named an interface (then every interface: the peers may dial another network)
    assert store_bind("localhost", "10.9.9.9", False) == "10.9.9.9"
    assert store_bind("localhost", "10.9.9.9", True) is None
    assert store_bind("192.0.2.77", None, False) is None  # not an address of this machine: every interface
    assert store_bind("nosuch.invalid", None, False) is None


def test_a_host_that_cannot_listen_says_so_at_once():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="cannot listen at 192.0.2.77:"):
        admission.connect("192.0.2.77", 5999, True, 30, io.StringIO(), bind="192.0.2.77")
    assert time.monotonic() - t0 < 5


def test_torchs_is_host_spellings():
    for value, want in (("t", True), ("y", True), ("1", True), ("f", False), ("n", False), ("false", False)):
        assert admission.should_host("192.0.2.77", {"is_host": value}, "c10d", 3) is want
    assert admission.should_host("x", {}, "static", 0) and not admission.should_host("x", {}, "static", 1)


def test_the_endpoint_beat_never_waits_on_a_gone_endpoint():
    """torch's client retries a refused connect for its whole timeout; the beat checks the port first."""
    import time as _time

    from ddprun.agent.admission import EndpointBeat
    from tests.helpers import free_port

    beat = EndpointBeat("127.0.0.1", free_port())
    t0 = _time.monotonic()
    beat(0, 1)
    assert _time.monotonic() - t0 < 1.0
    t0 = _time.monotonic()
    beat(0, 2)  # within 5 s of the failure: not tried again
    assert _time.monotonic() - t0 < 0.1 and beat._store is None


def test_a_live_job_is_seen_alive_as_soon_as_every_beat_moved_even_when_one_is_held_up(store):
    store.set(keys.job_beat_key(0), "1")
    store.set(keys.job_beat_key(1), "1")
    threading.Timer(0.3, lambda: store.set(keys.job_beat_key(0), "2")).start()
    threading.Timer(2.0, lambda: store.set(keys.job_beat_key(1), "2")).start()  # a loaded node's beat, late
    t0 = time.monotonic()
    assert admission.job_alive(store, job(), wait_s=5.0)
    assert 2.0 <= time.monotonic() - t0 < 4.0  # not before the late beat, not the whole wait
    store.set(keys.job_beat_key(1), "3")
    threading.Timer(0.3, lambda: store.set(keys.job_beat_key(0), "3")).start()
    t0 = time.monotonic()
    assert not admission.job_alive(store, job(), wait_s=1.0)  # node 1 stands still: not alive
    assert 1.0 <= time.monotonic() - t0 < 2.0


def test_the_launch_keeps_an_endpoint_client_whose_calls_a_stopped_host_cannot_hold(tmp_path, monkeypatch, request):
    """After admission, the endpoint's store is written on torch's loop (the job record at each start,
    a restart's reforming mark, node 0's end): a host stopped by SIGSTOP never answers (torch's client
    waits for ever), so each of those calls gives up after STORE_CALL_S and the launch goes on."""
    from ddprun.agent import run as run_mod
    from ddprun.cluster.base import ClusterSpec
    from ddprun.config import LaunchConfig
    from ddprun.protocol import defaults

    thawed = threading.Event()
    # the calls given up on wait on their helper threads: they end with the test, not 20 s into a
    # later one that counts bounded calls in flight (test_node_relay.py's frozen port)
    request.addfinalizer(thawed.set)

    class StoppedHost:  # what torch's client does when the host is stopped: it waits
        def __getattr__(self, name):
            return lambda *a, **kw: thawed.wait(20)

    monkeypatch.setattr(defaults, "STORE_CALL_S", 0.3)
    monkeypatch.setattr(admission, "connect", lambda *a, **kw: (StoppedHost(), False))
    monkeypatch.setattr(admission, "client", lambda *a, **kw: thawed.wait(20) and StoppedHost())  # it waits too
    monkeypatch.setattr(admission, "admit", lambda store, newcomer: "run-b")
    spec = ClusterSpec(environment="test", min_nodes=2, max_nodes=2, nproc_per_node=1, node_rank=1,
                       master_addr="127.0.0.1", master_port=29999, rdzv_backend="c10d", run_id="", device="cpu")
    run = run_mod.admit_run(run_mod.prepare(LaunchConfig(run_dir=str(tmp_path)), spec, {}, "node-b", {}),
                            io.StringIO())
    assert run.run_id == "run-b"
    t0 = time.monotonic()
    admission.publish_start(run.endpoint_store, job(), 1, "node-b", 22)
    admission.publish_reforming(run.endpoint_store, 1)
    admission.publish_end(run.endpoint_store, job())
    assert time.monotonic() - t0 < 1.5
    run.endpoint_store.close()


def test_the_launchs_endpoint_client_writes_again_once_a_host_that_outlived_a_calls_bound_answers(
        tmp_path, monkeypatch, request):
    """The endpoint's host was stopped longer than STORE_CALL_S (SIGSTOP then SIGCONT, a paused VM) while
    a restart's mark was written: the job record of the next start must reach the store, or the job
    looks re-forming for ever (a newcomer is let into a full job). No call waits past the bound."""
    from ddprun.agent import run as run_mod
    from ddprun.cluster.base import ClusterSpec
    from ddprun.config import LaunchConfig
    from ddprun.protocol import defaults

    thawed = threading.Event()
    request.addfinalizer(thawed.set)  # the stuck call's helper thread ends with the test

    class Store:
        def __init__(self, frozen_s=0.0):
            self.sets, self.frozen_s = {}, frozen_s

        def set(self, key, value):
            if self.frozen_s:  # the first call: the host is stopped past the bound
                thawed.wait(self.frozen_s)
                self.frozen_s = 0.0
            self.sets[key] = value

        def compare_set(self, key, expected, value):
            return self.sets.setdefault(key, value)

    first, later = Store(frozen_s=20.0), Store()
    dialled = []
    monkeypatch.setattr(defaults, "STORE_CALL_S", 0.3)
    monkeypatch.setattr(admission, "connect", lambda *a, **kw: (first, False))
    monkeypatch.setattr(admission, "admit", lambda store, newcomer: "run-b")
    monkeypatch.setattr(admission, "client", lambda *a, **kw: dialled.append(a) or later)
    spec = ClusterSpec(environment="test", min_nodes=2, max_nodes=2, nproc_per_node=1, node_rank=0,
                       master_addr="127.0.0.1", master_port=29999, rdzv_backend="c10d", run_id="", device="cpu")
    run = run_mod.admit_run(run_mod.prepare(LaunchConfig(run_dir=str(tmp_path)), spec, {}, "node-a", {}),
                            io.StringIO())
    t0 = time.monotonic()
    admission.publish_reforming(run.endpoint_store, 1)  # stuck: given up at the bound
    assert time.monotonic() - t0 < 1.0
    waits, deadline = [], time.monotonic() + 5
    while keys.JOB_KEY not in later.sets and time.monotonic() < deadline:
        t0 = time.monotonic()
        admission.publish_start(run.endpoint_store, job(round_=2), 0, "node-a", 11)
        waits.append(time.monotonic() - t0)
        time.sleep(0.05)
    assert JobRecord.parse(later.sets.get(keys.JOB_KEY)) is not None, (waits, dialled)
    assert dialled == [("127.0.0.1", 29999, 0.3)] and max(waits) < 0.3, (waits, dialled)
    run.endpoint_store.close()


def test_a_slow_store_is_named_with_the_hosts_lines_for_the_address_torch_dials(monkeypatch):
    from ddprun.agent.endpoint import dialled_as
    from ddprun.protocol import defaults

    assert (dialled_as("10.0.0.5"), dialled_as("2001:db8::5"), dialled_as("node01")) == (
        "::ffff:10.0.0.5", "2001:db8::5", None)
    monkeypatch.setattr(defaults, "SLOW_STORE_START_S", 0.05)
    out = io.StringIO()
    assert admission._timed(out, "10.0.0.5", "answer", lambda: time.sleep(0.1) or "store") == "store"
    assert admission._timed(out, "node01", "start", lambda: "store") == "store"  # quick: nothing said
    assert admission._timed(out, "node01", "start", lambda: time.sleep(0.1)) is None  # no store: nothing said
    [line] = out.getvalue().splitlines()
    assert "the rendezvous store at 10.0.0.5 took 0.1 s to answer" in line
    assert "'::ffff:127.0.0.1 localhost'" in line and "'::ffff:10.0.0.5 <its name>'" in line
    assert "'::ffff:<the IPv4 address node01 resolves to> node01'" in admission.slow_store_line(4.0, "node01", "start")
