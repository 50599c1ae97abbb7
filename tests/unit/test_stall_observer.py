"""The stall watch's decisions over time (report once, end later, re-arm on progress) and a failing
monitor poll: said once on the console and in logs/monitor-rank-N.log, then bounded."""

import threading
import time

from ddprun.protocol import defaults
from ddprun.protocol.env import WorkerEnv
from ddprun.worker import monitor as monitor_mod
from ddprun.worker.channel import JobChannel
from ddprun.worker.monitor import StallObserver


def test_a_stall_is_reported_once_at_the_threshold_and_ends_the_job_stall_end_later():
    obs = StallObserver(stall_s=5, end_s=10)
    assert obs.update(1, 100.0) == ""
    assert obs.update(1, 104.9) == ""
    assert obs.update(1, 105.0) == "report"
    assert [obs.update(1, t) for t in (106.0, 114.9)] == ["", ""]  # reported once, not every check
    assert obs.update(1, 115.0) == "end"


def test_progress_after_a_report_re_arms_the_watch():
    obs = StallObserver(stall_s=5, end_s=60)
    obs.update(3, 0.0)
    assert obs.update(3, 5.0) == "report"
    assert obs.update(4, 6.0) == "resumed"  # the report was wrong: the job moved on, nothing ends
    assert obs.update(4, 10.9) == ""
    assert obs.update(4, 11.0) == "report"  # a new stall is reported again
    assert obs.update(4, 70.9) == ""  # its end counts from the new report, not the first
    assert obs.update(4, 71.0) == "end"


def test_before_the_first_progress_the_bound_is_longer_and_the_backup_observer_waits_its_grace():
    obs = StallObserver(stall_s=5, end_s=60)
    obs.update(0, 0.0)  # nothing advanced yet: imports, data preparation, compilation
    assert obs.update(0, 29.9) == ""
    assert obs.update(0, defaults.STALL_FIRST_STEP_MIN_S) == "report"
    backup = StallObserver(stall_s=5, end_s=60, grace_s=3)
    backup.update(2, 0.0)
    assert backup.update(2, 7.9) == ""  # rank 0 reports first; the last rank only when it does not
    assert backup.update(2, 8.0) == "report"


def test_a_failing_poll_is_said_once_then_the_watch_goes_on_until_a_bounded_give_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(defaults, "MONITOR_POLL_S", 0.02)
    (tmp_path / "logs").mkdir()
    calls, ready = [], []
    five = threading.Event()

    def unreachable():
        if not ready:  # the channel's own client, made at its start; the monitor's next ones fail
            ready.append(1)
            return object()
        calls.append(time.monotonic())
        if len(calls) == 5:
            five.set()
        raise ConnectionError("Connection refused\nsecond line")

    environ = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
               "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    mon = monitor_mod.Monitor(JobChannel(environ, WorkerEnv(run_dir=str(tmp_path)), connect=unreachable)).start()
    assert five.wait(5)
    assert mon._thread.is_alive()  # still watching after five failed polls
    mon._thread.join(timeout=5)
    assert not mon._thread.is_alive() and len(calls) == monitor_mod.MAX_FAILED_POLLS
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "ddprun: rank 1's monitor: a poll of the job store failed (ConnectionError: Connection refused); "
        "still watching",
        f"ddprun: rank 1's monitor: the job store has not answered for "
        f"{monitor_mod.MAX_FAILED_POLLS * 0.02:.0f} s; this rank's watchdog stops",
    ]
    logged = (tmp_path / "logs" / "monitor-rank-1.log").read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in logged] == [e.removeprefix("ddprun: ") for e in err]


def test_stall_timeout_0_turns_the_watch_off_and_only_the_first_and_last_ranks_observe():
    environ = {"LOCAL_RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
               "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}

    def observer(rank, stall_timeout):
        wenv = WorkerEnv(run_dir="/nonexistent", stall_timeout=stall_timeout)
        return monitor_mod.Monitor(JobChannel({**environ, "RANK": str(rank)}, wenv, connect=object)).observer

    assert [observer(r, 0) for r in range(4)] == [None] * 4
    assert [observer(r, 300) is not None for r in range(4)] == [True, False, False, True]
