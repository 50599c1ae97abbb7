"""``ddprun run``: turn a resolved ClusterSpec into one torch elastic agent on this node.

torch does the rendezvous, the worker processes and their supervision
(``torch.distributed.launcher.api.launch_agent``); this module decides what to launch, where the
output goes, and what the console says when it ends.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import types
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TextIO

from ddprun._util import cpu_count
from ddprun.cluster.base import ClusterSpec
from ddprun.config import DEFAULT_RUNS_ROOT, LaunchConfig
from ddprun.errors import LaunchError
from ddprun.exit import STOPPED_MARK



def job_token(environ: Mapping[str, str], spec: ClusterSpec) -> str:
    """The job's secret: DDPRUN_JOB_TOKEN if set (every node must agree); else one derived from the
    scheduler's job id where there is one; else, single-node, a random one; else empty (then jobs
    are told apart by run id only)."""
    if environ.get("DDPRUN_JOB_TOKEN"):
        return environ["DDPRUN_JOB_TOKEN"]
    for key in ("SLURM_JOB_ID", "TRAINING_JOB_NAME", "PBS_JOBID", "LSB_JOBID"):
        if environ.get(key):
            return f"{key}={environ[key]}"
    return uuid.uuid4().hex if spec.max_nodes == 1 else ""


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def run_dir_for(cfg: LaunchConfig, run_id: str) -> str:
    if cfg.run_dir:
        return os.path.abspath(cfg.run_dir)
    return os.path.abspath(os.path.join(cfg.log_dir or DEFAULT_RUNS_ROOT, run_id))


def omp_threads(environ: Mapping[str, str], nproc_per_node: int, cpus: int) -> str | None:
    """OMP_NUM_THREADS for workers: None when the user set it, else cores ÷ processes (≥ 1)."""
    if "OMP_NUM_THREADS" in environ:
        return None
    return str(max(1, cpus // nproc_per_node))


def parse_local_ranks(spec: str, nproc: int) -> set[int]:
    """torchrun's --tee/--redirects value: ``3`` (all), ``0`` (none), or ``0:3,1:0`` per local rank."""
    if ":" not in spec:
        return set(range(nproc)) if spec.strip() not in ("0", "") else set()
    out = set()
    for part in spec.split(","):
        lr, _, val = part.partition(":")
        if val.strip() not in ("0", ""):
            out.add(int(lr))
    return out


@dataclass
class Outcome:
    exit_code: int
    run_dir: str
    wall_s: float
    failures: Mapping[int, object] = field(default_factory=dict)
    """This node's failed workers by global rank (torch's ProcessFailure or a RecordedFailure)."""


def summarize_failures(failures: Mapping[int, object], run_dir: str, host: str) -> str:
    """The console's account of a failed job on this node: root causes with their log tails
    first, then the ranks that were only stopped because of them (one line)."""
    from ddprun.logs import early_log_path, rank_log_path, tail_lines

    roots, stopped, cause = [], [], ""
    for rank, f in sorted(failures.items()):
        msg = getattr(f, "message", "") or ""
        if isinstance(msg, dict):  # torch keeps the error file's JSON object when it has extraInfo
            msg = str(msg.get("message", ""))
        if msg.startswith("To enable traceback") or (msg.startswith("Signal ") and "received by PID" in msg):
            msg = ""  # torch's text when the worker wrote no error file: nothing of its own to say
        if msg.startswith(STOPPED_MARK):
            stopped.append(rank)
            cause = cause or msg[len("ddprun: "):]
        elif f.exitcode == -15 and not msg:  # SIGTERM from the agent after a local rank failed
            stopped.append(rank)
        else:
            roots.append((rank, f, msg))
    # Ranks that failed alike (same exit, same message: e.g. every rank refusing one bad Trainer
    # setting) are one line; the log tail of the first only, none with rank 0 (followed on the console).
    groups: dict[tuple, list] = {}
    for rank, f, msg in roots:
        how = f"was killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"
        if f.exitcode == -15 and msg:  # it had reported its error; the agent's SIGTERM came while it waited
            how = "failed"
        groups.setdefault((how, msg) if msg else (how, rank), []).append((rank, f, how, msg))
    lines = []
    for members in groups.values():
        rank, _, how, msg = members[0]
        pl = "s" if len(members) > 1 else ""
        ranks, local = ", ".join(str(m[0]) for m in members), ", ".join(str(m[1].local_rank) for m in members)
        lines.append(f"ddprun: rank{pl} {ranks} (local rank{pl} {local} on {host}) {how}" + (f": {msg}" if msg else ""))
        if any(m[0] == 0 for m in members):
            continue
        for log in (early_log_path(run_dir, rank), rank_log_path(run_dir, rank)):
            tail = tail_lines(log, 8)
            if tail and tail[-1].strip() != f"ddprun: {msg}":  # a log ending in its one-line error adds nothing
                lines.append(f"  last lines of {os.path.relpath(log)}:")
                lines.extend(f"    [rank{rank}] {line}" for line in tail)
    if stopped:
        ranks = ", ".join(str(r) for r in stopped)
        if cause:
            lines.append(f"ddprun: rank(s) {ranks} on {host} were {cause}")
        else:
            lines.append(f"ddprun: rank(s) {ranks} on {host} were stopped because of the failure above.")
    lines.append("ddprun: the job failed.")
    return "\n".join(lines)


@dataclass
class RecordedFailure:
    """A worker failure read back from its error file (when torch's agent could not report it)."""

    local_rank: int
    message: str
    exitcode: int = 1

    def signal_name(self) -> str:
        return ""


def recorded_failures(local_workers: Mapping[int, tuple[int, str]]) -> dict[int, RecordedFailure]:
    """This node's workers that wrote an error file, by global rank."""
    import json

    out = {}
    for rank, (local_rank, path) in local_workers.items():
        try:
            with open(path) as fp:
                data = json.load(fp)
        except (OSError, ValueError):
            continue
        msg = data.get("message", "")
        out[rank] = RecordedFailure(local_rank, str(msg.get("message", "") if isinstance(msg, dict) else msg))
    return out


def write_run_report(run_dir: str, console: TextIO) -> None:
    """report.html for the run (on the node that ran rank 0); a missing matplotlib is one note."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print("ddprun: no run report: matplotlib is not installed (pip install 'ddprun[report]')", file=console)
        return
    from ddprun.report import write_report

    try:
        path = write_report(run_dir)
    except Exception as e:  # noqa: BLE001 - a report must never turn a finished run into a failure
        print(f"ddprun: the run report could not be written: {type(e).__name__}: {e}", file=console)
        return
    print(f"ddprun: report: {os.path.relpath(path)}", file=console, flush=True)


def _claim_endpoint(host: str, port: int, run_id: str, token: str) -> str | None:
    """If a store already answers at the endpoint, claim it for this job; the refusal text if it
    belongs to another job. Nothing listening (this node will host it) costs one refused connect."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ddprun.guard import claim, port_open, refusal

    if not port_open(host, port):
        return None
    try:
        store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
        other = claim(store, run_id, token)
    except Exception:  # noqa: BLE001 - not a store, or it went away: torch's rendezvous will say
        return None
    return refusal(f"{host}:{port}", other, run_id) if other else None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: LaunchConfig, spec: ClusterSpec, environ: Mapping[str, str], hostname: str,
           console: TextIO | None = None) -> Outcome:
    """Run this node's agent until the job ends; return the exit code for this node."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig
    from torch.distributed.launcher.api import launch_agent

    from ddprun.joinwatch import JoinWatcher
    from ddprun.logs import LogFollower, RankLogsSpecs, remove_empty_early_logs, route_torch_logging

    if cfg.entry is None:
        raise LaunchError("Nothing to run.", hint="Give a script: ddprun run train.py, or a module: ddprun run -m pkg.train")
    # --- network (netaddr.py): is_host, the address other nodes reach, the gloo/NCCL interface ------
    # Before stderr goes to the agent log, so that a ClusterError reaches the console. Single node and
    # loopback rendezvous: nothing changes. The user's --rdzv-conf goes over ours.
    from dataclasses import replace

    from ddprun.netaddr import network_plan

    net = network_plan(spec, environ, cfg.local_addr, cfg.rdzv_conf)
    cfg = replace(cfg, local_addr=net.local_addr, rdzv_conf={**net.rdzv_conf, **cfg.rdzv_conf})
    if net.summary():
        print(net.summary(), file=console or sys.stdout, flush=True)
    # --- end network; net.worker_env is added to worker_env below ---------------------------------
    t0 = time.monotonic()
    run_id = spec.run_id or new_run_id()
    run_dir = run_dir_for(cfg, run_id)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)

    console = console or sys.stdout
    # C++ warnings (TCPStore, gloo) go straight to fd 2; keep them in the agent log, off the console.
    agent_log = os.path.join(run_dir, "logs", f"agent-{hostname}.log")
    handler = route_torch_logging(agent_log)
    saved_stderr = os.dup(2)
    log_fd = os.open(agent_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    err_console = os.fdopen(os.dup(saved_stderr), "w", buffering=1)

    master_port = spec.master_port
    if master_port == 0:
        master_port = _free_port(spec.master_addr)
    endpoint = f"{spec.master_addr}:{master_port}"

    token = job_token(environ, spec)
    worker_env = {
        "DDPRUN_RUN_DIR": run_dir,
        "DDPRUN_DEVICE_KIND": spec.device,
        "DDPRUN_JOIN_TIMEOUT": str(cfg.join_timeout),
        "DDPRUN_STALL_TIMEOUT": str(cfg.stall_timeout),
        "DDPRUN_NNODES": f"{spec.min_nodes}:{spec.max_nodes}",
        "DDPRUN_JOB_TOKEN": token,
        "DDPRUN_STRAGGLER_MARGIN": str(cfg.straggler_margin),
        "DDPRUN_STRAGGLER_WINDOWS": str(cfg.straggler_windows),
        **net.worker_env,
    }
    if cfg.doctor:
        worker_env["DDPRUN_DOCTOR"] = "1"
    if cfg.allow_uneven_nodes:
        worker_env["DDPRUN_ALLOW_UNEVEN_NODES"] = "1"
    threads = omp_threads(environ, spec.nproc_per_node, cpu_count())
    if threads is not None:
        worker_env["OMP_NUM_THREADS"] = threads

    follower = LogFollower(console)
    watcher = None
    if spec.rdzv_backend == "c10d" and spec.max_nodes > 1:
        watcher = JoinWatcher(spec.master_addr, master_port, run_id, token, spec.max_nodes, cfg.join_timeout,
                              err_console)
    from ddprun.attempt import AttemptIds  # one attempt id per worker-group start, the same on every node

    attempts = AttemptIds(spec.rdzv_backend, spec.master_addr, master_port, run_id)
    logs_specs = RankLogsSpecs(run_dir, follower, parse_local_ranks(cfg.tee, spec.nproc_per_node), worker_env,
                               on_workers_start=watcher.stop if watcher else None, attempt_id=attempts.current)
    rdzv_configs: dict = dict(cfg.rdzv_conf)
    rdzv_configs.setdefault("timeout", int(cfg.join_timeout))
    rdzv_configs.setdefault("join_timeout", int(cfg.join_timeout))
    if spec.rdzv_backend == "static":
        rdzv_configs["rank"] = spec.node_rank
    torch_cfg = TorchLaunchConfig(
        min_nodes=spec.min_nodes, max_nodes=spec.max_nodes, nproc_per_node=spec.nproc_per_node,
        logs_specs=logs_specs, run_id=run_id, role="trainer", rdzv_endpoint=endpoint,
        rdzv_backend=spec.rdzv_backend, rdzv_configs=rdzv_configs, max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval, start_method=cfg.start_method, local_addr=cfg.local_addr,
    )
    nodes = str(spec.max_nodes) if not spec.elastic else f"{spec.min_nodes}-{spec.max_nodes}"
    print(f"ddprun: run {run_id}: {nodes} node(s) x {spec.nproc_per_node} process(es) on {spec.device}, "
          f"{spec.rdzv_backend} rendezvous at {endpoint}; logs in {os.path.relpath(run_dir)}/logs", file=console,
          flush=True)

    refused = _claim_endpoint(spec.master_addr, master_port, run_id, token)
    if refused:
        follower.stop()
        print(refused, file=err_console, flush=True)
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
        err_console.close()
        return Outcome(exit_code=1, run_dir=run_dir, wall_s=time.monotonic() - t0)
    code = 0
    failures: Mapping[int, object] = {}
    if watcher is not None:
        watcher.start()
    try:
        launch_agent(torch_cfg, sys.executable, ["-m", "ddprun.worker", *cfg.entry.argv()])
    except ChildFailedError as e:
        follower.stop()
        failures = e.failures
        print(summarize_failures(e.failures, run_dir, hostname), file=err_console, flush=True)
        code = 1
    except RendezvousTimeoutError:
        follower.stop()
        seen = watcher.timeout_message() if watcher else "the rendezvous did not complete"
        print(f"ddprun: not every node joined within {cfg.join_timeout:.0f} s: {seen}.\n"
              f"HINT: start ddprun on every node with the same --rdzv-endpoint {endpoint} and --rdzv-id {run_id}; "
              f"check the missing nodes' own output; raise --join-timeout if nodes start late.",
              file=err_console, flush=True)
        code = 1
    except RendezvousError as e:
        follower.stop()
        recorded = failures = recorded_failures(logs_specs.local_workers)
        if recorded:  # this node's workers failed, and the node hosting the store ended first
            print(summarize_failures(recorded, run_dir, hostname), file=err_console, flush=True)
        else:
            print(f"ddprun: rendezvous at {endpoint} failed: {type(e).__name__}: {e}\n"
              f"HINT: check that every node runs ddprun with the same --rdzv-endpoint and --rdzv-id, that "
                  f"{spec.master_addr} is reachable from every node, and see {agent_log}", file=err_console,
                  flush=True)
        code = 1
    except KeyboardInterrupt:
        follower.stop()
        print("ddprun: interrupted; workers stopped.", file=err_console, flush=True)
        code = 130
    except Exception as e:  # noqa: BLE001 - torch's agent raises many kinds; each must end with a message
        follower.stop()
        name = type(e).__name__
        if name == "SignalException" and watcher is not None and watcher.refused:
            code = 1  # the refusal is printed already
        elif name == "SignalException":
            print(f"ddprun: stopped by {e}; workers stopped.", file=err_console, flush=True)
            code = 128 + int(getattr(e, "sigval", 15))
        else:
            print(f"ddprun: the launcher failed: {name}: {e}\nSee {agent_log}", file=err_console, flush=True)
            code = 1
    else:
        follower.stop()
    finally:
        if watcher is not None:
            watcher.stop()
        handler.flush()
        remove_empty_early_logs(run_dir)
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
    if logs_specs.has_rank0:
        write_run_report(run_dir, console)
    wall = time.monotonic() - t0
    if code == 0:
        print(f"ddprun: run {run_id} finished on this node in {wall:.1f} s", file=console, flush=True)
    err_console.close()
    return Outcome(exit_code=code, run_dir=run_dir, wall_s=wall, failures=failures)


class _CallableModule(types.ModuleType):
    """``ddprun.launch(fn, ...)`` (:func:`ddprun.fnlaunch.launch`) has this module's name: importing
    the module sets the package attribute ``ddprun.launch`` to it, so the module itself is callable."""

    def __call__(self, fn, /, *args, **kwargs):
        from ddprun.fnlaunch import launch as launch_fn

        return launch_fn(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
