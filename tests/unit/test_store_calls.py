"""How the worker side reads the store at scale: one presence check when every key exists, and a
verdict awaited by one server-side wait instead of a poll (benchmarks/control_plane.py counts them)."""

import time

from torch.distributed import TCPStore

from ddprun.protocol.env import WorkerEnv
from ddprun.protocol.store import present
from ddprun.worker.channel import JobChannel
from tests.helpers import Counting, store_client


def test_present_costs_one_call_when_every_key_exists_and_one_per_key_otherwise():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = Counting(server)
    for k in ("a", "b", "c"):
        server.set(k, "1")
    assert present(store, ["a", "b", "c"]) == ["a", "b", "c"] and store.calls == ["check"]
    store.calls.clear()
    assert present(store, ["a", "x", "c"]) == ["a", "c"] and store.calls == ["check"] * 4
    assert present(store, []) == []
    keys = [f"k{i}" for i in range(1024)]
    for k in keys:
        server.set(k, "1")
    server.delete_key("k700")
    store.calls.clear()
    assert present(store, keys) == keys[:700] + keys[701:]
    assert len(store.calls) <= 2 * 7 + 8 + 1  # halves down to 8 keys, then those 8 one by one


def test_await_key_returns_when_the_key_is_set_and_false_at_its_timeout(tmp_path):
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environ = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(server.port), "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    client = Counting(store_client(server.port, 10.0))
    ch = JobChannel(environ, WorkerEnv(run_dir=str(tmp_path)), connect=lambda: client)
    t0 = time.monotonic()
    assert not ch.await_key("verdict", 0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    server.set("verdict", "ok")
    assert ch.await_key("verdict", 5) and client.calls == ["wait", "wait"]  # no poll
    assert ch.store.get("verdict") == b"ok"  # the client is usable after the timed-out wait


def _channel(tmp_path, server, rank=1, world=4096):
    environ = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(server.port), "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    client = Counting(store_client(server.port, 10.0))
    return JobChannel(environ, WorkerEnv(run_dir=str(tmp_path)), connect=lambda: client), client


def test_reading_the_cause_costs_the_same_with_thousands_of_echoes_in_the_store(tmp_path):
    from ddprun.protocol import failure as fr
    from ddprun.protocol.store import ECHOES_READ, publish_failure

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ch, client = _channel(tmp_path, server)
    echo = fr.FailureRecord(fr.ERROR, 7, "RuntimeError: Connection reset by peer", 0, "a")
    for r in range(2000):  # every peer of a dead rank saw the connection go, and said so first
        publish_failure(server, ch.keys, echo.__class__(**{**echo.__dict__, "rank": r}))
    client.calls.clear()
    got = ch.failures()
    assert len(got) == ECHOES_READ and all(r.is_echo for r in got)
    assert client.calls == ["compare_set", "compare_set", "check", "multi_get"]
    killed = fr.FailureRecord(fr.SIGNAL, 2001, "", 1, "b", signal="SIGKILL", by="agent")
    assert publish_failure(server, ch.keys, killed) == 1  # the first cause: its rank waits for acks
    client.calls.clear()
    assert ch.cause() == killed and client.calls == ["compare_set", "check", "multi_get"]
    assert int(server.add(ch.keys.failures, 0)) == 2001 and int(server.add(ch.keys.alarm, 0)) == 2001


def test_a_quiet_poll_reads_one_key_and_a_raised_alarm_brings_the_failure(tmp_path, monkeypatch):
    from ddprun.protocol import failure as fr
    from ddprun.protocol.store import publish_failure
    from ddprun.telemetry import PROGRESS
    from ddprun.worker import monitor as monitor_mod

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ch, client = _channel(tmp_path, server, rank=1, world=4)
    m = monitor_mod.Monitor(ch)
    seen = []
    monkeypatch.setattr(m, "_stopped_by", lambda cause, store: seen.append(cause))
    m._tick(client)  # the first poll reads everything once, and publishes the progress
    client.calls.clear()
    PROGRESS.steps += 1  # trained on, within PROGRESS_PUBLISH_S of the last publish: no write yet
    m._tick(client)
    assert client.calls == ["compare_set"] and not seen  # the alarm, read without an add
    rec = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 0, "a")
    publish_failure(server, ch.keys, rec)
    client.calls.clear()
    m._tick(client)
    assert seen == [rec] and client.calls[0] == "compare_set"


def test_a_failed_call_while_agreeing_the_stop_step_is_made_again_at_the_next_poll(tmp_path, monkeypatch):
    """Every rank's monitor proposes a stop step at once; a store call that fails then (a timeout)
    must not leave this rank without the step the others stop at (collectives would mismatch)."""
    from ddprun.preempt import PREEMPT
    from ddprun.protocol import preempt as pp
    from ddprun.protocol.store import raise_alarm
    from ddprun.worker import monitor as monitor_mod

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ch, client = _channel(tmp_path, server, rank=1, world=4)
    m = monitor_mod.Monitor(ch)
    m._tick(client)
    monkeypatch.setattr(PREEMPT, "fit_active", True)
    monkeypatch.setattr(PREEMPT, "requested", False)
    monkeypatch.setattr(PREEMPT, "stop_step", None)
    monkeypatch.setattr(PREEMPT, "signame", PREEMPT.signame)
    server.set(ch.keys.preempt, pp.Request("SIGTERM", "agent", 0, "a", time.time()).to_json())
    server.set(ch.keys.preempt_stop, "120")  # what the job agreed on
    raise_alarm(server, ch.keys)
    real = client.compare_set
    fails = [TimeoutError("store timeout")]

    def flaky(*args):
        if fails:
            raise fails.pop()
        return real(*args)

    monkeypatch.setattr(client, "compare_set", flaky)
    try:
        m._tick(client)
    except TimeoutError:
        pass  # the monitor's loop logs it and polls again
    assert PREEMPT.stop_step is None
    m._tick(client)
    assert PREEMPT.requested and PREEMPT.stop_step == 120


def test_a_counter_that_holds_no_number_is_read_as_such_and_the_client_keeps_working(tmp_path):
    """TCPStore's add on such a value closes the client's connection: every read of the client then
    failed as if the store were down, and the failure path found no record."""
    from ddprun.protocol import failure as fr
    from ddprun.protocol.store import read_causes

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ch, client = _channel(tmp_path, server)
    keys = ch.keys
    server.set(keys.causes, "garbage")
    rec = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 0, "a")
    server.set(keys.failure(int(server.add(keys.failures, 1))), rec.to_json())
    assert list(read_causes(client, keys).values()) == [rec]  # among the job's first records
    from ddprun.protocol.store import read_counter

    assert read_counter(client, keys.causes) is None and read_counter(client, keys.failures) == 1
    assert read_counter(client, "absent") == 0 and not server.check(["absent"])  # nor created
    assert client.get(keys.failure(1)) == rec.to_json().encode()  # the connection is still there


def test_a_monitor_reading_the_job_store_goes_on_past_an_alarm_that_holds_no_number(tmp_path, monkeypatch):
    """A rank that talks to the job store itself read the alarm with add: a bad value made every poll
    fail until its monitor gave up. It reads on, and a failure recorded meanwhile is still seen."""
    from ddprun.protocol import failure as fr
    from ddprun.worker import monitor as monitor_mod

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ch, client = _channel(tmp_path, server, rank=1, world=4)
    m = monitor_mod.Monitor(ch)
    seen = []
    monkeypatch.setattr(m, "_stopped_by", lambda cause, store: seen.append(cause))
    server.set(ch.keys.alarm, "garbage")
    server.set(ch.keys.directs, "x")
    m._tick(client)
    m._tick(client)
    rec = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 0, "a")  # its writer's alarm add failed
    server.set(ch.keys.cause(int(server.add(ch.keys.causes, 1))), rec.to_json())
    m._tick(client)
    assert seen == [rec] and m._failed_polls == 0


def test_a_failure_read_that_times_out_keeps_the_alarm_for_the_next_poll(tmp_path, monkeypatch):
    """A read of the records slower than STORE_CALL_S gave "no failure", and the alarm that announced
    it counted as read: the rank did not look again until the alarm moved again."""
    from ddprun.protocol import defaults
    from ddprun.protocol import failure as fr
    from ddprun.protocol.store import publish_failure
    from ddprun.worker import monitor as monitor_mod

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ch, client = _channel(tmp_path, server, rank=1, world=4)
    m = monitor_mod.Monitor(ch)
    seen = []
    monkeypatch.setattr(m, "_stopped_by", lambda cause, store: seen.append(cause))
    m._tick(client)
    rec = fr.FailureRecord(fr.ERROR, 3, "ValueError: bad batch", 0, "a")
    publish_failure(server, ch.keys, rec)
    monkeypatch.setattr(defaults, "STORE_CALL_S", 0.2)

    class Slow(Counting):
        def multi_get(self, keys):
            time.sleep(0.6)  # the store's host busy, or the network slow, this once
            return self.store.multi_get(keys)

    try:
        m._tick(Slow(client.store))  # the monitor's loop drops this client and polls again with another
    except TimeoutError:
        pass
    assert seen == []
    m._tick(Counting(store_client(server.port, 10.0)))
    assert seen == [rec]
