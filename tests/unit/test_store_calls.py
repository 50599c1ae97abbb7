"""How the worker side reads the store at scale: one presence check when every key exists, and a
verdict awaited by one server-side wait instead of a poll (benchmarks/control_plane.py counts them)."""

import time
from datetime import timedelta

from torch.distributed import TCPStore

from ddprun.protocol.env import WorkerEnv
from ddprun.protocol.store import present
from ddprun.worker.channel import JobChannel


class Counting:
    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            return getattr(self.store, name)(*args)
        return call


def test_present_costs_one_call_when_every_key_exists_and_one_per_key_otherwise():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = Counting(server)
    for k in ("a", "b", "c"):
        server.set(k, "1")
    assert present(store, ["a", "b", "c"]) == ["a", "b", "c"] and store.calls == ["check"]
    store.calls.clear()
    assert present(store, ["a", "x", "c"]) == ["a", "c"] and store.calls == ["check"] * 4
    assert present(store, []) == []


def test_await_key_returns_when_the_key_is_set_and_false_at_its_timeout(tmp_path):
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environ = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(server.port), "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    client = Counting(TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=10)))
    ch = JobChannel(environ, WorkerEnv(run_dir=str(tmp_path)), connect=lambda: client)
    t0 = time.monotonic()
    assert not ch.await_key("verdict", 0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    server.set("verdict", "ok")
    assert ch.await_key("verdict", 5) and client.calls == ["wait", "wait"]  # no poll
    assert ch.store.get("verdict") == b"ok"  # the client is usable after the timed-out wait
