"""Join progress from ddprun's own keys (agent/joinwatch.py), on a real TCPStore."""

from __future__ import annotations

import io
import time

import pytest

from ddprun.agent.admission import Newcomer
from ddprun.agent.joinwatch import JoinSnapshot, JoinWatcher
from ddprun.protocol import store as keys
from tests.helpers import store_server

pytestmark = pytest.mark.timeout(30)


def watcher(store, host: str, pid: int) -> JoinWatcher:
    me = Newcomer(f"127.0.0.1:{store.port}", "ddprun", "", False, "p")
    return JoinWatcher("127.0.0.1", store.port, "ddprun", me, 2, 60, io.StringIO(), (host, pid), stale_s=0.5)


def read(w: JoinWatcher) -> JoinSnapshot:
    """A beat, then every waiting node's entry read by ``w`` itself."""
    return w._entries(w._beat_once())


def test_nodes_that_came_to_join_are_counted_while_they_beat():
    store = store_server()
    a, b = watcher(store, "node-a", 11), watcher(store, "node-b", 22)
    assert read(a).joined == ["node-a pid 11"]
    read(b)
    assert read(a).joined == ["node-a pid 11", "node-b pid 22"]
    store.set(keys.joining_key(int(store.add(keys.JOINING_COUNT_KEY, 1))), b"\x80not json")  # skipped
    assert read(a).joined == ["node-a pid 11", "node-b pid 22"]
    assert a.line(read(a)).startswith("ddprun: 2/2 nodes joined (node-a pid 11, node-b pid 22); waiting up to 60 s")
    time.sleep(0.7)  # node-b stopped beating (its workers started, or it died)
    a.last = read(a)
    assert a.last.joined == ["node-a pid 11"]
    assert a.timeout_message() == "1/2 nodes joined (node-a pid 11); 1 missing"


def test_a_progress_line_comes_every_interval_with_the_seconds_left():
    import inspect
    import re

    from ddprun.protocol import defaults

    assert inspect.signature(JoinWatcher).parameters["interval_s"].default == defaults.JOIN_PROGRESS_S == 3.0
    store = store_server()
    out = io.StringIO()
    me = Newcomer(f"127.0.0.1:{store.port}", "ddprun", "", False, "p")
    t0 = time.monotonic()
    w = JoinWatcher("127.0.0.1", store.port, "ddprun", me, 2, 60, out, ("node-a", 11), interval_s=1.0).start()
    seen = []  # (seconds since the start, the line) as each line appears
    while len(seen) < 2 and time.monotonic() - t0 < 10:
        lines = out.getvalue().splitlines()
        seen += [(time.monotonic() - t0, line) for line in lines[len(seen):]]
        time.sleep(0.05)
    w.stop()
    w._thread.join(timeout=5)
    assert len(seen) == 2 and len(out.getvalue().splitlines()) <= 3
    for k, (at, line) in enumerate(seen, start=1):
        m = re.fullmatch(r"ddprun: 1/2 nodes joined \(node-a pid 11\); waiting up to 60 s \((\d+) s left\)", line)
        assert m, line
        assert at >= k * 1.0  # never before its interval
        assert 60 - at - 1 <= int(m.group(1)) <= 60 - k  # the seconds left when it was written


def test_the_seconds_left_are_the_nearest_whole_second():
    me = Newcomer("127.0.0.1:1", "ddprun", "", False, "p")
    w = JoinWatcher("127.0.0.1", 1, "ddprun", me, 2, 8, io.StringIO(), ("node-a", 11))
    snap = JoinSnapshot(reachable=True, joined=["node-a pid 11"])
    for elapsed, left in ((3.0, 5), (3.4, 5), (3.6, 4), (7.9, 0), (9.0, 0)):
        w._t0 = time.monotonic() - elapsed
        assert w.line(snap).endswith(f"waiting up to 8 s ({left} s left)"), (elapsed, w.line(snap))


def test_a_waiting_node_names_a_node_refused_for_its_nnodes_once_and_at_the_timeout():
    import json

    store = store_server()
    out = io.StringIO()
    me = Newcomer(f"127.0.0.1:{store.port}", "ddprun", "", False, "p", (2, 2), ("node-a", 11))
    w = JoinWatcher("127.0.0.1", store.port, "ddprun", me, 2, 60, out, ("node-a", 11))
    w._say_mismatch(w._beat_once())
    assert out.getvalue() == ""  # no node was refused
    store.set(keys.NNODES_REFUSED_KEY, json.dumps({"min": 3, "max": 3, "host": "node-b", "pid": 22}))
    w._say_mismatch(w._beat_once())
    w._say_mismatch(w._beat_once())
    said = ("node-b (agent pid 22) was refused: it was started with --nnodes 3, this job's nodes with --nnodes 2 "
            "(every node needs the same --nnodes)")
    assert out.getvalue() == f"ddprun: {said}\n"
    w.last = JoinSnapshot(reachable=True, joined=["node-a pid 11"])
    assert w.timeout_message() == f"1/2 nodes joined (node-a pid 11); 1 missing; {said}"


def test_a_refusal_from_before_a_node_came_is_not_news_to_it():
    # the key lives as long as the store: a late elastic node, or one relaunched into a running job,
    # said an old refusal as news and blamed its own join timeout on it
    import json
    import time

    store = store_server()
    out = io.StringIO()
    old = {"min": 3, "max": 3, "host": "node-b", "pid": 22, "t": time.time() - 120}
    store.set(keys.NNODES_REFUSED_KEY, json.dumps(old))
    me = Newcomer(f"127.0.0.1:{store.port}", "ddprun", "", False, "p", (2, 2), ("node-c", 33))
    w = JoinWatcher("127.0.0.1", store.port, "ddprun", me, 2, 60, out, ("node-c", 33))
    w._say_mismatch(w._beat_once())
    assert out.getvalue() == "" and w.mismatch == ""
    store.set(keys.NNODES_REFUSED_KEY, json.dumps({**old, "pid": 44, "t": time.time() - 5}))  # within the clocks' slack
    w._say_mismatch(w._beat_once())
    assert "node-b (agent pid 44) was refused" in out.getvalue()


def test_a_node_still_waiting_past_its_bound_says_once_it_was_not_taken_in_and_ends_its_agent(monkeypatch):
    """torch keeps a node that a full round left out in its redundancy list, with no deadline: where
    the job record cannot tell (node 0 could not write it), the node waited for ever, its line saying
    'waiting up to 2 s (0 s left)' every few seconds."""
    import os
    import re
    import signal

    from ddprun.agent import joinwatch

    killed = []
    monkeypatch.setattr(joinwatch.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    store = store_server()
    out = io.StringIO()
    me = Newcomer(f"127.0.0.1:{store.port}", "ddprun", "", False, "p")
    w = JoinWatcher("127.0.0.1", store.port, "ddprun", me, 2, 2, out, ("node-a", 11), interval_s=1.0,
                    stranded_s=3.0).start()
    w._thread.join(timeout=10)
    assert not w._thread.is_alive() and killed == [(os.getpid(), signal.SIGTERM)], out.getvalue()
    lines = out.getvalue().splitlines()
    assert re.match(rf"ddprun: error: this node was not taken into the job at the rendezvous endpoint 127.0.0.1:"
                    rf"{store.port}: its workers have not started (?:[3-9]|\d\d) s after it came, past --join-timeout 2 s, and "
                    r"torch would keep it waiting", lines[-2]), lines
    assert lines[-1].startswith("HINT: ") and w.refused == "\n".join(lines[-2:])
    assert [line for line in lines if line.startswith("ddprun: 1/2 nodes joined")], lines  # its lines until then
    assert joinwatch.stranded_after(120, 15) >= 120 + 5 + 15  # torch's deadline, rollback and a dead node's drop


def test_the_bound_never_ends_a_node_whose_workers_started_nor_the_stores_host(monkeypatch):
    from ddprun.agent import joinwatch

    killed = []
    monkeypatch.setattr(joinwatch.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    me = Newcomer("127.0.0.1:1", "ddprun", "", False, "p")
    started = JoinWatcher("127.0.0.1", 1, "ddprun", me, 2, 8, io.StringIO(), ("node-a", 11), stranded_s=30)
    started.stop()  # its workers started
    started._t0 = time.monotonic() - 100
    assert not started._stranded() and started.refused is None
    out = io.StringIO()
    host = JoinWatcher("127.0.0.1", 1, "ddprun", me, 2, 8, out, ("node-a", 11), stranded_s=30, hosted=True)
    host._t0 = time.monotonic() - 29
    assert not host._stranded()
    host._t0 = time.monotonic() - 31
    assert host._stranded() and killed == []  # said, and it keeps serving the job's store
    assert out.getvalue().rstrip().endswith("ddprun: this node hosts the store of that job: it serves it until the "
                                            "job ends (torch then closes the rendezvous and this launcher exits 1).")


def test_an_elastic_jobs_count_says_how_many_nodes_it_needs_and_how_many_it_takes():
    me = Newcomer("127.0.0.1:1", "ddprun", "", False, "p")
    w = JoinWatcher("127.0.0.1", 1, "ddprun", me, 4, 60, io.StringIO(), ("node-a", 11), min_nodes=2)
    w.last = JoinSnapshot(reachable=True, joined=["node-a pid 11"])
    assert w.timeout_message() == "1 of at least 2 (up to 4) nodes joined (node-a pid 11); 1 more needed"
    assert w.line(w.last).startswith("ddprun: 1 of at least 2 (up to 4) nodes joined (node-a pid 11); waiting up to")
    w.last = JoinSnapshot(reachable=True, joined=["node-a pid 11", "node-b pid 22"])
    assert w.timeout_message() == "2 of at least 2 (up to 4) nodes joined (node-a pid 11, node-b pid 22)"
    fixed = JoinWatcher("127.0.0.1", 1, "ddprun", me, 2, 60, io.StringIO(), ("node-a", 11), min_nodes=2)
    fixed.last = JoinSnapshot(reachable=True, joined=["node-a pid 11"])
    assert fixed.timeout_message() == "1/2 nodes joined (node-a pid 11); 1 missing"


def test_an_elastic_launch_that_timed_out_names_the_nodes_it_needed(tmp_path, monkeypatch):
    """--nnodes 2:4 with one node there: 1 more node was needed, not 3."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from ddprun.agent import joinwatch, torch_agent
    from ddprun.agent import run as run_mod

    class Watcher(JoinWatcher):
        def start(self):  # no thread: what it saw is this node alone
            self.last = JoinSnapshot(reachable=True, joined=["node-a pid 11"])
            return self

    def times_out(config, entrypoint, args, hooks):
        raise RendezvousTimeoutError("timed out")

    monkeypatch.setattr(joinwatch, "JoinWatcher", Watcher)
    monkeypatch.setattr(torch_agent, "run_agent", times_out)
    err = io.StringIO()
    assert run_mod.supervise(elastic_run(tmp_path, "2:4"), set(), io.StringIO(), err).exit_code == 1
    assert "ddprun: not every node joined within 120 s: 1 of at least 2 (up to 4) nodes joined (node-a pid 11); " \
           "1 more needed.\n" in err.getvalue(), err.getvalue()


def elastic_run(tmp_path, nnodes: str):
    """A prepared launch of a c10d job with ``--nnodes`` ``nnodes`` at an endpoint nothing serves."""
    from ddprun.agent import run as run_mod
    from ddprun.cluster.base import ClusterSpec
    from ddprun.cluster.detect import parse_nnodes
    from ddprun.config import LaunchConfig

    lo, hi = parse_nnodes(nnodes)
    spec = ClusterSpec(environment="test", min_nodes=lo, max_nodes=hi, nproc_per_node=1, node_rank=None,
                       master_addr="127.0.0.1", master_port=1, rdzv_backend="c10d", run_id="", device="cpu")
    return run_mod.prepare(LaunchConfig(run_dir=str(tmp_path)), spec, {}, "node-a", {})


# -- cost at scale: the endpoint's store serves torch's rendezvous too, and every node waits at once ---------------
def _nodes_waiting(store, n: int, first_started: int = 0) -> None:
    """``n`` nodes' entries, as their watchers write them; the first ``first_started`` have started."""
    import json

    for k in range(n):
        key = keys.joining_key(int(store.add(keys.JOINING_COUNT_KEY, 1)))
        store.set(key, json.dumps({"host": f"node-{k}", "pid": 100 + k, "beat": 1, "started": k < first_started}))


def _calls_of_a_read(w: JoinWatcher, store) -> list[str]:
    from tests.helpers import Counting

    w._beat_once()  # announced: what follows is a steady read
    counted = Counting(store)
    w._store = counted
    w._snapshot(w._beat_once())
    return counted.calls


@pytest.mark.parametrize("hosted", [True, False])
def test_a_watchers_store_calls_do_not_grow_with_the_nodes_waiting(hosted):
    calls = {}
    for n in (3, 300):
        store = store_server()
        host = watcher(store, "node-host", 1)
        host._hosted = True
        w = host if hosted else watcher(store, "node-a", 2)
        _nodes_waiting(store, n)
        if not hosted:
            host._snapshot(host._beat_once())  # the store's host has published its summary
        calls[n] = _calls_of_a_read(w, store)
    assert calls[3] == calls[300], calls
    # beat, then: the host reads every entry in one batch (counter, one check, multi_get) and publishes;
    # another node reads that one key
    assert calls[300] == (["set", "compare_set", "check", "multi_get", "set"] if hosted else ["set", "check", "get"])


def test_a_node_reads_the_hosts_summary_and_every_entry_itself_once_the_host_started():
    store = store_server()
    host, a = watcher(store, "node-host", 1), watcher(store, "node-a", 2)
    host._hosted = True
    _nodes_waiting(store, 20)
    host._snapshot(host._beat_once())
    snap = a._snapshot(a._beat_once())
    assert snap.count == 21 and len(snap.joined) == 8 and snap.joined[0] == "node-0 pid 100"
    assert a.line(snap).startswith("ddprun: 21/2 nodes joined (node-0 pid 100, node-1 pid 101, node-2 pid 102, "
                                   "node-3 pid 103, node-4 pid 104, node-5 pid 105, node-6 pid 106, node-7 pid 107, "
                                   "... and 13 more); waiting up to 60 s")
    host._mark_started()  # its workers started: the summary is no longer kept
    snap = a._snapshot(a._beat_once())
    assert snap.count is None and len(snap.joined) == 21  # node-a's own read: the host's entry is gone, a's is in
    assert "node-host pid 1" not in snap.joined and "node-a pid 2" in snap.joined


def test_a_summary_whose_number_stopped_moving_is_not_used():
    store = store_server()
    host, a = watcher(store, "node-host", 1), watcher(store, "node-a", 2)
    host._hosted = True
    host._snapshot(host._beat_once())  # one summary: node-host alone
    a._interval = 0.1  # stale after 2 intervals and a poll
    assert a._snapshot(a._beat_once()).count == 1
    a._summary_seen = (a._summary_seen[0], time.monotonic() - 2 * 0.1 - 1.1)  # the host froze since
    snap = a._snapshot(a._beat_once())
    assert snap.count is None and snap.joined == ["node-host pid 1", "node-a pid 2"]


def test_keys_counted_but_not_written_yet_are_read_once_written_and_started_nodes_never_again():
    from ddprun.agent.joinwatch import Entries, joining_entries

    store = store_server()
    _nodes_waiting(store, 40, first_started=10)
    for _ in range(3):  # three nodes between their counter and their first write
        store.add(keys.JOINING_COUNT_KEY, 1)
    known = Entries()
    got = joining_entries(store, known)
    assert len(got) == 40 and len(known.present) == 30 and known.pending == [keys.joining_key(k) for k in (41, 42, 43)]
    store.set(keys.joining_key(42), '{"host": "late", "pid": 9, "beat": 1}')
    got = joining_entries(store, known)
    assert set(got) == set(known.present) and keys.joining_key(42) in got and len(got) == 31
    assert known.pending == [keys.joining_key(41), keys.joining_key(43)]


def test_a_join_count_that_holds_no_number_keeps_what_was_read_and_the_client_working():
    from ddprun.agent.joinwatch import Entries, joining_entries

    store = store_server()
    _nodes_waiting(store, 4)
    known = Entries()
    assert len(joining_entries(store, known)) == 4
    store.set(keys.JOINING_COUNT_KEY, "not a count")  # another program's value under the key
    assert len(joining_entries(store, known)) == 4 and known.counted == 4
    assert store.check([keys.joining_key(1)])  # the client still answers


def test_before_its_first_line_a_node_without_the_hosts_summary_reads_no_entry():
    from tests.helpers import Counting

    store = store_server()
    a = watcher(store, "node-a", 2)
    _nodes_waiting(store, 50)
    a._beat_once()
    counted = Counting(store)
    a._store = counted
    assert a._snapshot(a._beat_once(), early=True) is None  # the host's summary is about to come
    assert counted.calls == ["set", "check"]
    assert a._snapshot(a._beat_once()).joined[:2] == ["node-0 pid 100", "node-1 pid 101"]  # a line: it reads
