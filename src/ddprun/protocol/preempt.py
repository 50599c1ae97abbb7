"""What agents and workers agree on for a preemption (a polite kill): the signals, the stop step, the
records in the store, and the grace before the agent forces the stop. Pure.

The flow (docs/preemption.md): a signal only sets a flag where it lands (an agent or a worker). The
first observer publishes a :class:`Request` (store key ``preempt``, first writer wins). Every rank's
monitor then proposes a stop step, :func:`propose`, with ``compare_set`` on ``preempt/stop``: the
first proposal is the job's stop step, a step every rank can still reach (ranks of a DDP job are
within one optimizer step of each other, and each learns the stop step within one monitor poll).
Every rank ends after that optimizer step; ``ddprun.fit`` saves its checkpoint there first and
rank 0 publishes a :class:`Saved` (``preempt/saved``). Each agent then ends with :data:`EXIT_CODE`.
An agent whose workers have not ended ``grace`` seconds after the request stops them as torch would.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from ddprun.errors import ConfigError
from ddprun.protocol import defaults

NO_STEP = "none"
"""``preempt/stop`` when the first proposer has nothing that stops at a step (neither ddprun.fit nor
an ``on_preempt`` callback): the signalled processes then end at once, as without ddprun."""

STOPPING_FOR_NONE = "none"
"""The value of an agent's ``stopping/<node>`` mark when it stops its workers because the job
answered :data:`NO_STEP` (any other stop marks "1"): a worker whose script handles the signal itself
is then left to its handler, as under torchrun, within ``--stop-grace``; every other stop ends it at once."""

EXIT_CODE = 75
"""``ddprun run``'s exit code after every rank stopped at the agreed step (EX_TEMPFAIL: run it again)."""

HORIZON_S = 3.0
"""A proposed stop step lies at least this many seconds of steps ahead (six monitor polls)."""

MIN_AHEAD = 2
"""...and at least this many steps: the step in flight, and one more."""


STOP_SIGNALS = ("TERM", "INT", "HUP", "QUIT", "USR1", "USR2", "XCPU", "PWR")
"""The signals that may be preemption signals: each asks a process to end (a scheduler's notice, a
terminal's Ctrl-C or Ctrl-\\, a lost session, a CPU-time limit, a power failure; USR1/USR2 are what
SLURM's --signal and LSF send before the kill). Any other is sent for something else (CHLD when a
worker ends, WINCH when a terminal is resized, PIPE, CONT, URG, ALRM, a fault of the process itself):
taken as a preemption it would stop a healthy job."""

OTHER_MEANINGS = {"CHLD": "a child process ended (every worker's exit)", "WINCH": "a terminal was resized",
                  "PIPE": "a write to a closed pipe", "CONT": "a stopped process continued",
                  "URG": "urgent data on a socket", "ALRM": "a timer of the process's own"}


def parse_signals(raw: str, where: str = "--preempt-signals") -> tuple[int, ...]:
    """``TERM,USR1`` (or ``SIGTERM``, or numbers) -> signal numbers; ``none`` or "" -> (). Only
    :data:`STOP_SIGNALS` (those this platform has)."""
    text = raw.strip()
    if text.lower() in ("", "none", "off"):
        return ()
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        name = part.upper().removeprefix("SIG")
        try:
            num = int(part) if part.isdigit() else int(getattr(signal.Signals, f"SIG{name}"))
            signal.Signals(num)
        except (AttributeError, ValueError):
            raise ConfigError("A preemption signal is not a signal name.", seen=f"{where} {raw!r} ({part!r})",
                              hint="Give names such as TERM,INT,USR1,USR2,HUP, or none.") from None
        if num in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError("SIGKILL and SIGSTOP cannot be caught.", seen=f"{where} {raw!r}",
                              hint="Leave them out: give e.g. TERM,USR1.")
        _check_stop_signal(num, raw, where)
        if num not in out:
            out.append(num)
    return tuple(out)


def _check_stop_signal(num: int, raw: str, where: str) -> None:
    name = signal.Signals(num).name.removeprefix("SIG")
    if name in STOP_SIGNALS:
        return
    why = f"it is sent when {OTHER_MEANINGS[name]}" if name in OTHER_MEANINGS else "it does not ask a process to end"
    raise ConfigError(f"SIG{name} cannot be a preemption signal: {why}; taken as one it would stop a healthy job.",
                      seen=f"{where} {raw!r}",
                      hint=f"Give signals that mean 'stop': {','.join(STOP_SIGNALS)} (default {defaults.PREEMPT_SIGNALS}), "
                           "or none.")


def signal_names(signals: tuple[int, ...]) -> str:
    """The ``--preempt-signals`` spelling of ``signals`` (``TERM,INT``; ``none``)."""
    return ",".join(signal.Signals(s).name.removeprefix("SIG") for s in signals) or "none"


def propose(step: int, steps_per_s: float | None) -> int:
    """The stop step a rank at optimizer step ``step``, stepping ``steps_per_s``, proposes: far enough
    ahead that every rank learns it before reaching it (:data:`HORIZON_S`, :data:`MIN_AHEAD`)."""
    ahead = MIN_AHEAD
    if steps_per_s is not None and math.isfinite(steps_per_s) and steps_per_s > 0:
        ahead = max(ahead, math.ceil(steps_per_s * HORIZON_S) + 1)
    return step + ahead


@dataclass(frozen=True)
class Request:
    """Who asked the job to stop: ``by`` is ``agent``, ``rank <N>`` or :data:`METADATA` (a cloud's
    notice; ``signal`` then names it)."""

    signal: str
    by: str
    node: int
    host: str
    t: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: bytes | str | None) -> Request | None:
        try:
            d = json.loads(raw) if raw is not None else {}
            return cls(str(d["signal"]), str(d["by"]), int(d["node"]), str(d["host"]), float(d["t"]))
        except (ValueError, TypeError, KeyError):
            return None

    def where(self) -> str:
        if self.by == METADATA:
            return f"the instance metadata of node {self.node} ({self.host})"
        return f"{self.by} (node {self.node}, {self.host})"


METADATA = "metadata"
"""Request.by for a cloud's preemption notice (agent/spot.py), not a signal."""


def to_whom(req: Request) -> str:
    """`` to rank 1 of node 1 (host-b)``, `` to the agent of node 0 (host-a)``, `` on node 0 (host-a)``."""
    if req.by == METADATA:
        return f" on node {req.node} ({req.host})"
    return f" to {'the agent' if req.by == 'agent' else req.by} of node {req.node} ({req.host})"


@dataclass(frozen=True)
class Saved:
    """How the job stopped: at optimizer ``step`` of this launch (``fit_step``: fit's global step,
    counting resumed ones), the checkpoint ``path`` written in ``seconds`` ("" when nothing saved).
    ``step`` -1: the script ended by itself (rank 0 publishes that at every clean end of its script,
    since it may not have heard of a request made in its last steps; agents read it only after one):
    nothing to resume. A checkpoint written at the stop step is published at once, before the
    on_checkpoint hooks run, and again when rank 0 ends (``seconds``: the save's, in both)."""

    step: int
    fit_step: int
    path: str
    seconds: float
    by: str = "fit"
    """``fit`` (ddprun.fit saved ``path``) or ``on_preempt`` (the script's callbacks ran)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: bytes | str | None) -> Saved | None:
        try:
            d = json.loads(raw) if raw is not None else {}
            return cls(int(d["step"]), int(d["fit_step"]), str(d["path"]), float(d["seconds"]), str(d.get("by", "fit")))
        except (ValueError, TypeError, KeyError):
            return None


def grace(environ: Mapping[str, str], flag: float | None) -> tuple[float, str]:
    """Seconds an agent waits after a preemption request before it stops its workers, and why.

    The flag wins; else DDPRUN_PREEMPT_GRACE (e.g. a Kubernetes pod's terminationGracePeriodSeconds
    passed in); else what the environment is known to give between its signal and its SIGKILL."""
    if flag is not None:
        return flag, "--preempt-grace"
    raw = environ.get("DDPRUN_PREEMPT_GRACE")
    if raw:
        try:
            value = float(raw)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(raw)
        except ValueError:
            raise ConfigError("DDPRUN_PREEMPT_GRACE is not a positive number of seconds.",
                              seen=f"DDPRUN_PREEMPT_GRACE={raw!r}", hint="e.g. DDPRUN_PREEMPT_GRACE=90, or unset it.") from None
        return value, "DDPRUN_PREEMPT_GRACE"
    if environ.get("SM_TRAINING_ENV") or environ.get("SM_HOSTS"):
        return 120.0, "SageMaker (StopTrainingJob: SIGTERM, then SIGKILL after 120 s)"
    if environ.get("SLURM_JOB_ID"):
        return defaults.PREEMPT_GRACE_S, "SLURM (KillWait, 30 s by default: scontrol show config | grep KillWait)"
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return defaults.PREEMPT_GRACE_S, "Kubernetes (terminationGracePeriodSeconds, 30 s by default)"
    return defaults.PREEMPT_GRACE_S, "default"
