"""Every default of ddprun, once: the CLI, :mod:`ddprun.config`, the agent and the workers read them here.

Units are seconds unless a name says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping

RUNS_ROOT = "runs"
"""Where run directories go (``runs/<run id>``) unless --log-dir or --run-dir says otherwise."""

RDZV_ID = "ddprun"
"""torch's rendezvous id of a multi-node job launched without --rdzv-id (its run id is agreed at launch)."""

JOIN_TIMEOUT_S = 120.0
"""The rendezvous waits this long for every node (torchrun: 600 s, and it prints nothing meanwhile)."""

JOIN_PROGRESS_S = 3.0
"""A join-progress line every this many seconds while nodes are missing."""

STALL_TIMEOUT_S = 300.0
"""No rank advancing for this long is a stall: hang report (gloo's own timeout: 30 min, silent)."""

STALL_FIRST_STEP_MIN_S = 30.0
"""Before the first progress (imports, data preparation, compilation) the bound is max(2 x stall, this)."""

BUSY_LIMIT_FACTOR = 4
"""A declared busy phase (telemetry.busy: a checkpoint write, on_checkpoint, a validation pass)
counts as progress for at most this many stall timeouts (worker/monitor.py); the ranks that wait
for another's (runtime.use_phase_timeout) wait at least as long."""

INIT_TIMEOUT_S = 600.0
"""``init_process_group``'s timeout: generous, every node's workers import and start."""

TRAIN_TIMEOUT_S = 300.0
"""Collectives' timeout once training runs (after the first completed step)."""

STRAGGLER_MARGIN = 0.2
"""A rank is a straggler when a part of its step exceeds the others' median by this fraction ..."""

STRAGGLER_WINDOWS = 3
"""... in this many consecutive telemetry windows."""

TELEMETRY_WINDOW_S = 2.0
"""Each rank publishes its step-time medians once per window."""

FINAL_TIMING_WAIT_S = 2.0
"""At a clean exit rank 0 waits at most this long for the other ranks' last timing window."""

MONITOR_POLL_S = 0.5
"""The worker's monitor thread polls the store this often (one read of the alarm key: failures,
preemption and stall requests are read only when it moved)."""

PROGRESS_PUBLISH_S = 1.0
"""A rank publishes its progress count at most this often (the stall observers compare the counts
every STALL_CHECK_S: a stall is reported at most this much later)."""

RELAY_STALE_S = 10.0
"""A worker whose node relay (agent/noderelay.py) has not beaten for this long talks to the job store
itself for the rest of the attempt (its agent stopped or frozen). As long as a node is taken for lost:
an agent merely short of CPU for a few seconds must not move its ranks' load onto the job's store
(3 s did, for 135 of 2,048 simulated ranks in benchmarks/control_plane.py)."""

HELD_GAP_S = 3.0
"""A loop of an agent or a worker that finds this long (several of its polls) since its own last tick
did not run meanwhile: the whole job suspended (scontrol suspend, SIGSTOP of the job, a paused VM; the
monotonic clock runs on through it), or this process frozen. It rebases every "since" time it judges
others by (a neighbour's beat, the job's progress, its relay's beat) to now: the others did not run
either, and their silence through it is no loss, no stall."""

STALL_CHECK_S = 1.0
"""The stall observer compares every rank's progress this often."""

PLACES_WAIT_S = 5.0
"""At a stall, the observer waits this long for every rank's answer (where its main thread is)."""

ECHO_WAIT_S = 2.0
"""A rank that sees only a peer's connection error waits this long for the first-hand record (its agent's)."""

ACK_WAIT_S = 3.0
"""A failing rank waits at most this long for the others to read its failure record."""

STOP_GRACE_S = 30.0
"""A stopped agent gives its workers this long between SIGTERM and SIGKILL (torch's own default)."""

PREEMPT_SIGNALS = "TERM,INT,USR1,USR2,HUP"
"""Signals that ask the job to stop at one agreed step (protocol/preempt.py): what schedulers send
before the kill (SLURM: TERM, or USR1/USR2 with --signal; Kubernetes, SageMaker: TERM), a terminal's
Ctrl-C (INT: once; a second one stops at once) and a lost session (HUP)."""

OWN_HANDLER_WAIT_S = 5.0
"""A rank about to end by a signal that nothing stops at a step gives the script's own handler for
it this long to run and return first (ddprun.preempt.let_own_handler_run)."""

PREEMPT_GRACE_S = 30.0
"""After a preemption request, an agent stops its workers after this long where the environment
says nothing else (SLURM's KillWait and Kubernetes' terminationGracePeriodSeconds default to 30 s)."""

EXIT_TIMEOUT_S = 60.0
"""A worker's atexit handlers get this long after the user's code returned; then it exits anyway."""

AGENT_MONITOR_INTERVAL_S = 0.1
"""torch's agent checks its workers this often."""

START_METHOD = "spawn"
"""How torch's agent starts workers (a fresh interpreter: safe with CUDA and threads)."""

MAX_SECONDS = 1e7
"""The longest wait a seconds flag or variable may ask for (about 116 days): far past any job's, and far
below what timedelta (about 8.6e13 s) and threading's timers (about 9.2e9 s) can hold."""

STORE_CALL_S = 5.0
"""The longest one call to the job's store may take on a failure path before it counts as the store
not answering: torch's TCPStore client waits for ever on a store whose host's process is stopped."""

SELF_CONNECT_S = 60.0
"""The connect of a store server ddprun starts (to itself) and of the agent's client of the endpoint's
store may take this long (agent/endpoint.py): torch's connect looks up the address's name, and a DNS
server that drops packets holds that lookup for the resolver's timeouts (10 s with glibc's defaults:
5 s a try, 2 tries). Their calls afterwards keep their own, shorter bound."""

SLOW_STORE_START_S = 3.0
"""The endpoint's store that took longer than this to start, or to answer the agent's connect, is
named on the console with its likely cause."""

NODE_RECORD_TIMEOUT_S = 2.0
"""A failing worker tries this long to hand its failure record to its agent's node store (127.0.0.1)."""

TORCH_KEEP_ALIVE_INTERVAL_S = 5
"""torch's c10d rendezvous: each node's keep-alive beat, seconds (``--rdzv-conf keep_alive_interval``) ..."""

TORCH_KEEP_ALIVE_MAX_ATTEMPT = 3
"""... and how many beats it may miss before another node drops it (``keep_alive_max_attempt``)."""


def keep_alive(rdzv_conf: Mapping[str, str]) -> tuple[int, int]:
    """(interval s, max attempts) of torch's keep-alive for these ``--rdzv-conf`` options (values
    already checked as whole numbers > 0), torch's defaults where unset."""
    return (int(rdzv_conf.get("keep_alive_interval", TORCH_KEEP_ALIVE_INTERVAL_S)),
            int(rdzv_conf.get("keep_alive_max_attempt", TORCH_KEEP_ALIVE_MAX_ATTEMPT)))
