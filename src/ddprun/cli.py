"""``ddprun`` command line: parse -> pure config -> one library call per subcommand.

``ddprun run`` takes torchrun's launch flags with the same meaning (dash and underscore spellings),
so a torchrun launch line works by replacing the word ``torchrun``; the few torchrun flags ddprun
cannot honour (TORCHRUN_REFUSED) are refused by name, with what to use instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence

from ddprun.cli_help import DESCRIPTION, EPILOGS, HELP, TOP_EPILOG
from ddprun.cluster.probe import check_endpoint, check_shared_port, probe_node
from ddprun.config import DEFAULT_JOIN_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, Entry, LaunchConfig, run_id_problem
from ddprun.errors import ConfigError, DdprunError
from ddprun.protocol import defaults
from ddprun.protocol.defaults import EXIT_TIMEOUT_S, MAX_SECONDS, STOP_GRACE_S, TELEMETRY_WINDOW_S
from ddprun.protocol.preempt import EXIT_CODE, parse_signals


def _flag(parser: argparse._ActionsContainer, name: str, **kw) -> None:
    """Add ``--a-b`` with its torchrun spelling ``--a_b`` as an alias."""
    names = [name]
    if "-" in name[2:]:
        names.append("--" + name[2:].replace("-", "_"))
    parser.add_argument(*names, **kw)


def add_topology_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("topology (torchrun's flags; left out = detected)")
    _flag(g, "--nnodes", help="nodes: N or MIN:MAX (default: detected, else 1)")
    _flag(g, "--nproc-per-node", help="processes per node: N, gpu, cpu or auto "
                                      "(default: every visible GPU; 1 on a node without GPUs)")
    _flag(g, "--node-rank", type=int, help="this node's rank (static rendezvous; c10d assigns ranks itself)")
    _flag(g, "--master-addr", help="rendezvous host when --rdzv-endpoint is not given")
    _flag(g, "--master-port", type=int, help="rendezvous port (default 29500 multi-node, free port single-node)")
    _flag(g, "--rdzv-backend", help="c10d (default) or static")
    _flag(g, "--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every node")
    _flag(g, "--rdzv-id", help="job id, the same on every node; also names the run directory")
    _flag(g, "--rdzv-conf", default="", help="KEY=VALUE,... passed to torch's rendezvous")
    g.add_argument("--standalone", action="store_true", help="single node, local rendezvous on a free port")
    _flag(g, "--local-addr", help="this node's address as other nodes reach it")
    g.add_argument("--hostfile", help="file of `host slots=N` lines, the same on every node: this node's line "
                                      "is its rank, the first host the master, slots the processes per node")
    _flag(g, "--allow-uneven-nodes", action="store_true",
          help="let nodes run different numbers of processes (e.g. 8 + 4 GPUs), on every node; "
               "without it preflight refuses the job")
    _flag(g, "--join-timeout", type=float, default=None,
          help=f"seconds to wait for all nodes (default {DEFAULT_JOIN_TIMEOUT_S:.0f}; torchrun waits 600)")


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workers")
    _flag(g, "--max-restarts", type=int, default=None,
          help="restarts of the worker group before failing (default 0; a PyTorchJob's PET_MAX_RESTARTS)")
    _flag(g, "--monitor-interval", type=float, default=0.1, help="seconds between checks of the workers")
    _flag(g, "--start-method", default="spawn", choices=["spawn", "fork", "forkserver"])
    _flag(g, "--log-dir", help="root of run directories (default runs/); the run goes to LOG_DIR/<run id>")
    _flag(g, "--run-dir", help="exact run directory (overrides --log-dir)")
    _flag(g, "--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S,
          help=f"seconds with no progress on any rank (optimizer steps, collectives, ddprun.heartbeat()) before "
               f"every rank's stack is collected and the hang report printed (default "
               f"{DEFAULT_STALL_TIMEOUT_S:.0f}; 0 = off)")
    _flag(g, "--stall-end-after", type=float, default=None,
          help="seconds a reported stall may go on before the job ends (default: as long as --stall-timeout; "
               "0 = end right after the report)")
    g.add_argument("--stop-grace", "--stop_grace", "--shutdown-timeout", "--shutdown_timeout", type=float,
                   default=STOP_GRACE_S, dest="stop_grace",
                   help=f"seconds a stopped agent (SIGTERM, Ctrl-C) gives its workers between SIGTERM and SIGKILL "
                        f"(default {STOP_GRACE_S:.0f}; torchrun's --shutdown-timeout is the same)")
    _flag(g, "--preempt-signals", default=defaults.PREEMPT_SIGNALS,
          help=f"signals that stop every rank at one agreed step, after ddprun.fit's checkpoint there; the node "
               f"exits {EXIT_CODE} (default {defaults.PREEMPT_SIGNALS}; a second signal stops at once; none = off)")
    _flag(g, "--preempt-grace", type=float, default=None,
          help="seconds after a preemption signal before the agent stops the workers that have not stopped "
               "(default: DDPRUN_PREEMPT_GRACE, else the environment's: SageMaker 120, SLURM/Kubernetes/other 30)")
    _flag(g, "--spot-notice", choices=["off", "aws", "gcp"], default="off",
          help="poll the instance metadata for a spot/preemption notice (AWS spot instance-action, GCP "
               "preempted) and stop every rank at one step with fit's checkpoint, as on a signal (default off)")
    _flag(g, "--requeue", action="store_true",
          help="SLURM batch jobs: after a preemption stop, node rank 0 requeues the job (scontrol requeue "
               "$SLURM_JOB_ID) and it resumes from that checkpoint (ddprun slurm-template writes it)")
    _flag(g, "--warm-start", choices=["auto", "on", "off"], default="auto",
          help="on: each local rank's interpreter starts with the agent, imports torch while the agent waits for "
               "its peers, and becomes the first worker; off: workers start after the rendezvous, as torchrun's; "
               "auto (default): on when the machine has a CPU for each worker process it runs (every node's, with a "
               "rendezvous on loopback)")
    _flag(g, "--exit-timeout", type=float, default=EXIT_TIMEOUT_S,
          help=f"seconds a worker's atexit handlers may take after the script returned (default {EXIT_TIMEOUT_S:.0f})")
    _flag(g, "--telemetry-window", type=float, default=TELEMETRY_WINDOW_S,
          help=f"seconds per step-timing window: each rank publishes its medians once per window "
               f"(default {TELEMETRY_WINDOW_S:g})")
    _flag(g, "--straggler-margin", type=float, default=0.2,
          help="name a rank whose data wait / compute / optimizer / step exceeds the other ranks' median by "
               "this fraction and by 5 ms (default 0.2 = 20%%)")
    _flag(g, "--straggler-windows", type=int, default=3,
          help="... for this many consecutive --telemetry-window windows (default 3)")
    g.add_argument("-r", "--redirects", default="0",
                   help="accepted for torchrun compatibility: ddprun always writes logs/rank-N.log")
    g.add_argument("-t", "--tee", default="0",
                   help="local ranks also shown on the console, prefixed [rankN] (3 = all, 0:3,1:0 per rank); "
                        "rank 0 is always shown")
    add_torchrun_flags(p)


TORCHRUN_REFUSED = {
    "--no-python": ("runs the script as a program of its own, but a ddprun worker is a Python process that runs "
                    "the script inside it (its failure records, stall watch and preemption live there)",
                    "give ddprun a Python script that starts the program (subprocess.run([...], check=True)), "
                    "or launch a program that is not Python with torchrun"),
    "--logs-specs": ("replaces torch's LogsSpecs, and ddprun's own (RUN_DIR/logs/rank-N.log) is what its failure "
                     "reports, report and console read", "drop it; --log-dir or --run-dir say where the logs go"),
    "--numa-binding": ("is not honoured: ddprun does not bind workers to CPUs near their GPU",
                       "drop it, or bind each rank to its CPUs in the script (os.sched_setaffinity)"),
    "--event-log-handler": ("is not honoured: ddprun does not send torch's elastic events to a handler",
                            "drop it; RUN_DIR/logs/agent-HOST.log has the agent's events"),
    "--duplicate-stdout-filters": ("is not honoured: ddprun copies no console lines to another file",
                                   "drop it; every rank's output is in RUN_DIR/logs/rank-N.log (grep it there)"),
    "--duplicate-stderr-filters": ("is not honoured: ddprun copies no console lines to another file",
                                   "drop it; every rank's output, stderr included, is in RUN_DIR/logs/rank-N.log "
                                   "(grep it there)"),
    "--signals-to-handle": ("is not honoured: ddprun's agent handles signals its own way",
                            "drop it; --preempt-signals names the signals that stop every rank at one step "
                            f"(default {defaults.PREEMPT_SIGNALS})"),
    "--virtual-local-rank": ("is not honoured: ddprun gives each worker LOCAL_RANK and device cuda:LOCAL_RANK",
                             "drop it; ddprun.init() and ddprun.fit() put each rank on its own GPU"),
}
"""torchrun's flags ddprun cannot honour: flag -> (why, what to do instead). The flags without a value
are FLAGS_WITHOUT_VALUE."""
FLAGS_WITHOUT_VALUE = ("--no-python", "--virtual-local-rank")


def add_torchrun_flags(p: argparse.ArgumentParser) -> None:
    """torchrun's launch flags beyond the common ones: --run-path, --local-ranks-filter and --role
    are honoured; the others are accepted by the parser only to be refused by name (check_torchrun_flags)."""
    g = p.add_argument_group("torchrun's other flags")
    _flag(g, "--run-path", action="store_true",
          help="accepted: ddprun's workers always run the script with runpy.run_path, as torchrun's --run-path")
    _flag(g, "--local-ranks-filter", metavar="RANKS",
          help="local ranks shown on the console, e.g. 0,1 (as torchrun's; replaces --tee's; rank 0 is always shown)")
    g.add_argument("--role", default="trainer", help="the workers' ROLE_NAME (default trainer)")
    for flag in TORCHRUN_REFUSED:
        kw: dict = {"action": "store_true"} if flag in FLAGS_WITHOUT_VALUE else {}
        _flag(g, flag, help=argparse.SUPPRESS, **kw)


def check_torchrun_flags(args: argparse.Namespace) -> None:
    """A torchrun flag ddprun cannot honour, or a combination torchrun itself would not run, is one
    error naming it and what to use instead."""
    for flag, (why, instead) in TORCHRUN_REFUSED.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value not in (None, False):
            raise ConfigError(f"torchrun's {flag} {why}.", seen=flag if value is True else f"{flag} {value}",
                              hint=instead[0].upper() + instead[1:] + ".")
    if getattr(args, "run_path", False) and getattr(args, "module", False):
        raise ConfigError("--run-path runs a script file, -m a module: torchrun would take the module's name for a "
                          "path.", seen=f"--run-path -m {args.script}", hint="Give one: drop --run-path for a module.")


def tee_of_filter(args: argparse.Namespace) -> str:
    """--tee, or the --tee that shows the local ranks of --local-ranks-filter (torchrun's console filter:
    it shows exactly those ranks, teed or not, since ddprun keeps every rank's output in its log)."""
    raw = getattr(args, "local_ranks_filter", None)
    if raw is None:
        return getattr(args, "tee", "0")
    ranks = [r.strip() for r in raw.split(",")]
    if not all(r.isascii() and r.isdecimal() for r in ranks):
        raise ConfigError("--local-ranks-filter takes local ranks separated by commas.",
                          seen=f"--local-ranks-filter {raw!r}", hint="e.g. --local-ranks-filter 0,1 (rank 0 is "
                                                                      "always on the console).")
    return ",".join(f"{int(r)}:3" for r in ranks)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Examples verbatim; every subcommand and its help on one line."""

    def add_argument(self, action):
        super().add_argument(action)
        # argparse measures subcommand names without the indent it prints them with, so the longest
        # (slurm-template) would push its help onto the next line.
        if isinstance(action, argparse._SubParsersAction):
            longest = max((len(a.metavar or a.dest) for a in action._get_subactions()), default=0)
            width = self._current_indent + 2 * self._indent_increment + longest
            self._action_max_length = max(self._action_max_length, width)


def _command(sub, name: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand with its one-line help, a longer description and its examples (kept verbatim)."""
    text = description or HELP[name][0].upper() + HELP[name][1:] + "."
    return sub.add_parser(name, help=HELP[name], description=textwrap.fill(text, 96), epilog=EPILOGS[name],
                          formatter_class=_Formatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddprun", description=DESCRIPTION, epilog=TOP_EPILOG,
                                     formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    run = _command(sub, "run")
    add_topology_flags(run)
    add_worker_flags(run)
    run.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    run.add_argument("script", metavar="SCRIPT", help="training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")

    doctor = _command(sub, "doctor", "Launch like `run` (same flags, on every node) and print each node's "
                                     "preflight facts and the checks over them, training nothing.")
    add_topology_flags(doctor)
    add_worker_flags(doctor)

    plan = _command(sub, "plan", "Print the rank table `ddprun run` with these flags would produce here, and why; "
                                 "starts nothing. Exits 0 also when the rendezvous endpoint is still unknown. Takes "
                                 "a whole `ddprun run` line: --json and --explain go before the script.")
    add_topology_flags(plan)
    plan.add_argument("--json", action="store_true",
                      help="print everything --explain says as one JSON object (schema: docs/plan-json.md)")
    plan.add_argument("--explain", action="store_true", help="print where every number came from")
    add_worker_flags(plan)  # a `run` line with `run` replaced by `plan` is checked as `run` checks it
    plan.add_argument("-m", "--module", action="store_true", help="as for run (the script is not run)")
    plan.add_argument("script", nargs="?", metavar="SCRIPT", help="as for run (the script is not run)")
    plan.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")

    report = _command(sub, "report", "(Re)write RUN_DIR/report.html; --compare OTHER_RUN_DIR overlays another run.")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument("--compare", metavar="OTHER_RUN_DIR")
    report.add_argument("-o", "--output", help="where to write the HTML (default RUN_DIR/report.html)")

    tpl = _command(sub, "slurm-template", "Print a ready-to-submit sbatch script: one `ddprun run` per node, "
                                          "one process per GPU.")
    tpl.add_argument("--nodes", type=int, default=5, help="nodes (default 5)")
    tpl.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node = processes per node (default 4)")
    tpl.add_argument("--cpus-per-task", type=int, default=None,
                     help="CPUs of each node's one task, for all its processes (default 8 per GPU)")
    tpl.add_argument("--time", default="01:00:00", help="time limit (default 01:00:00)")
    tpl.add_argument("--partition", help="partition (default: the cluster's default)")
    tpl.add_argument("--job-name", default="ddprun", help="job name (default ddprun)")
    tpl.add_argument("--preempt-lead", type=int, default=120, metavar="SECONDS",
                     help="SLURM sends every `ddprun run` SIGUSR1 this long before the time limit: every rank "
                          "stops at one step with ddprun.fit's checkpoint (default 120; 0 = no signal, no requeue)")
    tpl.add_argument("--no-requeue", dest="requeue", action="store_false",
                     help="leave out --requeue: the stopped job ends instead of going back in the queue")
    tpl.add_argument("script", nargs="?", default="train.py", metavar="SCRIPT",
                     help="training script (default train.py)")
    tpl.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")

    demo = _command(sub, "demo", "Train a small MLP on handwritten digits with ddprun.fit on simulated nodes on this "
                                 "machine (gloo), and write its report.")
    demo.add_argument("--nnodes", type=int, default=2)
    demo.add_argument("--nproc-per-node", type=int, default=2)
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's own)")
    demo.add_argument("--log-dir", default="runs")
    return parser


RDZV_CONF_INTS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "read_timeout",
                  "timeout", "keep_alive_interval", "keep_alive_max_attempt")
"""torch's rendezvous options read as whole numbers (seconds, or a count): ``int(value)`` or ValueError."""
RDZV_CONF_BOOLS = ("is_host",)
BOOL_WORDS = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")
"""What torch's ``RendezvousParameters.get_as_bool`` accepts (any case)."""


def parse_rdzv_conf(raw: str) -> dict[str, str]:
    """``KEY=VALUE,...``; the options torch reads as numbers or booleans are checked here, where a
    bad value is the user's flag, not a ValueError from inside torch's rendezvous after admission."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError("--rdzv-conf items must be KEY=VALUE.", seen=f"--rdzv-conf {raw!r}",
                              hint="e.g. --rdzv-conf join_timeout=300,read_timeout=60")
        if key in RDZV_CONF_INTS and not (value.isdecimal() and value.isascii() and 0 < int(value) <= MAX_SECONDS):
            raise ConfigError(f"--rdzv-conf {key} takes a whole number from 1 to {MAX_SECONDS:.0f} (torch reads it as "
                              "whole seconds, or a count).",
                              seen=f"--rdzv-conf {raw!r}", hint=f"e.g. --rdzv-conf {key}=300")
        if key in RDZV_CONF_BOOLS and value.lower() not in BOOL_WORDS:
            raise ConfigError(f"--rdzv-conf {key} takes a boolean.", seen=f"--rdzv-conf {raw!r}",
                              hint=f"e.g. --rdzv-conf {key}=true ({', '.join(BOOL_WORDS)})")
        out[key] = value
    check_keep_alive(out, raw)
    return out


def check_keep_alive(conf: dict[str, str], raw: str) -> None:
    """torch's rendezvous drops a node whose keep-alive is older than interval x max_attempt, and a
    healthy node's can be about 2 x interval + 1 s old when a round completes (its join loop beats
    only every interval, its polls are 1 s apart, then its keep-alive thread waits one interval):
    below that, torch drops healthy nodes while their workers train."""
    interval, attempts = defaults.keep_alive(conf)
    if interval * attempts < 2 * interval + 3:
        need = math.ceil((2 * interval + 3) / interval)
        raise ConfigError(
            f"--rdzv-conf keep_alive_interval x keep_alive_max_attempt ({interval} s x {attempts}) is too short: "
            f"a healthy node's keep-alive can be {2 * interval + 1} s old when a round completes, and torch's "
            "rendezvous then drops it while its workers train (another group can form beside them).",
            seen=f"--rdzv-conf {raw!r}",
            hint=f"keep_alive_max_attempt={need} or more with keep_alive_interval={interval} (torch's defaults: "
                 f"{defaults.TORCH_KEEP_ALIVE_INTERVAL_S} x {defaults.TORCH_KEEP_ALIVE_MAX_ATTEMPT}).")


JOIN_KEYS = ("join_timeout", "timeout")
"""The ``--rdzv-conf`` keys torch bounds the join with: c10d's ``join_timeout``, static's ``timeout``."""


def join_timeout(flag: float | None, rdzv_conf: dict[str, str]) -> float:
    """How long the nodes wait for each other (s): ``--rdzv-conf join_timeout=N`` (c10d) or
    ``timeout=N`` (static, ddprun's rendezvous on SLURM, LSF, SageMaker...) is the same setting as
    ``--join-timeout N``, so it also bounds ddprun's own waits and lines; any two that differ: an
    error (``flag`` None: no --join-timeout given)."""
    # name -> (seconds, as given); in rdzv_conf whole numbers > 0 (parse_rdzv_conf)
    given = {f"--rdzv-conf {k}": (float(rdzv_conf[k]), f"--rdzv-conf {k}={rdzv_conf[k]}")
             for k in JOIN_KEYS if k in rdzv_conf}
    if flag is not None:
        given = {"--join-timeout": (flag, f"--join-timeout {flag:g}"), **given}
    if len({seconds for seconds, _ in given.values()}) > 1:
        raise ConfigError(f"{' and '.join(given)} disagree.", seen=", ".join(shown for _, shown in given.values()),
                          hint="Give one of them (they are the same setting: how long the nodes wait for each other).")
    return next((seconds for seconds, _ in given.values()), DEFAULT_JOIN_TIMEOUT_S)


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Pure: parsed flags -> LaunchConfig."""
    entry = None
    if getattr(args, "script", None):
        entry = Entry(target=args.script, args=tuple(args.script_args), is_module=args.module)
    doctor = args.command == "doctor"
    if doctor:
        entry = Entry(target="ddprun.worker.doctor_job", is_module=True)
    check_torchrun_flags(args)
    check_not_empty(args)
    check_numbers(args)
    check_standalone(args)
    check_rdzv_id(args)
    stall = getattr(args, "stall_timeout", DEFAULT_STALL_TIMEOUT_S)
    margin, windows = getattr(args, "straggler_margin", 0.2), getattr(args, "straggler_windows", 3)
    rdzv_conf = parse_rdzv_conf(args.rdzv_conf)
    return LaunchConfig(
        entry=entry, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, rdzv_conf=rdzv_conf,
        standalone=args.standalone, local_addr=args.local_addr, join_timeout=join_timeout(args.join_timeout, rdzv_conf),
        max_restarts=getattr(args, "max_restarts", None), monitor_interval=getattr(args, "monitor_interval", 0.1),
        start_method=getattr(args, "start_method", "spawn"), log_dir=getattr(args, "log_dir", None),
        run_dir=getattr(args, "run_dir", None), redirects=getattr(args, "redirects", "0"),
        tee=tee_of_filter(args), hostfile=args.hostfile, stall_timeout=stall, doctor=doctor,
        straggler_margin=margin, straggler_windows=windows, stall_end=getattr(args, "stall_end_after", None),
        exit_timeout=getattr(args, "exit_timeout", EXIT_TIMEOUT_S), allow_uneven_nodes=args.allow_uneven_nodes,
        telemetry_window=getattr(args, "telemetry_window", TELEMETRY_WINDOW_S),
        stop_grace=getattr(args, "stop_grace", STOP_GRACE_S),
        preempt_signals=getattr(args, "preempt_signals", defaults.PREEMPT_SIGNALS),
        preempt_grace=getattr(args, "preempt_grace", None), requeue=getattr(args, "requeue", False),
        spot_notice=getattr(args, "spot_notice", "off"), warm_start=getattr(args, "warm_start", "auto"),
        role=getattr(args, "role", "trainer"),
    )


def _seconds(flag: str, value: float | None, *, zero_ok: bool, example: str) -> None:
    if value is None:
        return
    # MAX_SECONDS: past it timedelta (the store's timeout) or a timer (the exit guard's) overflows
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok) or value > MAX_SECONDS:
        raise ConfigError(f"{flag} takes a finite number of seconds {'>= 0' if zero_ok else '> 0'}, at most "
                          f"{MAX_SECONDS:.0f} (about {MAX_SECONDS / 86400:.0f} days).",
                          seen=f"{flag} {value}", hint=f"e.g. {flag} {example}" + (" (0 = off)" if zero_ok else ""))


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric or per-rank flag checked once, with the flag and the value in the message."""
    from ddprun.agent.run import parse_local_ranks

    _seconds("--join-timeout", args.join_timeout, zero_ok=False, example="120")
    # torch's rendezvous takes whole seconds: int(0.5) would be 0, refused inside it
    if args.join_timeout is not None and args.join_timeout < 1:
        raise ConfigError("--join-timeout takes at least 1 second.", seen=f"--join-timeout {args.join_timeout}",
                          hint="e.g. --join-timeout 120 (how long the nodes wait for each other)")
    for flag, zero_ok, example in (("--stall-timeout", True, "300"), ("--stall-end-after", True, "300"),
                                   ("--exit-timeout", False, "60"), ("--monitor-interval", False, "0.1"),
                                   ("--telemetry-window", False, "2"), ("--stop-grace", True, "30"),
                                   ("--preempt-grace", False, "120")):
        _seconds(flag, getattr(args, flag[2:].replace("-", "_"), None), zero_ok=zero_ok, example=example)
    if (getattr(args, "max_restarts", None) or 0) < 0:
        raise ConfigError("--max-restarts takes a number of restarts >= 0.", seen=f"--max-restarts {args.max_restarts}",
                          hint="0 (default): a failure ends the job; N: the worker group is restarted up to N times.")
    margin, windows = getattr(args, "straggler_margin", 0.2), getattr(args, "straggler_windows", 3)
    if not (math.isfinite(margin) and margin > 0) or windows < 1:
        raise ConfigError("--straggler-margin must be > 0 and --straggler-windows >= 1.",
                          seen=f"--straggler-margin {margin}, --straggler-windows {windows}",
                          hint="e.g. --straggler-margin 0.2 --straggler-windows 3.")
    parse_signals(getattr(args, "preempt_signals", defaults.PREEMPT_SIGNALS))
    for flag in ("--tee", "--redirects"):
        value = getattr(args, flag[2:], None)
        if value is not None:
            parse_local_ranks(value, 1, flag)
    if getattr(args, "master_port", None) is not None and not 0 <= args.master_port <= 65535:
        raise ConfigError("--master-port takes a TCP port 1-65535 (0: a free one, single node only).",
                          seen=f"--master-port {args.master_port}", hint="e.g. --master-port 29500.")


NOT_EMPTY = {"--run-dir": "<log dir>/<run id>", "--log-dir": "runs/",
             "--hostfile": "the environment's own topology"}
"""Flags whose empty value (an unset shell variable) would silently mean the default, what that is."""


def check_not_empty(args: argparse.Namespace) -> None:
    """An empty --run-dir, --log-dir or --hostfile is refused: taken as not given, a requeued launch
    would get a new run directory (and train from step 0) or another topology."""
    for flag, default in NOT_EMPTY.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} is empty.", seen=f"{flag} {value!r}",
                              hint=f"Is the shell variable it came from unset? Give {flag} a path, or leave the flag "
                                   f"out for {default}.")


STANDALONE_CONFLICTS = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                        "hostfile")
"""Flags that say where the job's nodes meet: --standalone says it itself (one node, loopback, a free port)."""


def check_rdzv_id(args: argparse.Namespace) -> None:
    """--rdzv-id names the run directory: one directory name, never a path."""
    run_id = getattr(args, "rdzv_id", None)
    problem = run_id_problem(run_id) if run_id is not None else None
    if problem:
        raise ConfigError(f"--rdzv-id names the run directory (runs/<run id>), but {problem}.",
                          seen=f"--rdzv-id {run_id!r}",
                          hint="Give a plain name, e.g. --rdzv-id job42; --run-dir DIR puts the run directory "
                               "anywhere.")


def check_standalone(args: argparse.Namespace) -> None:
    """--standalone with a flag that places the job elsewhere is a usage error, not one silently winning."""
    if not getattr(args, "standalone", False):
        return
    given = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in STANDALONE_CONFLICTS
             if getattr(args, name, None) not in (None, False)]
    if args.nnodes in ("1", "1:1"):  # says the same as --standalone
        given = [g for g in given if not g.startswith("--nnodes ")]
    if given:
        raise ConfigError("--standalone (one node, rendezvous on 127.0.0.1 and a free port) contradicts "
                          f"{', '.join(g.split()[0] for g in given)}.", seen=f"--standalone {' '.join(given)}",
                          hint="Drop --standalone for a multi-node job, or drop the other flags for one node.")


def _plan_network(spec, cfg: LaunchConfig, environ: Mapping[str, str]):
    """(NetworkPlan or None, the error ``ddprun run`` would stop with or None). Probes this node's
    network and may resolve names, so only for --explain/--json, and never for an unresolved host."""
    from ddprun.cluster.netaddr import network_plan

    if spec.master_addr is None:
        return None, None
    try:
        return network_plan(spec, environ, cfg.local_addr, cfg.rdzv_conf), None
    except DdprunError as e:  # `plan` may run on a login node: say it, `run` would fail with it
        return None, " ".join(str(e).splitlines())


def cmd_plan(cfg: LaunchConfig, args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """A dry run: exit 0 whenever the flags and the environment parse, even with the endpoint unresolved."""
    from ddprun.cluster.detect import explain, resolve
    from ddprun.cluster.plan import make_plan
    from ddprun.plan_json import plan_document, unresolved_reason
    from ddprun.ranktable import render_plan

    spec = resolve(cfg, environ, probe_node(environ), launcher=True, dry_run=True)
    check_shared_port(spec)  # what `run` refuses (the host's name lookup is left to --explain: a login node)
    plan = make_plan(spec.max_nodes, spec.nproc_per_node, spec.device)
    net, net_error = _plan_network(spec, cfg, environ) if (args.explain or args.json) else (None, None)
    if args.json:
        print(json.dumps(plan_document(spec, plan, net, net_error), indent=2))
        return 0
    title = (f"ddprun plan: {spec.max_nodes} node(s) x {spec.nproc_per_node} = {plan.world_size} processes "
             f"({spec.environment})")
    print(render_plan(plan, title), end="")
    reason = unresolved_reason(spec)
    print(f"rendezvous: unresolved ({reason})" if reason else
          f"rendezvous: {spec.rdzv_endpoint if spec.master_port else f'{spec.master_addr}, a free port'} "
          f"({spec.rdzv_backend}), run id {spec.run_id or '(generated at launch)'}")
    if spec.node_rank is None and spec.max_nodes > 1:
        print("Node ranks follow rendezvous arrival order (c10d); the run prints the table it got.")
    if args.explain:
        net_lines = net.explain() if net else []
        if net_error:
            net_lines.append(f"network: `ddprun run` on this node would fail: {net_error}")
        print("\n".join(explain(spec) + net_lines))
    return 0


def cmd_run(cfg: LaunchConfig, environ: Mapping[str, str]) -> int:
    from ddprun.agent.run import check_run_root, early_standbys
    from ddprun.cluster.torchrun import TorchrunEnvironment
    from ddprun.errors import ClusterError
    from ddprun.openfiles import raise_soft_limit

    if TorchrunEnvironment.detect(environ):
        raise ClusterError(
            "`ddprun run` was started inside a torchrun/ddprun worker: it would launch workers inside a worker.",
            seen=f"RANK={environ.get('RANK')}, LOCAL_RANK={environ.get('LOCAL_RANK')}, "
                 f"WORLD_SIZE={environ.get('WORLD_SIZE')}",
            hint="Run the script directly here (ddprun.init()/ddprun.fit() use this environment), "
                 "or unset RANK/LOCAL_RANK/WORLD_SIZE.",
        )
    if cfg.requeue:
        from ddprun.cluster.slurm import requeue_command

        requeue_command(environ)  # no SLURM job or no scontrol: said now, not after the preemption
    check_run_root(cfg)
    raise_soft_limit()  # before any worker starts: every process of the job inherits it
    standby = early_standbys(cfg, environ)  # first: their imports overlap this agent's
    try:
        return _launch(cfg, environ, standby)
    finally:
        if standby is not None:
            standby.close()


def with_cluster_restarts(cfg: LaunchConfig, spec) -> LaunchConfig:
    """``cfg`` with its restarts decided: --max-restarts, else the cluster's (PET_MAX_RESTARTS, read
    by cluster/kubernetes.py as torchrun reads it), else 0."""
    if cfg.max_restarts is not None:
        return cfg
    return dataclasses.replace(cfg, max_restarts=int(spec.extra.get("max_restarts", 0)))


def _launch(cfg: LaunchConfig, environ: Mapping[str, str], standby) -> int:
    from ddprun.agent.run import launch
    from ddprun.cluster.detect import resolve

    node = probe_node(environ)
    spec = resolve(cfg, environ, node, launcher=True)
    check_endpoint(spec)
    cfg = with_cluster_restarts(cfg, spec)
    for note in spec.notes:
        print(f"ddprun: note: {note}", file=sys.stderr)
    return launch(cfg, spec, environ, node.hostname, standby=standby).exit_code


def cmd_report(args: argparse.Namespace) -> int:
    from ddprun.report import RUN_FILES, write_report

    for d in filter(None, (args.run_dir, args.compare)):
        why = ("no such directory" if not os.path.exists(d) else "not a directory" if not os.path.isdir(d) else
               None if any(os.path.exists(os.path.join(d, f)) for f in RUN_FILES) else
               f"it holds none of {', '.join(RUN_FILES)}")
        if why:
            logs = os.path.join(d, "logs")
            hint = (f"A run's report files are written on the node of rank 0: run ddprun report there. A run "
                    f"that ended before its plan has none: the console and {logs}/ (rank-N.log, agent-HOST.log) "
                    "say why." if os.path.isdir(logs) else "Give runs/<run id> (it holds plan.json, metrics.csv).")
            raise ConfigError("Not a run directory.", seen=f"{d} ({why})", hint=hint)
    print(write_report(args.run_dir, compare=args.compare, out=args.output))
    return 0


def _exit_now(code: int) -> int:
    """End the agent process with ``code`` without interpreter teardown, as the workers do: the store
    clients' C++ threads can abort it there ("terminate called without an active exception") after
    the job's outcome is known and said. Streams are flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    environ = dict(os.environ)
    try:
        if args.command == "demo":
            from ddprun.demo import run_demo

            return run_demo(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, steps=args.steps,
                            log_dir=args.log_dir)
        if args.command == "slurm-template":
            from ddprun.cluster.slurm import sbatch_script

            print(sbatch_script(args.script, args.script_args, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                cpus_per_task=args.cpus_per_task, time=args.time, partition=args.partition,
                                job_name=args.job_name, preempt_lead=args.preempt_lead,
                                requeue=args.requeue), end="")
            return 0
        if args.command == "report":
            return cmd_report(args)
        cfg = config_from_args(args)
        if args.command == "plan":
            return cmd_plan(cfg, args, environ)
        from ddprun.agent.console_stream import guard_standard_streams

        guard_standard_streams()  # a console that goes away (a closed pipe, a dropped ssh) does not end the job
        try:
            return _exit_now(cmd_run(cfg, environ))
        except KeyboardInterrupt:  # after the agent ended (the report, the summary): nothing to stop
            print("ddprun: interrupted.", file=sys.stderr)
            return _exit_now(130)
    except DdprunError as e:
        print(f"ddprun: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
