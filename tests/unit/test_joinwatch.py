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


def test_nodes_that_came_to_join_are_counted_while_they_beat():
    store = store_server()
    a, b = watcher(store, "node-a", 11), watcher(store, "node-b", 22)
    assert a._read().joined == ["node-a pid 11"]
    b._read()
    assert a._read().joined == ["node-a pid 11", "node-b pid 22"]
    store.set(keys.joining_key(int(store.add(keys.JOINING_COUNT_KEY, 1))), b"\x80not json")  # skipped
    assert a._read().joined == ["node-a pid 11", "node-b pid 22"]
    assert a.line(a._read()).startswith("ddprun: 2/2 nodes joined (node-a pid 11, node-b pid 22); waiting up to 60 s")
    time.sleep(0.7)  # node-b stopped beating (its workers started, or it died)
    a.last = a._read()
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

