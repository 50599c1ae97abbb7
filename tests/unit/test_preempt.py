"""Preemption's pure parts (protocol/preempt.py: signals, stop-step proposals, records, grace) and
the worker's signal plumbing (ddprun.preempt: chaining the script's handlers, the wakeup fd, the
stop at the agreed optimizer step)."""

import os
import select
import signal
import threading
import time

import pytest
import torch

from ddprun import preempt
from ddprun.errors import ConfigError
from ddprun.preempt import Preempted
from ddprun.protocol import preempt as pp
from tests.helpers import fork


def test_signals_parse_by_name_prefix_or_number_and_none_turns_them_off():
    assert pp.parse_signals("TERM,sigusr1, 10,HUP") == (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
    assert pp.parse_signals("none") == () and pp.parse_signals("") == ()
    assert pp.signal_names((signal.SIGTERM, signal.SIGINT)) == "TERM,INT" and pp.signal_names(()) == "none"


@pytest.mark.parametrize("raw", ["TERM,NOPE", "KILL", "STOP,TERM", "999"])
def test_a_bad_signal_list_is_one_message_naming_the_value(raw):
    with pytest.raises(ConfigError) as e:
        pp.parse_signals(raw)
    assert raw in str(e.value) and "HINT" in str(e.value)


@pytest.mark.parametrize("raw, name", [("CHLD", "SIGCHLD"), ("TERM,WINCH", "SIGWINCH"), ("pipe", "SIGPIPE"),
                                       ("CONT", "SIGCONT"), ("URG", "SIGURG"), (str(int(signal.SIGCHLD)), "SIGCHLD"),
                                       ("SEGV", "SIGSEGV")])
def test_a_signal_that_does_not_mean_stop_is_refused_as_a_preemption_signal(raw, name):
    """SIGCHLD reaches the agent at every worker's exit: as a preemption signal it stopped healthy jobs."""
    with pytest.raises(ConfigError) as e:
        pp.parse_signals(raw)
    assert e.value.what.startswith(f"{name} cannot be a preemption signal") and repr(raw) in e.value.seen
    assert "TERM,INT,HUP,QUIT,USR1,USR2" in e.value.hint
    assert pp.parse_signals("QUIT,XCPU") == (signal.SIGQUIT, signal.SIGXCPU)  # these do mean stop


def test_a_proposal_lies_three_seconds_of_steps_and_at_least_two_steps_ahead():
    assert pp.propose(10, None) == 12  # no rate yet: the step in flight and one more
    assert pp.propose(10, 0.1) == 12  # slow steps: still two
    assert pp.propose(100, 50.0) == 100 + 151  # 50 steps/s: 3 s of them, and one
    assert pp.propose(5, float("nan")) == 7


def test_records_round_trip_and_bad_values_are_no_record():
    req = pp.Request("SIGTERM", "rank 3", 1, "host-b", 12.5)
    assert pp.Request.parse(req.to_json()) == req and req.where() == "rank 3 (node 1, host-b)"
    saved = pp.Saved(40, 140, "/ck/step-00000140.pt", 2.1, "fit")
    assert pp.Saved.parse(saved.to_json().encode()) == saved
    import pickle

    class Boom:  # never unpickled: a store value is JSON or nothing (SECURITY.md)
        def __reduce__(self):
            return (open, ("/nonexistent/ddprun-pickle-ran", "w"))

    for bad in (None, b"", b"{", b'{"step": "x"}', b"[1, 2]", b'"text"', pickle.dumps(Boom())):
        assert pp.Request.parse(bad) is None and pp.Saved.parse(bad) is None
    from ddprun.worker.monitor import parse_int  # how a rank reads the agreed stop step

    assert parse_int(pickle.dumps(Boom())) is None and parse_int(b"12") == 12


@pytest.mark.parametrize(("environ", "seconds", "source"), [
    ({}, 30.0, "default"),
    ({"SLURM_JOB_ID": "7"}, 30.0, "SLURM"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, 30.0, "Kubernetes"),
    ({"SM_HOSTS": '["algo-1"]'}, 120.0, "SageMaker"),
    ({"SLURM_JOB_ID": "7", "DDPRUN_PREEMPT_GRACE": "90"}, 90.0, "DDPRUN_PREEMPT_GRACE"),
])
def test_the_grace_comes_from_the_environment(environ, seconds, source):
    got, why = pp.grace(environ, None)
    assert got == seconds and why.startswith(source)


def test_the_grace_flag_wins_and_a_bad_variable_is_named():
    assert pp.grace({"DDPRUN_PREEMPT_GRACE": "90"}, 45.0) == (45.0, "--preempt-grace")
    for bad in ("0", "-3", "inf", "soon"):
        with pytest.raises(ConfigError, match="DDPRUN_PREEMPT_GRACE"):
            pp.grace({"DDPRUN_PREEMPT_GRACE": bad}, None)


@pytest.fixture
def installed(monkeypatch):
    """ddprun.preempt's handlers for SIGUSR1/SIGUSR2 in this process, everything put back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    wakeup = signal.set_wakeup_fd(-1)
    monkeypatch.setattr(preempt, "PREEMPT", preempt.PreemptState())
    fd = preempt.install((signal.SIGUSR1, signal.SIGUSR2))
    yield fd, preempt.PREEMPT
    signal.signal = preempt._signal_signal
    signal.set_wakeup_fd(wakeup)
    for s, h in saved.items():
        signal.signal(s, h)
    os.close(fd)


def test_a_signal_reaches_the_wakeup_fd_and_the_scripts_own_handler_still_runs(installed):
    fd, state = installed
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))  # the script sets its own: chained
    assert before == signal.SIG_DFL
    os.kill(os.getpid(), signal.SIGUSR1)
    assert select.select([fd], [], [], 2)[0] == [fd]
    assert list(os.read(fd, 64)) == [signal.SIGUSR1]
    assert seen == [signal.SIGUSR1] and signal.getsignal(signal.SIGUSR1) is preempt._handler
    assert state.signum is None  # the handler only chains: the monitor decides what the signal means


def test_before_a_rank_ends_by_a_signal_the_scripts_own_handler_runs_within_a_bound(installed):
    """The monitor thread decides at once that nothing stops at a step; the main thread runs the
    script's handler only at its next bytecode: the rank waits for the handler to return (seen: under
    CPU load Lightning's "Received SIGTERM" was never written), but not for one that never does."""
    import threading
    import time

    _, state = installed
    t0 = time.monotonic()
    preempt.let_own_handler_run(signal.SIGUSR2, 5)  # no handler of the script's: nothing to wait for
    assert time.monotonic() - t0 < 0.5
    ran = []
    signal.signal(signal.SIGUSR1, lambda s, f: (time.sleep(0.3), ran.append(s)))
    waited: list[float] = []

    def monitor() -> None:  # what the monitor thread does once the job agreed on no stop step
        t = time.monotonic()
        preempt.let_own_handler_run(signal.SIGUSR1, 5)
        waited.append(time.monotonic() - t)

    watcher = threading.Thread(target=monitor)
    watcher.start()
    os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs in this (main) thread, taking 0.3 s
    watcher.join(10)
    assert ran == [signal.SIGUSR1] and 0.25 <= waited[0] < 4  # it waited for the handler, no longer
    state.handled.clear()
    t0 = time.monotonic()
    preempt.let_own_handler_run(signal.SIGUSR1, 0.3)  # a handler that has not run (its thread in C): bounded
    assert 0.3 <= time.monotonic() - t0 < 2


def test_a_script_that_ignores_a_signal_has_it_ignored(installed):
    _, state = installed
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN and signal.SIGUSR2 not in state.signals
    os.kill(os.getpid(), signal.SIGUSR2)  # ignored: this test goes on


@pytest.mark.parametrize("saved_by", ["signal", "getsignal"])
def test_ignoring_a_signal_for_a_while_then_restoring_it_keeps_preemption(installed, saved_by):
    fd, state = installed
    seen = []
    signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))  # the script's own, chained
    old = signal.getsignal(signal.SIGUSR2) if saved_by == "getsignal" else None
    ignored_from = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    os.kill(os.getpid(), signal.SIGUSR2)  # ignored meanwhile: nothing reaches the monitor
    assert select.select([fd], [], [], 0.2)[0] == [] and seen == []
    assert signal.signal(signal.SIGUSR2, old or ignored_from) == signal.SIG_IGN  # the script's restore
    assert signal.SIGUSR2 in state.signals and signal.getsignal(signal.SIGUSR2) is preempt._handler
    os.kill(os.getpid(), signal.SIGUSR2)
    assert select.select([fd], [], [], 2)[0] == [fd] and list(os.read(fd, 64)) == [signal.SIGUSR2]
    assert seen == [signal.SIGUSR2]


def test_outside_fit_the_callbacks_run_at_the_stop_step_and_the_script_ends_there(monkeypatch):
    from ddprun.telemetry import PROGRESS
    from ddprun.worker import progress

    state = preempt.PreemptState(stop_step=PROGRESS.steps + 2, signame="SIGTERM")
    monkeypatch.setattr(preempt, "PREEMPT", state)
    monkeypatch.setattr(progress, "PREEMPT", state)
    progress.install()
    calls = []
    preempt.on_preempt(calls.append)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done = 0
    with pytest.raises(Preempted) as e:
        for _ in range(5):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            done += 1
    assert done == 1 and calls == [state.stop_step] and e.value.code == 0 and e.value.step == state.stop_step
    assert state.saved is not None and state.saved[4] == "on_preempt"


def test_inside_fit_the_optimizer_hook_leaves_the_stop_to_fit(monkeypatch):
    state = preempt.PreemptState(stop_step=1, fit_active=True)
    monkeypatch.setattr(preempt, "PREEMPT", state)
    preempt.at_optimizer_step(3)  # no Preempted: fit checkpoints and stops by itself
    assert state.saved is None


@pytest.fixture
def sigterm_kept():
    """requeue() leaves SIGTERM ignored once the job is requeued (the agent's end): put it back."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_requeue_runs_scontrol_once_and_says_what_happened_either_way(tmp_path, sigterm_kept):
    import io
    import subprocess

    from ddprun.agent.preemption import requeue

    log = tmp_path / "calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$2" = 7 ] || {{ echo "Invalid job id $2" >&2; exit 1; }}\n')
    scontrol.chmod(0o755)
    out = io.StringIO()
    assert requeue([str(scontrol), "requeue", "7"], out)
    assert log.read_text() == "requeue 7\n"
    assert out.getvalue() == ("ddprun: requeued SLURM job 7 (scontrol requeue 7): when SLURM starts it again, "
                              "the same command resumes from this checkpoint\n")
    out = io.StringIO()
    assert not requeue([str(scontrol), "requeue", "8"], out)
    assert out.getvalue() == ("ddprun: could not requeue SLURM job 8: Invalid job id 8\nHINT: requeue it yourself "
                              "(scontrol requeue 8) or submit the same script again: it resumes from this "
                              "checkpoint.\n")

    def hangs(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    out = io.StringIO()
    assert not requeue(["scontrol", "requeue", "9"], out, run=hangs)
    assert "could not requeue SLURM job 9: scontrol did not answer within 30 s\nHINT: " in out.getvalue()


def test_requeue_says_its_line_and_the_agent_ends_its_own_way_though_slurms_sigterm_comes_meanwhile():
    """SLURM's requeue SIGTERMs the job's steps at once, the requeueing agent among them, before or
    after scontrol returns: the agent's line, and what it does after (its run report, its exit code),
    must still happen. A requeue that failed puts the handler back. In a child process: without the
    fix, the SIGTERM ends it."""
    import subprocess
    import sys

    code = (
        "import os, signal, subprocess, sys\n"
        "from ddprun.agent.preemption import requeue\n"
        "def scontrol(rc):\n"
        "    def run(cmd, **kw):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        return subprocess.CompletedProcess(cmd, rc, '', 'Invalid job id' if rc else '')\n"
        "    return run\n"
        "assert not requeue(['scontrol', 'requeue', '8'], sys.stdout, run=scontrol(1))\n"
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, 'the handler was not put back'\n"
        "assert requeue(['scontrol', 'requeue', '7'], sys.stdout, run=scontrol(0))\n"
        "os.kill(os.getpid(), signal.SIGTERM)  # SLURM's, after scontrol returned\n"
        "print('the report, then exit 75')\n"
        "sys.exit(75)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (75, ""), done
    assert done.stdout == ("ddprun: could not requeue SLURM job 8: Invalid job id\nHINT: requeue it yourself "
                           "(scontrol requeue 8) or submit the same script again: it resumes from this checkpoint.\n"
                           "ddprun: requeued SLURM job 7 (scontrol requeue 7): when SLURM starts it again, the "
                           "same command resumes from this checkpoint\nthe report, then exit 75\n")


class _Failures:
    """The part of AgentFailures that Preemption reads: the job's request, stop step and rank 0's Saved."""

    def __init__(self, node_rank, request=None, stop=None, saved=None, stored=None, asked=None):
        self.node_rank, self.preempt_request, self.preempt_stop, self.saved = node_rank, request, stop, saved
        self.stored = stored if stop is None else stop  # the stop step in the store, not read by a beat yet
        self.asked = asked or request  # the request in the store, not read by a beat yet

    def read_preempt_saved(self, wait_s=0.0):
        return self.saved

    def read_preempt_request(self):
        self.preempt_request = self.preempt_request or self.asked
        return self.preempt_request

    def read_preempt_stop(self):
        self.preempt_stop = self.preempt_stop or self.stored
        return self.preempt_stop


def _agent_preemption(failures, grace_s=3.0):
    import io

    from ddprun.agent.preemption import Preemption

    return Preemption((signal.SIGTERM,), grace_s, "--preempt-grace", failures, io.StringIO(), "h")


@pytest.mark.parametrize(("age", "over"), [(3.5, True), (2.0, False), (-30.0, False), (3600.0, False)])
def test_a_request_read_late_ends_the_grace_when_the_requesters_does_unless_the_clocks_disagree(age, over):
    import time

    req = pp.Request("SIGTERM", "rank 1", 1, "b", time.time() - age)
    pre = _agent_preemption(_Failures(0, req, stop=35))
    assert pre.check() == (signal.SIGTERM if over else None)
    assert pre.grace_over() is over


def test_a_peer_stopped_by_its_grace_is_this_nodes_forced_stop_and_any_other_failure_is_not():
    import time

    from ddprun.protocol import failure as fr

    peer = fr.FailureRecord(fr.SIGNAL, -1, "its preemption grace ended", 1, "b", signal="SIGTERM", by="agent")
    crashed = fr.FailureRecord(fr.ERROR, 3, "ValueError: x", 1, "b")
    idle = _agent_preemption(_Failures(0))
    assert not idle.forced_by_peer(peer)  # no preemption: a peer's signal is the job's failure
    pre = _agent_preemption(_Failures(0, pp.Request("SIGTERM", "rank 1", 1, "b", time.time()), stop=35))
    pre.check()
    assert pre.forced_by_peer(peer) and not pre.forced_by_peer(crashed) and not pre.forced_by_peer(None)
    assert not _agent_preemption(_Failures(1, pre.request, stop=35)).forced_by_peer(peer)  # its own record
    assert pre.forced_line(peer) == (
        "ddprun: the preemption stop did not complete on every node: node 1 (b) was stopped by SIGTERM: its preemption "
        "grace ended; this node's workers were stopped before the stop completed; the last checkpoint is the one "
        "before.")
    assert pre.forced_why() is None
    pre._since -= 3.0
    assert pre.forced_line(peer).startswith("ddprun: the preemption grace of 3 s (--preempt-grace) ended before")
    assert pre.forced_why() == ("its preemption grace of 3 s (--preempt-grace) ended before its ranks stopped at "
                                "the agreed step, and it stopped its workers")


@pytest.mark.parametrize(("stored", "forced"), [(pp.NO_STEP, False), (None, False), ("35", True)])
def test_a_peer_signalled_before_this_node_read_the_answer_is_forced_only_if_the_job_agreed_on_a_step(stored, forced):
    """The peer's ranks answered NO_STEP (a script with nothing to save), so its agent stopped them at
    once, and this node's ranks failed of it before its beat read that answer: a failure of the job (exit
    1 naming that node), not a preemption's forced stop (128 + SIGTERM). The answer is read then; a step
    agreed but not read yet is still a forced stop; no answer at all (or no store) is a failure."""
    import time

    from ddprun.protocol import failure as fr

    peer = fr.FailureRecord(fr.SIGNAL, -1, "its agent got SIGTERM and stopped its workers", 1, "b",
                            signal="SIGTERM", by="agent")
    failures = _Failures(0, pp.Request("SIGTERM", "agent", 1, "b", time.time()), stored=stored)
    pre = _agent_preemption(failures)
    pre.check()
    assert pre.preempting()  # asked, and no NO_STEP read yet
    assert pre.forced_by_peer(peer) is forced
    assert failures.preempt_stop == stored


@pytest.mark.parametrize(("own", "stored", "forbidden"), [
    (False, pp.NO_STEP, False),  # a peer's signal, nothing to save: it stops at once; this node may restart
    (False, "35", True),  # the job stops at step 35
    (False, None, True),  # asked, not answered yet: the job may stop at a step
    (True, pp.NO_STEP, True),  # this node got the signal: it goes away, whatever the job answered
])
def test_a_failed_group_restarts_only_where_no_preemption_holds_it(own, stored, forbidden):
    import time

    failures = _Failures(0, pp.Request("SIGTERM", "agent", 0 if own else 1, "b", time.time()), stored=stored)
    pre = _agent_preemption(failures)
    if own:
        pre.on_signal(signal.SIGTERM)
    assert pre.restart_forbidden() is forbidden
    assert failures.preempt_stop == stored  # read when asked


def test_a_request_answered_no_step_runs_no_grace_and_a_new_request_starts_its_own():
    """A peer's request its ranks answered NO_STEP: this node's grace, started when the beat read the
    request, stops (it would otherwise stop this node's workers at its end); a later request (a new
    attempt's) counts its grace from its own time."""
    import time

    req = pp.Request("SIGTERM", "agent", 1, "b", time.time())
    failures = _Failures(0, req)
    pre = _agent_preemption(failures)
    assert pre.check() is None and pre._since is not None  # asked, not answered yet: the grace runs
    failures.preempt_stop = pp.NO_STEP
    pre._since -= 10.0  # well past the 3 s grace
    assert pre.check() is None and not pre.grace_over() and pre._since is None
    failures.preempt_request, failures.preempt_stop = None, None  # a new attempt
    assert pre.check() is None and pre._since is None
    failures.preempt_request, failures.preempt_stop = pp.Request("SIGTERM", "agent", 1, "b", time.time()), "7"
    assert pre.check() is None and pre.preempting() and not pre.grace_over()


@pytest.mark.parametrize("saved, said", [
    (None, "; the last checkpoint is the one before."),
    (pp.Saved(-1, -1, "", 0.0), "; the last checkpoint is the one before."),
    (pp.Saved(35, 135, "", 0.2, "on_preempt"), "; the last checkpoint is the one before."),
    (pp.Saved(35, 135, "/ck/step-135.pt", 0.4),
     "; rank 0 had saved the stop step's checkpoint first (step 135, /ck/step-135.pt): the same command resumes "
     "from there."),
], ids=["nothing-said", "ended-by-itself", "on-preempt-callbacks", "checkpoint-written"])
def test_a_forced_stop_names_the_stop_steps_checkpoint_when_rank_0_had_written_it(saved, said):
    """An on_checkpoint hook that outlasts the grace: the checkpoint it follows is on disk, and the
    next start resumes from it (rank 0 publishes it before the hooks: PREEMPT.checkpoint_written)."""
    import time

    from ddprun.protocol import failure as fr

    pre = _agent_preemption(_Failures(0, pp.Request("SIGTERM", "rank 1", 1, "b", time.time()), stop=35, saved=saved))
    pre.check()
    peer = fr.FailureRecord(fr.SIGNAL, -1, "its preemption grace ended", 1, "b", signal="SIGTERM", by="agent")
    assert pre.forced_line(peer).endswith(f"were stopped before the stop completed{said}")
    pre._since -= 3.0
    assert f"workers stopped{said} HINT: a longer --preempt-grace" in pre.forced_line()


def test_the_stop_steps_checkpoint_is_published_before_the_hooks_that_follow_it(monkeypatch):
    from ddprun.preempt import PREEMPT

    said = []
    monkeypatch.setattr(PREEMPT, "publish", said.append)
    monkeypatch.setattr(PREEMPT, "saved", None)
    PREEMPT.checkpoint_written((35, 135, "/ck/step-135.pt", 0.4, "fit"))
    assert said == [(35, 135, "/ck/step-135.pt", 0.4, "fit")] and PREEMPT.saved == said[0]


@pytest.mark.parametrize("case", ["written-meanwhile", "written-unsaid", "said-already", "not-saving", "never-ends"])
def test_an_agents_stop_during_the_stop_steps_checkpoint_waits_for_it_and_says_it_once(monkeypatch, case):
    """Before: a stop between the file's rename and its publish left the agents saying "the last
    checkpoint is the one before" while the next start resumed from the stop step's (SLURM test bed)."""
    import threading
    import time

    from ddprun.preempt import PREEMPT

    said, saved = [], (35, 135, "/ck/step-135.pt", 0.4, "fit")
    monkeypatch.setattr(PREEMPT, "publish", said.append)
    monkeypatch.setattr(PREEMPT, "saved", saved if case in ("written-unsaid", "said-already") else None)
    monkeypatch.setattr(PREEMPT, "published", case == "said-already")
    monkeypatch.setattr(PREEMPT, "saving", case in ("written-meanwhile", "never-ends"))
    if case == "written-meanwhile":
        threading.Timer(0.3, lambda: setattr(PREEMPT, "saved", saved)).start()  # the save's rename, then this
    t0 = time.monotonic()
    PREEMPT.say_saved_before_stop(1.0)
    took = time.monotonic() - t0
    assert said == ([saved] if case in ("written-meanwhile", "written-unsaid") else []), case
    assert (0.25 < took < 0.9) if case == "written-meanwhile" else (0.95 < took < 2) if case == "never-ends" \
        else took < 0.1, (case, took)


def test_each_way_a_preempted_job_ends_gets_its_line_and_exit_code():
    """docs/preemption.md's table, the agent's side: stopped at the step with fit's checkpoint or the
    on_preempt callbacks (75), or the script finished before the stop step (0, nothing to resume)."""
    import time

    pre = _agent_preemption(_Failures(0, pp.Request("SIGTERM", "rank 1", 1, "b", time.time()), stop=35))
    pre.saved = pp.Saved(14, 14, "/runs/x/checkpoints/step-00000014.pt", 0.04)
    code, line = pre.finished_line()
    assert code == pp.EXIT_CODE == 75 and line.startswith("ddprun: preempted by SIGTERM to rank 1 of node 1 (b): "
                                                          "every rank stopped after optimizer step 14 of this launch")
    assert line.endswith("checkpoint at step 14 saved in 0.0 s (/runs/x/checkpoints/step-00000014.pt); resume with "
                         "the same command")
    pre.saved = pp.Saved(14, 14, "", 0.0, by="on_preempt")
    assert pre.finished_line() == (75, "ddprun: preempted by SIGTERM to rank 1 of node 1 (b): every rank stopped "
                                       "after optimizer step 14 of this launch; the script's on_preempt callbacks "
                                       "ran there (0.0 s)")
    pre.saved = pp.Saved(-1, -1, "", 0.0)
    assert pre.finished_line() == (0, "ddprun: SIGTERM came as the run was ending: it finished; nothing to resume")


def test_a_request_no_beat_read_before_the_workers_ended_still_gives_the_jobs_end():
    """The workers (rank 0 on another node) finished their last steps past the agreed stop step before
    this agent's beat read the request: before the exit barrier it reads the request, the answer and
    rank 0's Saved itself, and says what its peers say (exit 0), not 'rank 0 did not say' (75)."""
    import time

    req = pp.Request("SIGTERM", "rank 1", 1, "b", time.time())
    pre = _agent_preemption(_Failures(1, stop=None, stored="92", saved=pp.Saved(-1, -1, "", 0.0), asked=req))
    assert not pre.preempting()  # what the beats had read when the workers ended
    pre.before_exit()
    assert pre.ended_preempted() and pre.saved == pp.Saved(-1, -1, "", 0.0)
    assert pre.finished_line() == (0, "ddprun: SIGTERM came as the run was ending: it finished; nothing to resume")


def test_a_request_made_after_every_local_worker_ended_is_no_preemption_of_this_node():
    """Asked while the agents wait at the exit barrier (or this agent's own signal then): this node's
    workers had finished, so the launch ended without a preemption here: no 75, no requeue."""
    import time

    failures = _Failures(0, stop=None, stored="92")
    pre = _agent_preemption(failures)
    pre.before_exit()
    failures.preempt_request = pp.Request("SIGTERM", "rank 1", 1, "b", time.time())  # a beat reads it later
    pre.on_signal(signal.SIGTERM)
    assert pre.preempting() and not pre.ended_preempted()


@pytest.fixture
def rank_1(tmp_path, monkeypatch):
    """Rank 1's monitor (never started) on a real store, with its own preemption state."""
    from ddprun.protocol.env import WorkerEnv
    from ddprun.worker import monitor as monitor_mod
    from ddprun.worker.channel import JobChannel
    from tests.helpers import store_server

    store = store_server()
    state = preempt.PreemptState(signals=(signal.SIGUSR1, signal.SIGTERM))
    monkeypatch.setattr(monitor_mod, "PREEMPT", state)
    environ = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    mon = monitor_mod.Monitor(JobChannel(environ, WorkerEnv(run_dir=str(tmp_path)), connect=lambda: store))
    return mon, store, state, monitor_mod


def test_a_first_signal_asks_the_job_to_stop_and_a_second_stops_the_rank_at_once(rank_1, monkeypatch, capsys):
    mon, store, state, monitor_mod = rank_1
    keys = mon.ch.keys
    mon._signals(store, [signal.SIGUSR1])
    req = pp.Request.parse(store.get(keys.preempt))
    assert state.signum == signal.SIGUSR1 and (req.signal, req.by, req.node) == ("SIGUSR1", "rank 1", 1)
    assert int(store.add(keys.alarm, 0)) == 1  # every rank reads the request at its next poll
    assert capsys.readouterr().err == ("ddprun: rank 1 got SIGUSR1: asking every rank to stop at one step "
                                       "(a second signal stops this rank at once)\n")
    recorded = []
    monkeypatch.setattr(monitor_mod, "record", lambda rec, ch: recorded.append(rec))

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(monitor_mod.os, "_exit", exit_now)
    with pytest.raises(SystemExit) as ended:
        mon._signals(store, [signal.SIGTERM])
    assert ended.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.startswith("ddprun: rank 1 stopped by a second SIGTERM at step ")
    assert [(r.rank, r.exit_code) for r in recorded] == [(1, 143)] and "second SIGTERM" in recorded[0].summary


@pytest.mark.parametrize("consumer", ["none", "fit", "on_preempt"])
def test_a_signal_with_nothing_to_stop_at_a_step_ends_the_rank_at_once_else_a_step_is_agreed(rank_1, monkeypatch,
                                                                                             consumer):
    mon, store, state, _ = rank_1
    died = []
    monkeypatch.setattr(preempt, "die_by", died.append)
    state.fit_active = consumer == "fit"
    if consumer == "on_preempt":
        state.callbacks.append(lambda step: None)
    mon._signals(store, [signal.SIGTERM])
    mon._watch_preemption(store)
    agreed = store.get(mon.ch.keys.preempt_stop).decode()
    assert state.requested
    if consumer == "none":  # neither ddprun.fit nor an on_preempt callback: SIGTERM does what it always did
        assert agreed == pp.NO_STEP and died == [signal.SIGTERM] and state.stop_step is None
    else:
        assert died == [] and state.stop_step == int(agreed) >= 2


def test_a_rank_that_got_no_signal_learns_of_no_step_and_ends_as_a_peer_of_the_signalled_ones(rank_1, monkeypatch):
    mon, store, state, _ = rank_1
    died = []
    monkeypatch.setattr(preempt, "die_by", died.append)
    req = pp.Request("SIGTERM", "rank 0", 0, "host-a", 1.0)
    store.set(mon.ch.keys.preempt, req.to_json())
    store.set(mon.ch.keys.preempt_stop, pp.NO_STEP)
    state.fit_active = True
    mon._watch_preemption(store)
    assert state.requested and state.signame == "SIGTERM" and state.stop_step is None and died == []


def test_a_forked_child_has_its_own_signals_not_the_ranks_pipe_nor_its_handlers(installed):
    """A byte in the wakeup pipe is a signal to the rank, and a second one ends it at once: a child's
    signal (a DataLoader worker's, from a scheduler's signal to every process) must not write there.
    Nor may the child keep the rank's handler, which only sets a flag: a Pool's terminate() (SIGTERM)
    would end nothing, and its join() wait forever. It dies of the signal, as without ddprun."""
    fd, _ = installed
    r, w = os.pipe()
    pid = fork()
    if pid == 0:  # the child: its wakeup fd, then a signal to itself
        try:
            os.write(w, f"{signal.set_wakeup_fd(-1)} {signal.signal is preempt._signal_signal}".encode())
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(2)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 32) == b"-1 True"
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGUSR1, status
    got = os.read(fd, 64) if select.select([fd], [], [], 0.3)[0] else b""
    assert signal.SIGUSR1 not in list(got), "the child's signal reached the rank's pipe"  # (another may: SIGWINCH)
    os.close(r)


def test_a_store_call_that_fails_after_a_signals_request_is_made_again_not_the_ranks_end(rank_1, monkeypatch):
    """The signal's request reached the job store; a later call of the same poll failed (its stop-step
    proposal: a store timeout, as every rank asks at once). The next poll proposes again and the job
    agrees on a step; the rank did not die by the signal (it used to: no stop step, no checkpoint)."""
    mon, store, state, _ = rank_1
    died = []
    monkeypatch.setattr(preempt, "die_by", died.append)
    state.fit_active = True
    failed = []

    class Flaky:
        def __getattr__(self, name):
            call = getattr(store, name)
            if name != "compare_set":
                return call

            def compare_set(key, expected, desired):
                if key == mon.ch.keys.preempt_stop and not failed:
                    failed.append(key)
                    raise RuntimeError("Socket Timeout")
                return call(key, expected, desired)
            return compare_set

    monkeypatch.setattr(mon.ch, "connect", Flaky)
    mon._wake = os.pipe()
    mon._hand([signal.SIGUSR1])
    stop = threading.Timer(1.3, mon.stop)  # two more polls (MONITOR_POLL_S 0.5 s)
    stop.start()
    mon._loop()
    stop.join()
    assert failed and died == [], died
    assert pp.Request.parse(store.get(mon.ch.keys.preempt)).signal == "SIGUSR1"
    assert state.requested and state.stop_step == int(store.get(mon.ch.keys.preempt_stop).decode()) >= 2


def test_a_signal_during_fits_setup_is_answered_with_a_stop_step_and_a_failed_setup_leaves_no_consumer(
        rank_1, monkeypatch):
    # a preemption while fit loads a large checkpoint or builds DDP: fit stops at its step with a
    # checkpoint (or its grace's forced stop requeues); NO_STEP would stop the job as a failure
    from torch import nn

    from ddprun.train import loop as loop_mod

    mon, store, state, _ = rank_1
    monkeypatch.setattr(loop_mod, "PREEMPT", state)
    died = []
    monkeypatch.setattr(preempt, "die_by", died.append)

    def setup_signalled(*args):
        mon._signals(store, [signal.SIGTERM])
        mon._watch_preemption(store)
        raise RuntimeError("setup failed")

    monkeypatch.setattr(loop_mod, "_setup", setup_signalled)
    with pytest.raises(RuntimeError, match="setup failed"):
        loop_mod.fit_module(nn.Linear(2, 1), [torch.zeros(2)], loss_fn=nn.functional.mse_loss)
    agreed = store.get(mon.ch.keys.preempt_stop).decode()
    assert died == [] and agreed != pp.NO_STEP and state.stop_step == int(agreed) >= 2
    assert state.fit_active is False  # a fit that raised stops nothing at a step any more
