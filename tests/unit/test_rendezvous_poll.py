"""A node waiting in torch's rendezvous looks at the round every poll_s(max_nodes) seconds, only while
it waits (agent/rendezvous_poll.py): a real two-node c10d rendezvous in two threads, torch's delays
recorded."""

import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from ddprun.agent import rendezvous_poll
from tests.helpers import free_port


def test_the_poll_is_a_tenth_of_a_second_for_small_jobs_and_torchs_second_from_100_nodes():
    assert [rendezvous_poll.poll_s(n) for n in (1, 2, 10, 20, 50, 100, 1000)] == [0.1, 0.1, 0.1, 0.2, 0.5, 1.0, 1.0]


def test_a_waiting_node_polls_at_the_short_interval_and_keeps_torchs_cache_once_joined(monkeypatch):
    delays: list[tuple[str, object]] = []

    def recorded(seconds: object) -> None:  # torch's _delay, recorded
        delays.append((threading.current_thread().name, seconds))
        if not isinstance(seconds, tuple) and threading.current_thread().name.startswith("node"):
            time.sleep(float(seconds))  # type: ignore[arg-type]  # a waiting node's poll, as torch's

    monkeypatch.setattr(dr, "_delay", recorded)
    port = free_port()
    handlers = [registry.get_rendezvous_handler(RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="poll", min_nodes=2, max_nodes=2,
        is_host="1" if i == 0 else "0", join_timeout="20")) for i in range(2)]
    assert [rendezvous_poll.quicken(h) for h in handlers] == [0.1, 0.1]
    got: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, handlers[i].next_rendezvous()), name=f"node{i}")
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert not any(t.is_alive() for t in threads)
        assert sorted(info.rank for info in got.values()) == [0, 1]  # type: ignore[attr-defined]
        assert {info.world_size for info in got.values()} == {2}  # type: ignore[attr-defined]
        # the node that joined first waited for the other: torch's 1 s polls, every one of them shortened;
        # round 0's random start skew (a tuple) is torch's own
        polls = [s for _, s in delays if not isinstance(s, tuple)]
        assert polls and set(polls) == {0.1}, delays
        assert [h._state_holder._cache_duration for h in handlers] == [1, 1]  # torch's, once joined
        dr._delay(1)  # another thread, not waiting in a rendezvous: torch's second
        assert delays[-1] == (threading.current_thread().name, 1)
    finally:
        for h in handlers:
            h.shutdown()


def test_a_handler_without_torchs_state_holder_is_left_as_it_is():
    class Other:
        def next_rendezvous(self):
            return "torch's"

    other = Other()
    assert rendezvous_poll.quicken(other) is None
    assert other.next_rendezvous() == "torch's"


def test_the_wrap_is_installed_once(monkeypatch):
    monkeypatch.setattr(dr, "_delay", lambda seconds: None)
    assert rendezvous_poll._install() and rendezvous_poll._install()
    wrapped = dr._delay
    assert getattr(wrapped, "ddprun_poll", False)
    rendezvous_poll._install()
    assert dr._delay is wrapped
    with pytest.raises(AttributeError):
        rendezvous_poll._WAITING.poll_s  # noqa: B018 - set only in a thread that waits
