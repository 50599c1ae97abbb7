"""The worker environment: every ``DDPRUN_*`` variable the agent gives its workers, typed, in one place.

The agent builds one :class:`WorkerEnv` and exports it with :meth:`WorkerEnv.to_environ` (torch's agent
adds torchrun's own variables: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...). Workers read it back
with :meth:`WorkerEnv.from_environ`; a malformed value is a :class:`~ddprun.errors.ConfigError` that
names the variable. Nothing else in ddprun reads or writes these names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from ddprun.errors import ConfigError
from ddprun.protocol import defaults

RUN_DIR = "DDPRUN_RUN_DIR"
DEVICE_KIND = "DDPRUN_DEVICE_KIND"
JOIN_TIMEOUT = "DDPRUN_JOIN_TIMEOUT"
STALL_TIMEOUT = "DDPRUN_STALL_TIMEOUT"
STALL_END = "DDPRUN_STALL_END"
EXIT_TIMEOUT = "DDPRUN_EXIT_TIMEOUT"
ALLOW_UNEVEN_NODES = "DDPRUN_ALLOW_UNEVEN_NODES"
NNODES = "DDPRUN_NNODES"
JOB_TOKEN = "DDPRUN_JOB_TOKEN"
STRAGGLER_MARGIN = "DDPRUN_STRAGGLER_MARGIN"
STRAGGLER_WINDOWS = "DDPRUN_STRAGGLER_WINDOWS"
TELEMETRY_WINDOW = "DDPRUN_TELEMETRY_WINDOW"
DOCTOR = "DDPRUN_DOCTOR"
ATTEMPT = "DDPRUN_ATTEMPT"
MERGE_STDERR = "DDPRUN_MERGE_STDERR"
SOFT_EXIT = "DDPRUN_SOFT_EXIT"
"""Set by the user, not the agent: exit workers through the interpreter (see worker/exit.py)."""
PREEMPT_SIGNALS = "DDPRUN_PREEMPT_SIGNALS"
NODE_STORE = "DDPRUN_NODE_STORE"
STANDBY_FD = "DDPRUN_STANDBY_FD"
"""Set in a standby interpreter's own environment only, never a worker's: the file descriptor of its
go message (agent/standby.py, worker/standby.py)."""
AGENT_PID = "DDPRUN_AGENT_PID"
"""The pid of the agent that started this worker (or standby), set per process as it starts: a
worker whose parent is another process by the time it ties its life to its agent's was orphaned
while its interpreter started, and exits (worker/bootstrap.py ``die_with_agent``)."""


@dataclass(frozen=True)
class WorkerEnv:
    """What a ``ddprun run`` worker knows beyond torchrun's variables (field -> variable, see :data:`_VARS`)."""

    run_dir: str
    """The run directory, absolute; the same on every node (shared or not)."""
    device_kind: str = "cpu"
    """``cuda`` (one GPU per local rank) or ``cpu``."""
    join_timeout: float = defaults.JOIN_TIMEOUT_S
    stall_timeout: float = defaults.STALL_TIMEOUT_S
    """Seconds without progress before the hang report; 0 = off."""
    stall_end: float = defaults.STALL_TIMEOUT_S
    """Seconds a reported stall may last more before the job ends; 0 = end right after the report."""
    exit_timeout: float = defaults.EXIT_TIMEOUT_S
    """Seconds the atexit handlers may take; then the worker says which one hangs and exits."""
    min_nodes: int = 1
    max_nodes: int = 1
    job_token: str = ""
    straggler_margin: float = defaults.STRAGGLER_MARGIN
    straggler_windows: int = defaults.STRAGGLER_WINDOWS
    telemetry_window: float = defaults.TELEMETRY_WINDOW_S
    doctor: bool = False
    """Rank 0 prints the preflight facts even when every check passes."""
    allow_uneven_nodes: bool = False
    """Nodes may run different process counts (--allow-uneven-nodes); preflight refuses it otherwise."""
    attempt: str = ""
    """The worker group's attempt id, the same on every node (agent/attempt.py); "" = from the restart count."""
    merge_stderr: bool = False
    """The worker joins its stderr to stdout (its rank log) as its first act."""
    preempt_signals: str = defaults.PREEMPT_SIGNALS
    """Signals that ask the job to stop at one agreed step (protocol/preempt.py); ``none``: off."""

    node_store: str = ""
    """``127.0.0.1:PORT`` of the node store the agent hosts for its workers (agent/noderelay.py); "" = none."""

    @property
    def busy_limit_s(self) -> float:
        """Seconds the stall watch counts a declared busy phase as progress (``BUSY_LIMIT_FACTOR`` x
        ``stall_timeout``, at least 1 s each)."""
        return defaults.BUSY_LIMIT_FACTOR * max(self.stall_timeout, 1.0)

    def to_environ(self) -> dict[str, str]:
        """The variables to export into every worker of this node."""
        out = {var: _format(getattr(self, name)) for name, var in _VARS.items()}
        out[NNODES] = f"{self.min_nodes}:{self.max_nodes}"
        return {k: v for k, v in out.items() if v != "" or k == JOB_TOKEN}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> WorkerEnv | None:
        """The worker environment, or None outside a ``ddprun run`` worker (no DDPRUN_RUN_DIR)."""
        if not environ.get(RUN_DIR):
            return None
        kw: dict[str, object] = {}
        for f in fields(cls):
            var = _VARS.get(f.name)
            if var is not None and var in environ:
                kw[f.name] = _parse(var, environ[var], f.default)
        if NNODES in environ:
            kw["min_nodes"], kw["max_nodes"] = _nnodes(environ[NNODES])
        if environ.get(SOFT_EXIT, "") not in ("", "0", "1"):
            raise ConfigError(f"{SOFT_EXIT} must be 1 (exit through the interpreter) or 0.",
                              seen=f"{SOFT_EXIT}={environ[SOFT_EXIT]!r}", hint=f"export {SOFT_EXIT}=1, or unset it.")
        return cls(**kw)  # type: ignore[arg-type]


_VARS = {
    "run_dir": RUN_DIR, "device_kind": DEVICE_KIND, "join_timeout": JOIN_TIMEOUT,
    "stall_timeout": STALL_TIMEOUT, "stall_end": STALL_END, "exit_timeout": EXIT_TIMEOUT, "job_token": JOB_TOKEN,
    "straggler_margin": STRAGGLER_MARGIN, "straggler_windows": STRAGGLER_WINDOWS, "telemetry_window": TELEMETRY_WINDOW,
    "doctor": DOCTOR, "allow_uneven_nodes": ALLOW_UNEVEN_NODES, "attempt": ATTEMPT, "merge_stderr": MERGE_STDERR,
    "preempt_signals": PREEMPT_SIGNALS, "node_store": NODE_STORE,
}


def inside_worker(environ: Mapping[str, str]) -> bool:
    """Whether this process is a ``ddprun run`` (or ``ddprun.launch``) worker."""
    return bool(environ.get(RUN_DIR))


def device_kind(environ: Mapping[str, str]) -> str | None:
    """The device kind the launcher chose for the whole job (``cuda``/``cpu``), None when no launcher
    did (plain torchrun: use a GPU if there is one). Also set alone by ddprun.ray in its workers."""
    raw = environ.get(DEVICE_KIND)
    if raw in (None, ""):
        return None
    return str(_parse(DEVICE_KIND, raw, "cpu"))


def soft_exit(environ: Mapping[str, str]) -> bool:
    return environ.get(SOFT_EXIT) == "1"


def _format(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else ""
    return str(value)


def _parse(var: str, raw: str, default: object) -> object:
    try:
        if isinstance(default, bool):
            if raw not in ("", "0", "1"):
                raise ValueError(raw)
            return raw == "1"
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            value = float(raw)
            if value != value or value in (float("inf"), float("-inf")) or value < 0:
                raise ValueError(raw)
            return value
    except ValueError:
        kind = "0 or 1" if isinstance(default, bool) else f"a {'whole' if isinstance(default, int) else ''} number >= 0"
        raise ConfigError(f"{var} is not {kind.replace('  ', ' ')}.", seen=f"{var}={raw!r}",
                          hint=f"unset {var} (ddprun run sets it for its workers) or give e.g. {var}={default!r}.") from None
    if var == PREEMPT_SIGNALS:
        from ddprun.protocol.preempt import parse_signals

        parse_signals(raw, var)  # a ConfigError naming the variable
    if var == NODE_STORE and node_store_address(raw) is None:
        raise ConfigError(f"{var} must be HOST:PORT.", seen=f"{var}={raw!r}", hint=f"unset {var}; ddprun run sets it.")
    if var == DEVICE_KIND and raw not in ("cpu", "cuda"):
        raise ConfigError(f"{var} must be cpu or cuda.", seen=f"{var}={raw!r}", hint=f"unset {var}; ddprun run sets it.")
    return raw


def node_store_address(raw: str) -> tuple[str, int] | None:
    """``(host, port)`` of a :data:`NODE_STORE` value, None when malformed (pure)."""
    host, _, port = raw.rpartition(":")
    return (host, int(port)) if host and port.isdigit() and 0 < int(port) < 65536 else None


def _nnodes(raw: str) -> tuple[int, int]:
    lo, _, hi = raw.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
        if not 1 <= a <= b:
            raise ValueError(raw)
    except ValueError:
        raise ConfigError(f"{NNODES} must be MIN:MAX nodes.", seen=f"{NNODES}={raw!r}",
                          hint=f"unset {NNODES}; ddprun run sets it (e.g. 2:2).") from None
    return a, b


FR_BUFFER_DEFAULT = "2000"
"""Collectives kept per process (torch's ring buffer; a few hundred bytes each)."""
_FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_DUMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
"""Where NCCL's Flight Recorder dumps at a timeout (a prefix; the rank is appended)."""


def flight_recorder_env(environ: Mapping[str, str], logs_dir: str) -> dict[str, str]:
    """The workers' Flight Recorder settings: on, and NCCL's dump on timeout into ``logs_dir``
    (``nccl-trace-rank-N``), unless the user set them. Pure."""
    out: dict[str, str] = {}
    if not any(environ.get(v) for v in _FR_VARS):
        out["TORCH_FR_BUFFER_SIZE"] = FR_BUFFER_DEFAULT
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ and FR_DUMP_FILE not in environ:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        out[FR_DUMP_FILE] = os.path.join(logs_dir, "nccl-trace-rank-")
    return out
