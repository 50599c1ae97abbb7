"""What the user asked for, as frozen dataclasses built from flags (cli.py) and read by agent/run.py.

Fields left ``None`` were not given and are filled by cluster detection (cluster/detect.py), which
records where every value came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddprun.protocol import defaults

# The defaults live in protocol/defaults.py; these names are what the CLI and callers import.
DEFAULT_JOIN_TIMEOUT_S = defaults.JOIN_TIMEOUT_S
DEFAULT_RUNS_ROOT = defaults.RUNS_ROOT
DEFAULT_STALL_TIMEOUT_S = defaults.STALL_TIMEOUT_S


@dataclass(frozen=True)
class Entry:
    """The program every worker runs: a script path, or a module run like ``python -m``."""

    target: str
    args: tuple[str, ...] = ()
    is_module: bool = False

    def argv(self) -> list[str]:
        """Arguments for ``python -m ddprun.worker``: ``[-m] TARGET ARGS...``."""
        return (["-m"] if self.is_module else []) + [self.target, *self.args]


@dataclass(frozen=True)
class LaunchConfig:
    """One ``ddprun run`` (or ``ddprun plan``) as the user asked for it.

    Topology fields keep torchrun's meaning; ``None`` means "not given, detect it".
    """

    entry: Entry | None = None
    nnodes: str | None = None
    """``N`` or ``MIN:MAX`` nodes (torchrun's --nnodes)."""
    nproc_per_node: str | None = None
    """Processes per node: an int, ``gpu``, ``cpu`` or ``auto``; None = every visible GPU, else 1."""
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    """``c10d`` (ddprun's default) or ``static`` (etcd rendezvous is refused: cluster/detect.py)."""
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    standalone: bool = False
    local_addr: str | None = None
    max_restarts: int | None = None
    """Restarts of the worker group before failing; None: the cluster's (a PyTorchJob's
    PET_MAX_RESTARTS, as torchrun reads it), else 0. ``ddprun run`` resolves it before launching."""
    monitor_interval: float = defaults.AGENT_MONITOR_INTERVAL_S
    """Seconds between the agent's checks of its workers."""
    join_timeout: float = DEFAULT_JOIN_TIMEOUT_S
    """Seconds the rendezvous waits for all nodes before every waiting node exits non-zero."""
    log_dir: str | None = None
    """Root of run directories (torchrun's --log-dir); the run goes to ``<log_dir>/<run-id>``."""
    run_dir: str | None = None
    """Exact run directory; overrides ``log_dir``."""
    redirects: str = "0"
    tee: str = "0"
    """Local ranks whose output is also shown on the console (torchrun's --tee); rank 0 always is."""
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S
    """Seconds without progress on any rank (steps, collectives, heartbeats) before the hang report; 0 = off."""
    stall_end: float | None = None
    """Seconds a reported stall may last more before the job ends; None = as long as stall_timeout, 0 = at once."""
    stop_grace: float = defaults.STOP_GRACE_S
    """Seconds between the agent's SIGTERM to its workers and its SIGKILL when it is stopped."""
    preempt_signals: str = defaults.PREEMPT_SIGNALS
    """Signals that stop every rank at one agreed step, with fit's checkpoint (protocol/preempt.py); ``none``: off."""
    preempt_grace: float | None = None
    """Seconds after a preemption request before the agent stops its workers; None: from the environment."""
    spot_notice: str = "off"
    """``aws``/``gcp``: a preemption notice in the instance metadata stops the job like a signal (agent/spot.py)."""
    requeue: bool = False
    """SLURM: after a preemption stop, node rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` once."""
    warm_start: str = "auto"
    """``on``: the first attempt's workers are standby interpreters started before the rendezvous
    (agent/standby.py); ``off``: torch starts them; ``auto``: on when the machine has a CPU for each worker
    process it runs (agent/run.py ``processes_here``)."""
    exit_timeout: float = defaults.EXIT_TIMEOUT_S
    """Seconds a worker's atexit handlers may take before it exits anyway, naming the one that hangs."""
    straggler_margin: float = defaults.STRAGGLER_MARGIN
    """A rank is a straggler when a part of its step exceeds the others' median by this fraction."""
    straggler_windows: int = defaults.STRAGGLER_WINDOWS
    telemetry_window: float = defaults.TELEMETRY_WINDOW_S
    """Seconds per step-timing window (each rank publishes its medians once per window)."""
    """... in this many consecutive telemetry windows (2 s each)."""
    doctor: bool = False
    """Rank 0 prints the preflight facts table even when every check passes."""
    start_method: str = defaults.START_METHOD
    hostfile: str | None = None
    role: str = "trainer"
    """The workers' role (torchrun's --role): torch sets ROLE_NAME to it."""
    allow_uneven_nodes: bool = False
    """Let nodes run different process counts (e.g. 8 + 4 GPUs); ranks then follow torch's agent: a
    node's ranks follow those of every node with a lower node rank. Off: preflight refuses it."""


def run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a run directory (``runs/<run id>``: exactly one directory name), or
    None. A run id with a ``/`` or of ``.``/``..`` would put the run's files elsewhere."""
    if not run_id or run_id in (".", ".."):
        return "it is empty, '.' or '..'"
    if "/" in run_id or "\0" in run_id:
        return "it holds a '/' (or a NUL)"
    return None
