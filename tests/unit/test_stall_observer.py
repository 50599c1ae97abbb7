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
    assert obs.update(1, 100.0, True) == ""
    assert obs.update(1, 104.9, True) == ""
    assert obs.update(1, 105.0, True) == "report"
    assert [obs.update(1, t, True) for t in (106.0, 114.9)] == ["", ""]  # reported once, not every check
    assert obs.update(1, 115.0, True) == "end"


def test_progress_after_a_report_re_arms_the_watch():
    obs = StallObserver(stall_s=5, end_s=60)
    obs.update(3, 0.0, True)
    assert obs.update(3, 5.0, True) == "report"
    assert obs.update(4, 6.0, True) == "resumed"  # the report was wrong: the job moved on, nothing ends
    assert obs.update(4, 10.9, True) == ""
    assert obs.update(4, 11.0, True) == "report"  # a new stall is reported again
    assert obs.update(4, 70.9, True) == ""  # its end counts from the new report, not the first
    assert obs.update(4, 71.0, True) == "end"


def test_before_the_first_progress_the_bound_is_longer_and_the_backup_observer_waits_its_grace():
    obs = StallObserver(stall_s=5, end_s=60)
    obs.update(0, 0.0, False)  # nothing advanced yet: imports, data preparation, compilation
    assert obs.update(0, 29.9, False) == ""
    assert obs.update(0, defaults.STALL_FIRST_STEP_MIN_S, False) == "report"
    backup = StallObserver(stall_s=5, end_s=60, grace_s=3)
    backup.update(2, 0.0, True)
    assert backup.update(2, 7.9, True) == ""  # rank 0 reports first; the last rank only when it does not
    assert backup.update(2, 8.0, True) == "report"


def test_a_setup_collective_before_the_first_step_keeps_the_longer_bound():
    """Before: any total > 0 armed the short bound, so fit's setup broadcast (counted) left every rank
    ``stall_s`` for its first batch; a DataLoader worker started by a forkserver on a busy machine took
    longer, and a healthy job was reported as stalled in data loading (its report in CI)."""
    obs = StallObserver(stall_s=5, end_s=60)
    obs.update(0, 0.0, False)
    obs.update(2, 1.0, False)  # the setup's broadcast returned on both ranks; no step yet
    assert obs.update(2, 1.0 + 29.9, False) == ""
    assert obs.update(2, 1.0 + defaults.STALL_FIRST_STEP_MIN_S, False) == "report"
    armed = StallObserver(stall_s=5, end_s=60)
    armed.update(7, 0.0, True)
    assert armed.update(7, 5.0, True) == "report"  # once the loop runs, the bound is stall_s


def test_the_loop_starting_is_progress_so_the_wait_for_the_first_batch_is_not_counted_against_the_short_bound():
    """Before: the observer's first step armed the short bound while the job's total, which the
    agents' beats carry, still showed the setup's: the 6 s every rank spent on its first batch (under
    the longer bound) counted as 6 s without progress, and a healthy job was reported as stalled at
    its first step (Lightning's first-batch test, 1 of 6 runs)."""
    obs = StallObserver(stall_s=2, end_s=60)
    obs.update(5, 0.0, False)
    assert obs.update(5, 6.0, False) == ""  # every rank on its first batch, under max(2 x, 30 s)
    assert obs.update(5, 6.1, True) == ""  # the observer's first step; no beat has carried it yet
    assert obs.update(5, 8.0, True) == ""
    assert obs.update(5, 8.1, True) == "report"  # then the short bound, from the loop's start
    obs.update(9, 20.0, True)
    assert obs.update(9, 40.0, False) == ""  # a Lightning fit after another loop: its setup starts over
    assert obs.update(9, 40.1, True) == ""  # its start is progress again
    assert obs.update(9, 42.1, True) == "report"
    late = StallObserver(stall_s=2, end_s=60)  # reported under the longer bound; then the loop starts
    late.update(5, 0.0, False)
    assert late.update(5, 30.0, False) == "report"
    assert late.update(5, 31.0, True) == "resumed"


def test_the_loop_begins_at_a_step_a_second_ddp_forward_a_heartbeat_or_a_collective_outside_ddprun_setup(
        monkeypatch):
    from ddprun import telemetry

    monkeypatch.setattr(telemetry, "PROGRESS", telemetry.Progress())
    p = telemetry.PROGRESS
    with telemetry.setup_phase():  # init's probe, fit's broadcast of the run directory, a resume's gather
        with telemetry.setup_phase():
            p.collected()
        p.collected()
    p.forwarded()  # the first forward: its backward's all-reduce may still wait for a rank's first batch
    assert not p.began and p.total == 3 and p.in_setup == 0
    p.forwarded()
    assert p.began and p.forwards == 2 and p.total == 4
    for begin in (lambda q: q.stepped(1.0), lambda q: q.collected(), lambda q: q.beat()):
        q = telemetry.Progress()  # a step; the script's own all_reduce; a heartbeat
        begin(q)
        assert q.began
    monkeypatch.setattr(telemetry, "PROGRESS", telemetry.Progress())
    telemetry.heartbeat()
    assert telemetry.PROGRESS.began


def test_inside_a_setup_phase_only_a_step_begins_the_loop_and_a_phase_ends_once(monkeypatch):
    """Lightning's setup (its barriers, broadcasts, the sanity check's DDP forwards and metric
    all-reduces, a callback's heartbeat) runs in a phase that spans hooks (ddprun.lightning.LoopStart):
    none of it is the loop's start; the loop's own second forward, after the phase, is."""
    from ddprun import telemetry

    monkeypatch.setattr(telemetry, "PROGRESS", telemetry.Progress())
    p = telemetry.PROGRESS
    phase = telemetry.SetupPhase()
    for _ in range(3):
        p.collected()
        p.forwarded()
        telemetry.heartbeat("validation")
    assert not p.began and p.total == 3 + 3 + 3 and p.in_setup == 1
    phase.end()
    phase.end()  # at teardown, after the first batch ended it: still one phase closed
    assert p.in_setup == 0
    p.forwarded()  # the loop's first forward
    assert not p.began
    p.forwarded()
    assert p.began
    q = telemetry.Progress()
    monkeypatch.setattr(telemetry, "PROGRESS", q)
    with telemetry.setup_phase():
        q.stepped(1.0)  # an optimizer step always begins it
    assert q.began and q.in_setup == 0
    q.restart()  # a Lightning fit after another loop, at its setup hook
    assert not q.began
    q.forwarded()
    assert not q.began
    q.forwarded()
    assert q.began
    dropped = telemetry.SetupPhase()  # a Trainer's, ended when it is collected: maybe under another PROGRESS
    monkeypatch.setattr(telemetry, "PROGRESS", telemetry.Progress())
    dropped.end()
    assert q.in_setup == 0 and telemetry.PROGRESS.in_setup == 0


def test_a_failing_poll_is_said_once_and_a_store_gone_for_long_is_tried_slower_while_signals_still_act(
        tmp_path, monkeypatch, capsys):
    """The monitor used to end after MAX_FAILED_POLLS; a preemption signal its signal thread handed it
    afterwards was dropped, and the rank trained on through it. It keeps trying the store, every
    RETRY_S, and a signal handed while the store is gone ends the rank at once."""
    import signal

    monkeypatch.setattr(defaults, "MONITOR_POLL_S", 0.02)
    monkeypatch.setattr(monitor_mod, "RETRY_S", 0.3, raising=False)
    (tmp_path / "logs").mkdir()
    calls, ready = [], []

    def unreachable():
        if not ready:  # the channel's own client, made at its start; the monitor's next ones fail
            ready.append(1)
            return object()
        calls.append(time.monotonic())
        raise ConnectionError("Connection refused\nsecond line")

    environ = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
               "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    mon = monitor_mod.Monitor(JobChannel(environ, WorkerEnv(run_dir=str(tmp_path)), connect=unreachable)).start()
    deadline = time.monotonic() + 10
    while len(calls) < monitor_mod.MAX_FAILED_POLLS + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    mon.stop()
    mon._thread.join(timeout=5)
    given_up = calls[monitor_mod.MAX_FAILED_POLLS - 1]
    assert len(calls) >= monitor_mod.MAX_FAILED_POLLS + 2, calls  # still trying after it said the store gone
    assert all(b - a >= 0.25 for a, b in zip(calls, calls[1:]) if a >= given_up), calls  # every RETRY_S
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "ddprun: rank 1's monitor: a poll of the job store failed (ConnectionError: Connection refused); "
        "still watching",
        f"ddprun: rank 1's monitor: the job store has not answered for "
        f"{monitor_mod.MAX_FAILED_POLLS * 0.02:.0f} s; it is tried every 0.3 s, and a preemption signal ends this "
        "rank at once",
    ]
    logged = (tmp_path / "logs" / "monitor-rank-1.log").read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in logged] == [e.removeprefix("ddprun: ") for e in err]
    died = []
    monkeypatch.setattr(monitor_mod.preempt, "die_by", died.append)
    mon._hand([signal.SIGTERM])  # the signal thread's hand-over, the store still gone
    assert died == [signal.SIGTERM]


def test_stall_timeout_0_turns_the_watch_off_and_only_the_first_and_last_ranks_observe():
    environ = {"LOCAL_RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
               "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}

    def observer(rank, stall_timeout):
        wenv = WorkerEnv(run_dir="/nonexistent", stall_timeout=stall_timeout)
        return monitor_mod.Monitor(JobChannel({**environ, "RANK": str(rank)}, wenv, connect=object)).observer

    assert [observer(r, 0) for r in range(4)] == [None] * 4
    assert [observer(r, 300) is not None for r in range(4)] == [True, False, False, True]


def _observer_of(rank: int, store, tmp_path) -> monitor_mod.Monitor:
    """Rank ``rank``'s monitor (never started; a stall observer, rank 0 or 1 of 2) on ``store``."""
    environ = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    wenv = WorkerEnv(run_dir=str(tmp_path), stall_timeout=1.0, stall_end=100.0)
    return monitor_mod.Monitor(JobChannel(environ, wenv, connect=lambda: store))


def test_the_observer_that_did_not_report_a_stall_that_resumed_goes_on_at_once(tmp_path, monkeypatch):
    """Both observers decided to report; rank 0 claimed it, the backup (rank 1) found it claimed. Progress
    resumed and rank 0 cleared the report first. The backup's monitor goes on at once: it used to read
    the cleared request with a get, which waits for a missing key the client's timeout (30 s in a
    worker; 5 s here), during which the rank watched for no failure, preemption or stall."""
    import json

    from tests.helpers import store_server

    store = store_server()
    backup = _observer_of(1, store, tmp_path)
    keys, total = backup.ch.keys, [5]
    monkeypatch.setattr(backup, "_progress", lambda store: {0: total[0]})
    t0 = time.monotonic()
    backup.observer.update(5, t0, False)
    store.set(keys.stall, json.dumps({"by": 0, "t": 1.0}))  # rank 0's claim
    backup._observe(store, t0 + 40)  # past the first-step bound and the backup's grace: it tries to report
    store.delete_key(keys.stall)  # rank 0 saw the progress first and cleared its report
    alarm = int(store.add(keys.alarm, 0))
    total[0] = 6
    began = time.monotonic()
    backup._observe(store, t0 + 41)
    assert time.monotonic() - began < 1.0
    assert int(store.add(keys.alarm, 0)) == alarm  # nothing of its own to clear


def test_an_answer_to_an_earlier_report_that_came_after_its_clean_up_is_not_one_to_this_report(tmp_path):
    """A rank answered the last stall's report late (its main thread held the GIL), after the claimant
    had cleared the answers: that place must not be read as its answer to this stall's report, where
    it may be somewhere else entirely. It is named as not answering instead."""
    import json

    from tests.helpers import store_server

    store = store_server()
    rank0 = _observer_of(0, store, tmp_path)
    keys = rank0.ch.keys
    stale = {"where": "in data loading (DataLoader)", "user_frame": "old_step.py:7 in wait_for_batch",
             "frames": ["old_step.py:7 in wait_for_batch"], "request": json.dumps({"by": 0, "t": 1.0}), "host": "b",
             "phase": "", "steps": 3, "loaders": [], "collectives": []}
    store.set(keys.place(1), json.dumps(stale))
    rank0._report(store, 40.0)
    assert "data loading" not in rank0._summary and "rank 1 did not answer" in rank0._summary, rank0._summary


def test_a_claimant_whose_clean_up_failed_reports_the_next_stall(tmp_path):
    """Progress resumed after rank 0's report, and its clean-up failed (a store call timed out): its
    request is still in the store at the next stall. It reports that one too; its old request used to
    block every later report of the job."""
    import json

    from tests.helpers import store_server

    store = store_server()
    rank0 = _observer_of(0, store, tmp_path)
    keys = rank0.ch.keys
    rank0._report(store, 40.0)
    first = store.get(keys.stall).decode()
    assert json.loads(first)["by"] == 0
    time.sleep(0.01)  # (a later request: another time in it)
    rank0._report(store, 80.0)  # the next stall; the first report's request was never cleared
    second = store.get(keys.stall).decode()
    assert second != first and json.loads(second)["by"] == 0
    assert "no rank advanced for 80 s" in rank0._summary, rank0._summary


def test_the_claimant_waits_for_the_answers_on_one_counter_not_every_rank_s_place(tmp_path):
    """At 8,192 ranks a check of every place key cost 20-110 ms, made every 20 ms for up to 5 s while
    the ranks wrote their answers to the same single-threaded store: healthy ranks were named as not
    answering. The claimant now reads one counter a poll, less often as it waits, and every place once."""
    import json

    from tests.helpers import Counting, store_server

    server, world = store_server(), 8

    def monitor(rank, store):
        environ = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
        wenv = WorkerEnv(run_dir=str(tmp_path), stall_timeout=1.0, stall_end=100.0)
        return monitor_mod.Monitor(JobChannel(environ, wenv, connect=lambda: store))

    claimant, others = Counting(server), [monitor(r, server) for r in range(1, world)]
    rank0 = monitor(0, claimant)

    def answer_late():  # the other ranks answer 0.6 s after the request, as their monitors poll
        deadline = time.monotonic() + 5
        while not server.check([rank0.ch.keys.stall]) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.6)
        for m in others:
            m._answer_stall(server)

    helper = threading.Thread(target=answer_late)
    helper.start()
    began = time.monotonic()
    rank0._report(claimant, 40.0)
    took = time.monotonic() - began
    helper.join()
    assert "did not answer" not in rank0._summary and json.loads(server.get(rank0.ch.keys.stall))["by"] == 0
    assert claimant.calls.count("check") <= 3, claimant.calls  # the places once (and the claim's own reads)
    assert len(claimant.calls) < 25 and took < 2.0, (took, claimant.calls)
