"""One agent's part in a preemption (protocol/preempt.py): its own signal as a flag, the request in
the store, the grace, and how the node's launch ends.

The agent's handler (agent/torch_agent.py, in place of torch's once the workers run) only records
the first signal; a second one stops the workers at once, as torch does (so does any signal while a
restart stops the old workers and re-enters the rendezvous: no step to stop at then). :meth:`Preemption.check`
runs in the agent's monitor loop: it publishes this node's request, notices one from another node
(agent/failures.py reads the store), and says when the grace is over. Then torch's agent stops the
workers that have not stopped (SIGTERM, and SIGKILL after ``--stop-grace``).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from ddprun.protocol import failure as fr
from ddprun.protocol import preempt as pp

REQUEUE_WAIT_S = 10.0
"""At most this long node 0 waits for every node's last line before it requeues the job."""
REQUEUE_TIMEOUT_S = 30.0
"""At most this long for ``scontrol requeue`` (it asks slurmctld, which may be busy)."""
CLOCK_TRUST_S = 10.0
"""A request read later than this after its time says (or before it) is taken as the hosts' clocks
disagreeing: the grace then counts from when this agent read it (agents read it within a second)."""
SAVED_WAIT_S = 3.0
"""How long an agent waits for rank 0's Saved record before its exit barrier (rank 0 writes it
milliseconds after fit's last barrier, which every rank passed)."""


class Preemption:
    """See the module docstring. ``failures``: this agent's AgentFailures (the store's reader)."""

    def __init__(self, signals: tuple[int, ...], grace_s: float, grace_src: str, failures: Any, out: TextIO,
                 host: str):
        self.signals, self.grace_s, self.grace_src = signals, grace_s, grace_src
        self.failures, self.out, self.host = failures, out, host
        self.sig: int | None = None
        """This agent's own first preemption signal (set by its handler: nothing else happens there)."""
        self.notice: str | None = None
        """A cloud's preemption notice this node got (agent/spot.py), e.g. "an AWS spot interruption notice"."""
        self._published = self._said_stop = False
        self._since: float | None = None
        """When this agent learned of the job's request (monotonic)."""
        self.saved: pp.Saved | None = None
        """Where rank 0 stopped, read before the exit barrier."""
        self.ended_by_request: bool | None = None
        """Whether the job was stopping at a step when every worker had ended (None: not read)."""

    def on_signal(self, sig: int) -> None:
        """The agent's handler, main thread: a flag only."""
        if self.sig is None:
            self.sig = sig

    def on_notice(self, notice: str) -> None:
        """The spot-notice thread (agent/spot.py): a flag only, handled like a signal by :meth:`check`."""
        if self.notice is None:
            self.notice = notice

    @property
    def request(self) -> pp.Request | None:
        return self.failures.preempt_request

    def preempting(self) -> bool:
        """The job stops at an agreed step (a request, and no NO_STEP answer)."""
        asked = self.sig is not None or self.notice is not None or self.request is not None
        return asked and self.failures.preempt_stop != pp.NO_STEP

    def answered_none(self) -> bool:
        """The job answered this request NO_STEP: nothing in it stops at a step (the workers are then
        stopped as torch stops them, a script's own handler for the signal deciding: worker/signals.py)."""
        return self.failures.preempt_stop == pp.NO_STEP

    def preempting_now(self) -> bool:
        """:meth:`preempting`, with the job's answer read from the store where no beat has read it yet
        (a beat reads it every 0.5 s): a request its ranks answered NO_STEP is no preemption."""
        if self.request is not None:
            self.failures.read_preempt_stop()
        return self.preempting()

    def restart_forbidden(self) -> bool:
        """No restart of a failed group: this node got a preemption signal or notice (it goes away,
        whatever the job answered), or the job stops at a step (:meth:`preempting_now`)."""
        return self.preempting_now() or self.sig is not None or self.notice is not None

    def check(self) -> int | None:
        """From the agent's monitor loop: publish this node's request, start the grace when the job's
        request is known; the signal to stop the workers with once the grace is over, else None."""
        if (self.sig is not None or self.notice is not None) and not self._published:
            self._published = True
            name = signal.Signals(self.sig).name if self.sig is not None else str(self.notice)
            by = "agent" if self.sig is not None else pp.METADATA
            self.failures.publish_preempt(pp.Request(name, by, self.failures.node_rank, self.host, time.time()))
            self._say(f"got {name}: asking every rank to stop after one agreed optimizer step (ddprun.fit saves "
                      f"its checkpoint there; a script with nothing to save stops now); workers still running in "
                      f"{self.grace_s:g} s ({self.grace_src}) are stopped; a second signal stops them now")
        if not self.preempting():  # none asked, answered NO_STEP, or a new attempt: no grace runs
            self._since, self._said_stop = None, False
        elif self._since is None:
            self._since = time.monotonic() - self._lag()
        stop, req = self.failures.preempt_stop, self.request
        if not self._said_stop and stop not in (None, pp.NO_STEP) and req is not None:
            self._said_stop = True
            self._say(f"{req.signal} on {req.where()}: every rank stops after optimizer step {stop} of this launch")
        if (self.sig is not None or self.notice is not None) and stop == pp.NO_STEP:
            # nothing in the job stops at a step: this signal stops the workers now, as torch's would
            return self.sig or signal.SIGTERM
        if self.grace_over():
            return self.stop_signal()
        return None

    def stop_signal(self) -> int:
        """The signal a forced stop stops the workers with and exits by: this agent's own, else the
        request's (SIGTERM for a cloud's notice)."""
        return self.sig or int(getattr(signal, self.signame(), signal.SIGTERM))

    def _lag(self) -> float:
        """How long ago (s) the job's request was made: every node's grace then ends at one moment, so
        no node's workers outlive their peers' (whose stop would fail them). 0 for this node's own
        signal, or when the hosts' clocks disagree (the request's time is ahead, or implausibly old)."""
        req = self.request
        lag = time.time() - req.t if req is not None else 0.0
        return lag if 0.0 <= lag <= CLOCK_TRUST_S else 0.0

    def before_exit(self) -> None:
        """Every worker ended 0: read the job's request and its answer (a beat may not have read them
        yet) and where rank 0 stopped, while the store's host still waits for us; whether this launch
        ended by a preemption is decided here (:meth:`ended_preempted`)."""
        self.failures.read_preempt_request()
        self.ended_by_request = self.preempting_now()
        if self.ended_by_request:
            self.saved = self.failures.read_preempt_saved(wait_s=SAVED_WAIT_S)

    def ended_preempted(self) -> bool:
        """The workers all ended 0 and the job had been asked to stop at a step: as read before the
        exit barrier (:meth:`before_exit`), where the store answers. A request or signal that comes
        later, while the agents wait for each other, found this node's workers done: no preemption."""
        return self.preempting() if self.ended_by_request is None else self.ended_by_request

    def grace_over(self) -> bool:
        """The grace ended while the job stops at a step (a request answered NO_STEP has none)."""
        return self._since is not None and self.preempting() and time.monotonic() - self._since >= self.grace_s

    def _say(self, text: str) -> None:
        print(f"ddprun: {text}", file=self.out, flush=True)

    def signame(self) -> str:
        req = self.request
        if req is not None:
            return req.signal
        if self.sig is not None:
            return signal.Signals(self.sig).name
        return self.notice or "SIGTERM"

    def finished_line(self) -> tuple[int, str]:
        """The workers all ended 0 after the request: (exit code, the node's line)."""
        saved = self.saved  # read before the exit barrier: the store's host may be gone now
        req, name = self.request, self.signame()
        who = "" if req is None else pp.to_whom(req)
        if saved is None:
            return pp.EXIT_CODE, (f"ddprun: preempted by {name}{who}: the workers stopped (rank 0 did not say at "
                                  "which step); resume with the same command")
        if saved.step < 0:  # the script ended by itself before the stop step (protocol/preempt.py Saved)
            return 0, f"ddprun: {name} came as the run was ending: it finished; nothing to resume"
        where = f"every rank stopped after optimizer step {saved.step} of this launch"
        if saved.path:
            what = (f"checkpoint at step {saved.fit_step} saved in {saved.seconds:.1f} s ({saved.path}); "
                    "resume with the same command")
        elif saved.by == "on_preempt":
            what = f"the script's on_preempt callbacks ran there ({saved.seconds:.1f} s)"
        else:
            what = "no checkpoint was saved"
        return pp.EXIT_CODE, f"ddprun: preempted by {name}{who}: {where}; {what}"

    def forced_by_peer(self, cause: Any) -> bool:
        """Whether ``cause`` (the job's root failure record) is another node going while the job stops
        at a step: its agent stopped its workers (its grace ended, or a second signal came, first) or
        it was lost (the node hosting the store stopped so: its record went with the store), and this
        node's workers failed of it. The preemption's forced stop, not a failure of the job's own.
        Only once the job agreed on a step: a request its ranks answered NO_STEP (or not yet) makes the
        signalled node stop its workers at once, as torch's agent does, and that is the job's failure."""
        if cause is None or cause.kind not in (fr.SIGNAL, fr.LOST) or cause.rank >= 0:
            return False
        if cause.node_rank == self.failures.node_rank or not self.preempting_now():
            return False
        return self.failures.preempt_stop is not None

    def forced_why(self) -> str | None:
        """What this agent's record says when its grace ends (None: not a preemption's forced stop)."""
        if not (self.preempting() and self.grace_over()):
            return None
        return (f"its preemption grace of {self.grace_s:g} s ({self.grace_src}) ended before its ranks stopped "
                "at the agreed step, and it stopped its workers")

    def forced_line(self, cause: Any = None) -> str:
        """The grace ended before every local worker stopped at the agreed step; ``cause``: the record of
        the node that stopped first, when this node's own grace is not over yet."""
        if cause is not None and not self.grace_over():
            return (f"ddprun: the preemption stop did not complete on every node: {cause.headline()}; this node's "
                    f"workers were stopped before the stop completed; {self._last_checkpoint()}.")
        return (f"ddprun: the preemption grace of {self.grace_s:g} s ({self.grace_src}) ended before every rank "
                f"of this node stopped at the agreed step; workers stopped; {self._last_checkpoint()}. "
                "HINT: a longer --preempt-grace, if the cluster gives that long.")

    def _last_checkpoint(self) -> str:
        """Which checkpoint the next start resumes from: the stop step's, when rank 0 said it was written
        before its ranks were stopped (an on_checkpoint hook outlasted the grace), else the one before."""
        saved = self.saved or self.failures.read_preempt_saved()
        if saved is None or saved.step < 0 or not saved.path:
            return "the last checkpoint is the one before"
        return (f"rank 0 had saved the stop step's checkpoint first (step {saved.fit_step}, {saved.path}): the same "
                "command resumes from there")


def requeue(command: list[str], out: TextIO, run: Callable[..., Any] = subprocess.run) -> bool:
    """``scontrol requeue <job>`` (cluster/slurm.py requeue_command) once, bounded by
    REQUEUE_TIMEOUT_S; one line either way. True if SLURM took the job back.

    SLURM's requeue ends the job's steps at once (SIGCONT, SIGTERM, SIGKILL after its KillWait), this
    agent's among them, before or after scontrol returns (seen: the line lost on the SLURM test bed
    after a forced stop). So SIGTERM is ignored from before the call and, once the job is requeued,
    for the rest of this process: the agent's line, run report and exit code come first, and SLURM's
    SIGKILL bounds it. When the requeue failed, the handler is put back. Main thread only (elsewhere
    Python cannot set handlers: nothing is ignored)."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    ok = False
    try:
        ok = _requeue(command, out, run)
        return ok
    finally:
        if main and not ok and old is not None:  # None: a handler set from C, which Python cannot put back
            signal.signal(signal.SIGTERM, old)


def _requeue(command: list[str], out: TextIO, run: Callable[..., Any]) -> bool:
    job = command[-1]
    try:
        done = run(command, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S)
        ok, why = done.returncode == 0, (done.stderr or done.stdout or "").strip() or f"exit code {done.returncode}"
    except subprocess.TimeoutExpired:
        ok, why = False, f"scontrol did not answer within {REQUEUE_TIMEOUT_S:g} s"
    except OSError as e:
        ok, why = False, f"{type(e).__name__}: {e}"
    if ok:
        print(f"ddprun: requeued SLURM job {job} (scontrol requeue {job}): when SLURM starts it again, the same "
              "command resumes from this checkpoint", file=out, flush=True)
    else:
        print(f"ddprun: could not requeue SLURM job {job}: {why}\nHINT: requeue it yourself (scontrol requeue "
              f"{job}) or submit the same script again: it resumes from this checkpoint.", file=out, flush=True)
    return ok
