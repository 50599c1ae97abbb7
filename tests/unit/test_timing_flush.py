"""At a clean exit every rank publishes its last, partial timing window and rank 0 keeps them all."""

import math

from ddprun.jobstore import JobChannel
from ddprun.report import TIMINGS
from ddprun.telemetry import TIMER


class DictStore:
    """The three TCPStore calls the channel's timing uses."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def channel(rank, world, store, run_dir):
    ch = JobChannel.__new__(JobChannel)  # no TCPStore: the timing methods only need these fields
    ch.rank, ch.world_size, ch.run_dir, ch.prefix, ch._store, ch._thread = rank, world, run_dir, "a0/", store, None
    ch._window, ch._seen_windows, ch._detector, ch.hosts = 0, {}, None, {}
    ch.straggler_margin, ch.straggler_windows = 0.2, 3
    return ch


def test_last_partial_windows_of_every_rank_reach_timings_csv(tmp_path):
    store = DictStore()
    TIMER.drain()
    for rank in (1, 2):  # the other ranks exit first: each publishes what it timed since its last window
        TIMER.record(0.010 * rank, 0.001, 0.005, 0.002, 0.001)
        channel(rank, 3, store, None).flush_timing()
    TIMER.record(0.005, math.nan)
    channel(0, 3, store, str(tmp_path)).flush_timing()
    rows = (tmp_path / TIMINGS).read_text().splitlines()
    ranks = {line.split(",")[1]: line.split(",") for line in rows[1:]}
    assert set(ranks) == {"0", "1", "2"} and float(ranks["2"][4]) == 0.02 and ranks["0"][5] == ""


def test_rank_0_waits_a_bounded_time_for_a_rank_that_never_flushes(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr("ddprun.jobstore.FINAL_WAIT_S", 0.2)
    TIMER.drain()
    TIMER.record(0.01)
    t0 = time.monotonic()
    channel(0, 2, DictStore(), str(tmp_path)).flush_timing()
    assert time.monotonic() - t0 < 2 and (tmp_path / TIMINGS).read_text().count("\n") == 2
