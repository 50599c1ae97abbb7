"""Straggler detection: named once after K slow windows, never on a healthy spread."""

from ddprun.telemetry import StepTimer, summarize
from ddprun.worker.stragglers import StragglerDetector

HOSTS = {0: "a", 1: "a", 2: "b", 3: "b"}


def window(data=(0.001, 0.001, 0.001, 0.001), compute=(0.01, 0.01, 0.01, 0.01)):
    return {r: {"step": 0.02, "data": data[r], "compute": compute[r]} for r in range(4)}


def test_slow_data_is_named_once_after_k_windows_with_host_and_numbers():
    det = StragglerDetector(margin=0.2, k=3)
    slow = window(data=(0.001, 0.001, 0.001, 0.040))
    assert det.update(slow, HOSTS, now=0) == []
    assert det.update(slow, HOSTS, now=1) == []
    (event,) = det.update(slow, HOSTS, now=2)
    assert (event.rank, event.host, event.what) == (3, "b", "data")
    assert event.message() == ("rank 3 (b) is 40x slower: data wait 40.0 ms vs 1.0 ms median of the other ranks")
    assert det.update(slow, HOSTS, now=3) == []  # rate-limited


def test_a_streak_broken_by_a_normal_window_starts_again():
    det = StragglerDetector(k=3)
    slow, ok = window(compute=(0.01, 0.03, 0.01, 0.01)), window()
    for w in (slow, slow, ok, slow, slow):
        assert det.update(w, HOSTS, now=0) == []
    (event,) = det.update(slow, HOSTS, now=0)
    assert event.rank == 1 and event.what == "compute"
    assert "is 3x slower: compute (forward+backward) 30.0 ms vs 10.0 ms" in event.message()
    det = StragglerDetector(k=1)
    (event,) = det.update(window(compute=(0.01, 0.016, 0.01, 0.01)), HOSTS, now=0)
    assert "is 60% slower" in event.message()


def test_small_absolute_differences_are_noise():
    det = StragglerDetector(margin=0.2, k=1, min_abs_s=0.005)
    # 60% slower, but only 0.6 ms: scheduling noise on a tiny step
    assert det.update(window(compute=(0.001, 0.001, 0.001, 0.0016)), HOSTS, now=0) == []


def test_step_timer_summary_and_hook_intervals(monkeypatch):
    from types import SimpleNamespace

    from ddprun import telemetry

    t = StepTimer()
    t.record(0.02, data=0.001, compute=0.015)
    t.record(0.03, data=0.003, compute=0.02)
    s = summarize(t.drain())
    assert s == {"n": 2.0, "step": 0.025, "data": 0.002, "compute": 0.0175}
    assert summarize(t.drain()) is None
    clock = iter([1.0, 1.25, 1.75, 2.0])
    monkeypatch.setattr(telemetry, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    t.on_optimizer_step()  # the first step only starts the clock
    t.on_optimizer_step()
    t.on_optimizer_step()
    assert [rec[0] for rec in t.drain()] == [0.25, 0.5]  # the intervals between the hook's calls
    t.detailed = True  # fit times its own steps: the hook records nothing
    t.on_optimizer_step()
    assert t.drain() == []


def test_step_records_nobody_drains_stay_bounded_and_a_drain_gets_the_newest():
    """ddprun.fit under torchrun, srun or plain python records every step and no monitor drains
    them: a million-step run held every record (about 200 bytes a step) before."""
    from ddprun.telemetry import MAX_RECORDS

    t = StepTimer()
    for i in range(MAX_RECORDS + 500):
        t.record(float(i))
    got = t.drain()
    assert len(got) == MAX_RECORDS and got[0][0] == 500.0 and got[-1][0] == MAX_RECORDS + 499.0
    t.record(1.0)
    assert [r[0] for r in t.drain()] == [1.0]  # the next window starts empty


def test_the_median_of_the_others_is_statistics_median_without_that_rank_and_cheap_at_scale():
    import random
    import statistics
    import time

    from ddprun.worker.stragglers import median_without

    rng = random.Random(5)
    for n in (2, 3, 4, 5, 8, 9, 33):
        values = [rng.choice([0.01, 0.02, 0.03]) if n > 8 else rng.random() for _ in range(n)]  # ties too
        ordered = sorted(values)
        for i, v in enumerate(values):
            assert median_without(ordered, v) == statistics.median(values[:i] + values[i + 1:])
    summaries = {r: {"step": 0.1 + (0.05 if r == 77 else 0.0), "data": 0.01} for r in range(8192)}
    det = StragglerDetector(k=1)
    t0 = time.process_time()
    events = det.update(summaries, {}, now=0.0)
    assert [e.rank for e in events] == [77]
    # a bound on the complexity, far from any timing: the quadratic way took 9.6 s a window at 4,096 ranks
    assert time.process_time() - t0 < 1.0
