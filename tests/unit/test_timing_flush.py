"""At a clean exit every rank publishes its last, partial timing window and rank 0 keeps them all."""

import math

from ddprun.protocol import defaults
from ddprun.protocol.env import WorkerEnv
from ddprun.report import TIMINGS
from ddprun.telemetry import TIMER
from ddprun.worker.channel import JobChannel
from ddprun.worker.monitor import Monitor


class DictStore:
    """The TCPStore calls the channel's timing uses."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def multi_get(self, keys):
        return [self.data[k] for k in keys]

    def check(self, keys):
        return all(k in self.data for k in keys)


def monitor(rank, world, store, run_dir):
    environ = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    ch = JobChannel(environ, WorkerEnv(run_dir=str(run_dir)), connect=lambda: store)
    return Monitor(ch)  # never started: flush_timing is the exit path alone


def test_last_partial_windows_of_every_rank_reach_timings_csv(tmp_path):
    store = DictStore()
    TIMER.drain()
    for rank in (1, 2):  # the other ranks exit first: each publishes what it timed since its last window
        TIMER.record(0.010 * rank, 0.001, 0.005, 0.002, 0.001)
        monitor(rank, 3, store, tmp_path / "other").flush_timing()
    TIMER.record(0.005, math.nan)
    monitor(0, 3, store, tmp_path).flush_timing()
    rows = (tmp_path / TIMINGS).read_text().splitlines()
    ranks = {line.split(",")[1]: line.split(",") for line in rows[1:]}
    assert set(ranks) == {"0", "1", "2"} and float(ranks["2"][4]) == 0.02 and ranks["0"][5] == ""


def test_rank_0_waits_a_bounded_time_for_a_rank_that_never_flushes(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(defaults, "FINAL_TIMING_WAIT_S", 0.2)
    TIMER.drain()
    TIMER.record(0.01)
    t0 = time.monotonic()
    monitor(0, 2, DictStore(), tmp_path).flush_timing()
    waited = time.monotonic() - t0
    assert 0.2 <= waited < 2 and (tmp_path / TIMINGS).read_text().count("\n") == 2, waited


def test_the_exit_does_not_wait_for_the_monitor_threads_poll_interval(tmp_path, monkeypatch):
    """A monitor that also waits for preemption signals (a select on their fd) stops at once at the
    exit: the poll interval is not added to every run's exit."""
    import os
    import time

    monkeypatch.setattr(defaults, "MONITOR_POLL_S", 5.0)
    monkeypatch.setattr(defaults, "FINAL_TIMING_WAIT_S", 0.2)
    signals_r, signals_w = os.pipe()
    m = monitor(0, 1, DictStore(), tmp_path).start(signals_r)
    time.sleep(0.2)  # the thread is in its wait
    t0 = time.monotonic()
    m.flush_timing()
    took = time.monotonic() - t0
    assert not m._thread.is_alive() and took < 1.0, f"flush_timing took {took:.2f} s"
    os.close(signals_r)
    os.close(signals_w)
