"""How often a straggler is named: once when it crosses, again only after repeat_after_s; never for tiny gaps."""

import pytest

from ddprun.worker.stragglers import StragglerDetector

HOSTS = {0: "a", 1: "a", 2: "b", 3: "b"}


def window(slow_data: float, data: float = 0.001) -> dict:
    """Four ranks with equal steps and compute; rank 3 waits ``slow_data`` for its batches, the others ``data``."""
    return {r: {"step": 0.05, "compute": 0.02, "data": slow_data if r == 3 else data} for r in range(4)}


def test_a_rank_that_stays_slow_is_named_once_then_again_only_after_repeat_after_s():
    det = StragglerDetector()  # the margin, windows and repeat StragglerWatch gets by default
    assert det.repeat_after_s == 300.0
    slow = window(0.040)
    for t in range(det.k - 1):
        assert det.update(slow, HOSTS, now=t) == []
    first = det.k - 1
    (event,) = det.update(slow, HOSTS, now=first)
    assert (event.rank, event.host, event.what, event.window) == (3, "b", "data", det.k)
    for t in (first + 1, first + 2, first + 100, first + det.repeat_after_s - 0.001):
        assert det.update(slow, HOSTS, now=t) == []  # still slow, already said
    (again,) = det.update(slow, HOSTS, now=first + det.repeat_after_s)
    assert (again.rank, again.what) == (3, "data") and again.window > det.k
    assert det.update(slow, HOSTS, now=first + det.repeat_after_s + 1) == []


def test_a_gap_under_min_abs_s_is_never_named_however_large_the_ratio():
    det = StragglerDetector(k=1)
    tiny, big = 0.8 * det.min_abs_s, 1.6 * det.min_abs_s  # both 40x the others' data wait
    for w in range(5):  # windows far enough apart that the repeat limit never holds a name back
        assert det.update(window(tiny, data=tiny / 40), HOSTS, now=w * 2 * det.repeat_after_s) == []
    (event,) = StragglerDetector(k=1).update(window(big, data=big / 40), HOSTS, now=0)
    assert (event.rank, event.what) == (3, "data") and event.value_s / event.median_s == pytest.approx(40)


def test_a_run_dir_that_refuses_writes_leaves_detection_on_and_is_said_once(tmp_path, capsys):
    # the OSError reached rank 0's monitor loop, which took it for a failed store poll, dropped its
    # connection and skipped the stall check; every poll failed with a short window
    from ddprun.worker.stragglers import StragglerWatch

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    watch = StragglerWatch(str(not_a_dir), 0.2, 1)
    for w in range(1, 4):
        watch.update({0: {"w": w, "step": 0.1}, 1: {"w": w, "step": 0.5}, 2: {"w": w, "step": 0.1}},
                     {0: "a", 1: "b", 2: "c"}, float(w))
    err = capsys.readouterr().err
    assert err.count("ddprun: could not write ") == 1 and "ddprun: straggler: " in err


def test_timings_csv_thins_out_long_runs_to_grow_with_the_log_of_their_length(tmp_path, monkeypatch):
    """One row a rank every 2 s is 1 GB an hour at 8,192 ranks, and the report loads the file whole:
    past each stride's row budget only every 2nd (then 4th, ...) window is written; detection reads all."""
    import csv

    from ddprun.worker.stragglers import StragglerWatch

    monkeypatch.setattr(StragglerWatch, "ROWS_PER_STRIDE", 8)  # 2 windows of 4 ranks a stride
    watch = StragglerWatch(str(tmp_path), 0.2, 3)
    events = []
    for w in range(1, 21):
        slow = 0.5 if w > 14 else 0.1  # rank 3 turns slow late in the run
        events += watch.update({r: {"w": w, "step": slow if r == 3 else 0.1} for r in range(4)},
                               {r: f"h{r}" for r in range(4)}, float(w))
    with open(tmp_path / "timings.csv") as fp:
        rows = list(csv.DictReader(fp))
    windows = sorted({int(r["window"]) for r in rows})
    assert windows == [1, 2, 3, 5, 9, 13, 17]  # 8 rows (2 windows) at each stride: 1, 2, 4, 8
    assert all(sum(int(r["window"]) == w for r in rows) == 4 for w in windows)  # every rank of a kept window
    assert len(events) == 1 and "rank 3" in events[0]  # windows 15-17 in a row: named from every window
