"""``ddprun run``: turn a resolved ClusterSpec into one torch elastic agent on this node.

torch does the rendezvous, the worker processes and their supervision (agent/torch_agent.py, torch's
LocalElasticAgent); this module decides what to launch and where its output goes, and says on the
console how it ended. The steps of :func:`launch`: the network plan, the run (a proposed id,
directory, token, worker environment), the standbys, admission (the endpoint claim and the agreed
run id, agent/admission.py), the node store (agent/noderelay.py), torch's logging and C++ stderr
into the agent log (:class:`AgentLog`), the agent with ddprun's failure hooks (agent/failures.py),
and one line or summary per way it can end (:func:`ending`).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from ddprun.agent import admission
from ddprun.agent import console as agent_console
from ddprun.agent.endpoint import free_port
from ddprun.agent.failures import AgentFailures
from ddprun.agent.spot import settings as spot_settings
from ddprun.agent.standby import WORKER_MODULE
from ddprun.cluster.base import ClusterSpec
from ddprun.cluster.detect import master_host, parse_endpoint, parse_nnodes
from ddprun.cluster.netaddr import is_loopback
from ddprun.cluster.slurm import requeue_command
from ddprun.config import LaunchConfig
from ddprun.cpus import cpu_count
from ddprun.errors import ConfigError, LaunchError
from ddprun.protocol import defaults
from ddprun.protocol import failure as fr
from ddprun.protocol import preempt as pp
from ddprun.protocol.env import FR_DUMP_FILE, JOB_TOKEN, WorkerEnv, flight_recorder_env
from ddprun.protocol.rundir import RunDir, new_run_id
from ddprun.protocol.store import JobRecord


def job_token(environ: Mapping[str, str], spec: ClusterSpec) -> str:
    """The job's token: DDPRUN_JOB_TOKEN if set (every node must agree); else one derived from the
    scheduler's job id where there is one; else, single-node, a random one; else empty (then jobs
    are told apart by run id only)."""
    if environ.get(JOB_TOKEN):  # set by the user on every node
        return environ[JOB_TOKEN]
    for key in ("SLURM_JOB_ID", "TRAINING_JOB_NAME", "PBS_JOBID", "LSB_JOBID"):
        if environ.get(key):
            return f"{key}={environ[key]}"
    return uuid.uuid4().hex if spec.max_nodes == 1 else ""


def run_dir_for(cfg: LaunchConfig, run_id: str) -> str:
    if cfg.run_dir:
        return os.path.abspath(cfg.run_dir)
    return os.path.abspath(os.path.join(cfg.log_dir or defaults.RUNS_ROOT, run_id))


def check_run_root(cfg: LaunchConfig) -> None:
    """The run directory can be made: the nearest existing directory on its way is a directory this
    user may write (nothing is created here). A bad ``--log-dir``/``--run-dir`` is the user's flag,
    said before this node joins the job."""
    flag, given = ("--run-dir", cfg.run_dir) if cfg.run_dir else ("--log-dir", cfg.log_dir or defaults.RUNS_ROOT)
    root = os.path.abspath(given)  # the run directory itself for --run-dir: it may exist, made for the user
    there = root
    while not os.path.lexists(there):  # where os.makedirs would start
        there = os.path.dirname(there)
    why = ""
    if not os.path.isdir(there):
        why = f"{there} is not a directory"
    elif not os.access(there, os.W_OK | os.X_OK):
        why = f"{there} is not writable by this user"
    if why:
        raise ConfigError(f"The run directory cannot be made under {root}.", seen=f"{flag} {given}: {why}",
                          hint=f"Give {flag} a writable directory on this node (the run's logs, failure records "
                               f"and checkpoints go there), e.g. {flag} $HOME/runs.")


def omp_threads(environ: Mapping[str, str], nproc_per_node: int, cpus: int) -> str | None:
    """OMP_NUM_THREADS for workers: None when the user set it, else cores ÷ processes (≥ 1)."""
    if "OMP_NUM_THREADS" in environ:
        return None
    return str(max(1, cpus // nproc_per_node))


def parse_local_ranks(spec: str, nproc: int, flag: str = "--tee") -> set[int]:
    """torchrun's --tee/--redirects value: ``3`` (all), ``0`` (none), or ``0:3,1:0`` per local rank.

    Raises ConfigError naming ``flag`` for anything else."""
    bad = ConfigError(f"{flag} takes 0-3 (for every local rank) or LOCAL_RANK:0-3,...", seen=f"{flag} {spec!r}",
                      hint=f"e.g. {flag} 3 (all ranks) or {flag} 0:3,1:0; rank 0 is always on the console.")
    items = [p.strip() for p in spec.split(",")] if ":" in spec else [spec.strip()]
    out = set()
    for part in items:
        lr, sep, val = part.rpartition(":") if ":" in part else ("", "", part)
        if val not in ("0", "1", "2", "3") or (sep and not lr.isdigit()):
            raise bad
        if val != "0":
            out.update({int(lr)} if sep else set(range(nproc)))
    return out


@dataclass
class Outcome:
    exit_code: int
    run_dir: str
    wall_s: float
    records: Mapping[int, fr.FailureRecord] = field(default_factory=dict)
    """This node's failed workers by global rank."""
    cause: fr.FailureRecord | None = None
    """The job's root cause as this node knows it (None: no failure)."""


@dataclass
class _Run:
    """One launch on this node, as prepared before the agent starts."""

    cfg: LaunchConfig
    spec: ClusterSpec
    run_id: str
    rundir: RunDir
    host: str
    addr: str
    """The rendezvous host (resolved: ``ddprun run`` never starts with it unknown)."""
    port: int
    token: str
    wenv: WorkerEnv
    extra_env: dict[str, str]
    shared_store_off: bool = False
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the workers cannot reach the agents' store."""
    rdzv_id: str = ""
    """torch's rendezvous run id (the key of the rendezvous and of ddprun's store keys): the run id
    when one was given, else the same default on every node."""
    explicit_id: bool = True
    endpoint_store: Any = None
    """The admission's store client (agent/admission.py EndpointClient), kept for the launch (on the host:
    the server), each call bounded by STORE_CALL_S."""
    dial: str = ""
    """The address this node's store clients use for the endpoint (the host: its bind address);
    ``addr`` unless admit_run says otherwise."""
    bind: str | None = None
    """Where the endpoint's store listens if this node hosts it (agent/endpoint.py store_bind)."""
    standby: Any = None
    """This node's started agent/standby.py StandbyPool (the first attempt's workers), or None."""
    hosted: bool = False
    """This agent hosts the endpoint's store (it must outlive the job's other agents)."""
    grace: tuple[float, str] = (defaults.PREEMPT_GRACE_S, "default")
    """Seconds after a preemption request before the workers are stopped, and where that came from."""
    spot: tuple[str, float] | None = None
    """``--spot-notice``: the metadata server's base URL and the poll seconds (agent/spot.py settings)."""
    requeue: tuple[str, ...] = ()
    """``--requeue``: the command that requeues the SLURM job after a preemption stop (cluster/slurm.py)."""

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    @property
    def newcomer(self) -> admission.Newcomer:
        """This node's identity at the endpoint (agent/admission.py)."""
        return admission.Newcomer(self.endpoint, self.rdzv_id, self.token, self.explicit_id, self.run_id,
                                  (self.spec.min_nodes, self.spec.max_nodes), (self.host, os.getpid()))


def prepare(cfg: LaunchConfig, spec: ClusterSpec, environ: Mapping[str, str], hostname: str,
            extra_env: Mapping[str, str]) -> _Run:
    """Run id, run directory, port, token and the workers' environment (pure but for a free port)."""
    if spec.master_addr is None:  # only a dry run (ddprun plan) resolves without one
        raise LaunchError("No rendezvous host to launch with.", seen=spec.sources.get("master_addr", ""),
                          hint="Give every node the same --rdzv-endpoint HOST:PORT.")
    run_id = spec.run_id or new_run_id()  # without one, multi-node: this node's proposal (admit_run)
    rdzv_id = spec.run_id or (defaults.RDZV_ID if spec.max_nodes > 1 else run_id)
    rundir = RunDir(run_dir_for(cfg, run_id))
    port = spec.master_port or free_port(spec.master_addr)
    token = job_token(environ, spec)
    wenv = WorkerEnv(run_dir=rundir.path, device_kind=spec.device, join_timeout=cfg.join_timeout,
                     stall_timeout=cfg.stall_timeout, stall_end=cfg.stall_timeout if cfg.stall_end is None else cfg.stall_end,
                     exit_timeout=cfg.exit_timeout, min_nodes=spec.min_nodes,
                     max_nodes=spec.max_nodes, job_token=token, straggler_margin=cfg.straggler_margin,
                     straggler_windows=cfg.straggler_windows, telemetry_window=cfg.telemetry_window, doctor=cfg.doctor,
                     allow_uneven_nodes=cfg.allow_uneven_nodes, preempt_signals=cfg.preempt_signals)
    extra = {**extra_env, **worker_extras(environ, spec.nproc_per_node, rundir.logs)}
    off = environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
    return _Run(cfg, spec, run_id, rundir, hostname, spec.master_addr, port, token, wenv, extra, off, rdzv_id,
                bool(spec.run_id), dial=spec.master_addr, grace=pp.grace(environ, cfg.preempt_grace),
                requeue=tuple(requeue_command(environ)) if cfg.requeue else (),
                spot=spot_settings(cfg.spot_notice, environ) if cfg.spot_notice != "off" else None)


def worker_extras(environ: Mapping[str, str], nproc: int, logs_dir: str | None) -> dict[str, str]:
    """What the launch adds to every worker's environment but the network's interface names (pure):
    OMP_NUM_THREADS unless the user set it, and the Flight Recorder (which collective each rank is
    in, at a stall), its NCCL dump into ``logs_dir``. ``logs_dir=None``: what a standby starts with,
    before the run directory is known (the dump's path is read when a process group starts)."""
    extra = {}
    threads = omp_threads(environ, nproc, cpu_count())
    if threads is not None:
        extra["OMP_NUM_THREADS"] = threads
    extra.update(flight_recorder_env(environ, logs_dir or ""))
    if logs_dir is None:
        extra.pop(FR_DUMP_FILE, None)
    return extra


def admit_run(run: _Run, console: TextIO) -> _Run:
    """Reach (one node: host) the endpoint's store, bound to the endpoint's address only, be admitted,
    and take the run id the nodes agreed on (agent/admission.py); the run with it. Raises LaunchError
    when refused or nothing answers."""
    spec = run.spec
    if spec.rdzv_backend not in ("c10d", "static"):
        return run
    host_it = spec.max_nodes == 1 or admission.should_host(run.addr, run.cfg.rdzv_conf, spec.rdzv_backend,
                                                           spec.node_rank or 0)
    # the host listens on one address (endpoint.store_bind), and its own clients, torch's included, dial it
    dial = (run.bind or run.addr) if host_it else run.addr
    store, hosted = admission.connect(dial, run.port, host_it, run.cfg.join_timeout, console, bind=run.bind)
    me = run.newcomer
    run_id = admission.admit(store, me)
    note = admission.elastic_note(me, spec.min_nodes, spec.max_nodes)
    if note:
        print(note, file=console, flush=True)
    # from now on on torch's loop (the job record each start): a stopped endpoint host must not hold it,
    # and one that runs again is written to again (a new client: the stuck one may never answer)
    client = admission.EndpointClient(store, lambda: admission.client(dial, run.port, defaults.STORE_CALL_S),
                                      defaults.STORE_CALL_S)
    return replace(in_run_dir(run, run_id), endpoint_store=client, dial=dial, hosted=hosted)


def in_run_dir(run: _Run, run_id: str) -> _Run:
    """``run`` under the run id the nodes agreed on: its directory, and everything that names it."""
    rundir = RunDir(run_dir_for(run.cfg, run_id))
    extra = dict(run.extra_env)
    if FR_DUMP_FILE in extra:  # set by worker_extras, not by the user
        extra[FR_DUMP_FILE] = flight_recorder_env({}, rundir.logs)[FR_DUMP_FILE]
    return replace(run, run_id=run_id, rundir=rundir, wenv=replace(run.wenv, run_dir=rundir.path), extra_env=extra)


class AgentLog:
    """torch's logging and every C++ write to fd 2 go to ``logs/agent-HOST.log`` while the agent runs;
    :attr:`console` is the real stderr. Restored on exit, also when the block raises (then the error
    is said on the real stderr: a launch never ends with an empty console)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> AgentLog:
        from ddprun.agent.console_stream import ConsoleStream
        from ddprun.agent.logs import route_torch_logging

        self._restore_logging = route_torch_logging(self.path)
        self._saved = os.dup(2)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        self.console: Any = ConsoleStream(os.fdopen(os.dup(self._saved), "w", buffering=1))
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        self._restore_logging()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        if value is not None and not isinstance(value, (KeyboardInterrupt, SystemExit)):
            from ddprun.openfiles import exhausted_hint

            print(f"ddprun: the launcher failed: {type(value).__name__}: {value}{exhausted_hint(value)}\n"
                  f"See {self.path}", file=self.console, flush=True)
        self.console.close()


def launch(cfg: LaunchConfig, spec: ClusterSpec, environ: Mapping[str, str], hostname: str,
           console: TextIO | None = None, standby: Any = None) -> Outcome:
    """Run this node's agent until the job ends; return the exit code for this node (and its failures).
    ``standby``: the pool :func:`early_standbys` started, closed here like one started here."""
    from ddprun.agent.endpoint import store_bind
    from ddprun.cluster.netaddr import IFNAME_VARS, is_loopback, network_plan

    if cfg.entry is None:
        raise LaunchError("Nothing to run.", hint="Give a script: ddprun run train.py, or a module: ddprun run -m pkg.train")
    console = console or sys.stdout
    tee = parse_local_ranks(cfg.tee, spec.nproc_per_node)
    # the network plan prints before stderr goes to the agent log, so that its errors reach the console
    net = network_plan(spec, environ, cfg.local_addr, cfg.rdzv_conf)
    # every node on this machine (one node, or a loopback endpoint): the workers' store on loopback too
    local = net.local_addr or ("127.0.0.1" if spec.master_addr and is_loopback(spec.master_addr) else None)
    named = bool(cfg.local_addr) or any(environ.get(v) for v in IFNAME_VARS)  # by the user, not the plan
    cfg = replace(cfg, local_addr=local, rdzv_conf={**net.rdzv_conf, **cfg.rdzv_conf})
    if net.summary():
        print(net.summary(), file=console, flush=True)
    _open_files(spec, console)
    t0 = time.monotonic()
    bind = store_bind(spec.master_addr, local, named) if spec.master_addr else None
    prepared = replace(prepare(cfg, spec, environ, hostname, net.worker_env), bind=bind)
    pool = _standby(prepared, standby)
    relay = None
    try:
        run = admit_run(replace(prepared, standby=pool), console)
        relay = node_relay(console)
        if relay is not None:
            run = replace(run, wenv=replace(run.wenv, node_store=relay.address))
        try:
            os.makedirs(run.rundir.logs, exist_ok=True)
        except OSError as e:  # writable a moment ago (check_run_root): the disk filled, a quota
            raise LaunchError("Could not create the run directory.", seen=f"{run.rundir.logs}: {e.strerror or e}",
                              hint="Free space or give --log-dir a writable directory with room.") from None
        with AgentLog(run.rundir.agent_log(hostname)) as log:
            outcome = supervise(run, tee, console, log.console, relay)
    finally:
        if pool is not None:
            pool.close()
        if relay is not None:
            relay.close()
    outcome.wall_s = time.monotonic() - t0
    if outcome.exit_code == 0:
        print(f"ddprun: run {run.run_id} finished on this node in {outcome.wall_s:.1f} s", file=console, flush=True)
    return outcome


def _open_files(spec: ClusterSpec, console: TextIO) -> None:
    """Raise the open-files limit to what hosting this job's stores needs (any node may: group rank 0
    hosts the workers' store), and warn when the hard limit is below it (openfiles.py)."""
    from ddprun.openfiles import agent_warning, needed, raise_soft_limit

    world = spec.max_nodes * spec.nproc_per_node
    limits = raise_soft_limit(needed(world, spec.max_nodes, spec.nproc_per_node))
    warning = agent_warning(limits, world, spec.max_nodes, spec.nproc_per_node)
    if warning:
        print(warning, file=console, flush=True)


def node_relay(console: TextIO) -> Any:
    """This node's store for its workers (agent/noderelay.py); None, said on the console, when it
    cannot listen on 127.0.0.1: the workers then talk to the job's store themselves."""
    from ddprun.agent.noderelay import NODE_HOST, NodeRelay

    try:
        return NodeRelay()
    except Exception as e:  # noqa: BLE001 - the job runs without it, at a higher cost to the job's store
        print(f"ddprun: warning: no node store on {NODE_HOST} ({type(e).__name__}: {e}); this node's ranks talk "
              f"to the job's store themselves. HINT: bring the loopback interface up (ip link set lo up).",
              file=console, flush=True)
        return None


def processes_here(nproc: int, max_nodes: int, master_host: str | None) -> int | None:
    """Worker processes this machine runs: every node's when the rendezvous is on a loopback address
    (every node then runs here: a job simulated on one machine), else this node's ``nproc``; None when
    there are several nodes and the rendezvous host is not known yet."""
    if max_nodes <= 1:
        return nproc
    if master_host is None:
        return None
    return nproc * max_nodes if is_loopback(master_host) else nproc


def warm_start(mode: str, processes: int, cpus: int) -> bool:
    """Whether to start standbys: ``--warm-start on``, or ``auto`` on a machine with a CPU for each
    worker process it runs (``processes``: :func:`processes_here`). With fewer, what the standbys
    import while they wait (dynamo and ``ddprun.train``, ~2 s of CPU each) is taken from the agents'
    start: one 2-core machine running two simulated nodes of 2 made the test suite a sixth slower
    and let an elastic node miss its peer's last call. With one CPU each they overlap the agent's
    own start (1 x 2 on 2 cores: launch -> first step 0.946x torchrun, 1.153x without them)."""
    return mode == "on" or (mode == "auto" and cpus >= processes)


def _flag_topology(cfg: LaunchConfig) -> tuple[int, str | None]:
    """(max nodes, rendezvous host) as the flags give them: 1 node when --nnodes is absent (a
    cluster's environment may say more, but then on hosts of their own), None for an absent host.
    A malformed flag counts as many nodes on an unknown host: the launch names it."""
    if cfg.standalone:
        return 1, "localhost"
    try:
        nodes = parse_nnodes(cfg.nnodes)[1] if cfg.nnodes else 1
        if cfg.rdzv_endpoint:
            return nodes, parse_endpoint(cfg.rdzv_endpoint, None)[0]
        return nodes, master_host(cfg.master_addr) if cfg.master_addr is not None else None
    except ConfigError:
        return 2, None


def early_standbys(cfg: LaunchConfig, environ: Mapping[str, str]) -> Any:
    """The standbys (agent/standby.py), started before anything in this agent imports torch (the node
    probe may, to count GPUs: ~3 s of CPU) when the flags give the number of processes (and, for
    several nodes, the rendezvous host); else None, and :func:`launch` starts them once the node is
    resolved."""
    n = cfg.nproc_per_node or ""
    if cfg.entry is None or not n.isdigit() or int(n) < 1:
        return None
    here = processes_here(int(n), *_flag_topology(cfg))
    if here is None or not warm_start(cfg.warm_start, here, cpu_count()):
        return None
    from ddprun.agent.standby import StandbyPool

    return StandbyPool().start(int(n), {**environ, **worker_extras(environ, int(n), None)}, _entry_argv(cfg))


def _standby(run: _Run, early: Any = None) -> Any:
    """The first workers' interpreters: ``early`` when it has one per local rank, else started now to
    import torch while the agent starts and waits for its peers; None when --warm-start says no."""
    if early is not None and early.size == run.spec.nproc_per_node:
        return early
    if early is not None:
        early.close()
    spec = run.spec
    here = processes_here(spec.nproc_per_node, spec.max_nodes, spec.master_addr)
    if here is None or not warm_start(run.cfg.warm_start, here, cpu_count()):
        return None
    from ddprun.agent.standby import StandbyPool

    # the environment torch's agent will give the workers, but for what the launch sets per worker
    return StandbyPool().start(run.spec.nproc_per_node, {**os.environ, **run.extra_env}, _entry_argv(run.cfg))


def _entry_argv(cfg: LaunchConfig) -> list[str]:
    """What follows ``python -m ddprun.worker`` in every worker's command line."""
    return cfg.entry.argv() if cfg.entry is not None else []


def _announce(run: _Run, console: TextIO) -> None:
    spec = run.spec
    nodes = str(spec.max_nodes) if not spec.elastic else f"{spec.min_nodes}-{spec.max_nodes}"
    print(f"ddprun: run {run.run_id}: {nodes} node(s) x {spec.nproc_per_node} process(es) on {spec.device}, "
          f"{spec.rdzv_backend} rendezvous at {run.endpoint}; logs in {os.path.relpath(run.rundir.path)}/logs",
          file=console, flush=True)
    if run.shared_store_off:
        print("ddprun: warning: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the workers get no access to the agents' "
              "store, so the rank table, preflight, stall watchdog and failure propagation are off (restarts work "
              "without it: ddprun keeps each attempt's keys apart). HINT: unset it.", file=console, flush=True)


def supervise(run: _Run, tee: set[int], console: TextIO, err: TextIO, relay: Any = None) -> Outcome:
    """Run torch's agent with ddprun's hooks (the endpoint is claimed already, :func:`admit_run`) and
    say how it ended. ``relay``: the node store (agent/noderelay.py) whose address is in ``run.wenv``."""
    from ddprun.agent.joinwatch import JoinWatcher, stranded_after
    from ddprun.agent.logs import LogFollower, remove_empty_early_logs

    _announce(run, console)
    follower = LogFollower(console)
    watcher = None
    if run.spec.rdzv_backend == "c10d" and run.spec.max_nodes > 1:
        interval, attempts = defaults.keep_alive(run.cfg.rdzv_conf)
        watcher = JoinWatcher(run.dial, run.port, run.rdzv_id, run.newcomer, run.spec.max_nodes,
                              run.cfg.join_timeout, err, (run.host, os.getpid()), hosted=run.hosted,
                              min_nodes=run.spec.min_nodes,
                              stranded_s=stranded_after(run.cfg.join_timeout, interval * attempts)).start()
    beat = admission.EndpointBeat(run.dial, run.port) if run.endpoint_store is not None else None
    failures = AgentFailures(run.rundir, run.host, run.addr, run.port, run.rdzv_id, err, on_beat=beat, relay=relay,
                             stop_grace_s=run.cfg.stop_grace)
    agent = _AgentRun(run, tee, follower, watcher, failures)
    try:
        outcome = agent.run(err)
    finally:
        follower.stop()
        failures.stop()
        if watcher is not None:
            watcher.stop()
        if agent.final and agent.job is not None and failures.node_rank == 0 and run.endpoint_store is not None:
            admission.publish_end(run.endpoint_store, agent.job)  # a relaunch now is told the job is closing
        if run.endpoint_store is not None:
            run.endpoint_store.close()
        remove_empty_early_logs(run.rundir.path)
    if agent.logs_specs.has_rank0:
        write_run_report(run.rundir.path, console)
    return outcome


class _AgentRun:
    """torch's agent for one launch, wired to the log follower, join watcher and failure hooks."""

    def __init__(self, run: _Run, tee: set[int], follower: Any, watcher: Any, failures: AgentFailures):
        from ddprun.agent.attempt import AttemptIds
        from ddprun.agent.logs import RankLogsSpecs
        from ddprun.agent.preemption import Preemption

        self.run_, self.failures, self.watcher = run, failures, watcher
        self.preemption = Preemption(pp.parse_signals(run.cfg.preempt_signals), run.grace[0], run.grace[1], failures,
                                     failures.out, run.host)
        self._round = 0
        """The rendezvous round of the latest worker start (0: a backend without rounds)."""
        self.job: JobRecord | None = None
        """The job record this agent published at its latest worker start."""
        self.final = True
        """This agent's end ends the job (:func:`ends_the_job`); node 0 then publishes the end."""
        self._report_warm = False
        """Whether the report's warm-up started (once per launch, on the node of rank 0)."""
        self.attempts = attempts = AttemptIds(run.spec.rdzv_backend)
        self.logs_specs = RankLogsSpecs(run.rundir.path, follower, tee, run.wenv, run.extra_env,
                                        on_workers_start=watcher.stop if watcher else None,
                                        attempt_id=attempts.current)

    def _started(self, group: Any, pids: Mapping[int, int], restarts_left: int = 0) -> None:
        workers = {w.global_rank: (w.local_rank, pids.get(w.local_rank, 0),
                                   self.logs_specs.local_workers.get(w.global_rank, (0, ""))[1])
                   for w in group.workers}
        world = group.workers[0].world_size if group.workers else len(workers)
        store = (group.master_addr, int(group.master_port)) if group.master_addr and group.master_port else None
        self.failures.on_workers_started(self.logs_specs.attempt, group.group_rank, group.group_world_size, workers,
                                         world, store, last_attempt=restarts_left == 0)
        self._warm_report_once()
        attempt = self.logs_specs.attempt
        # r<rendezvous round> under c10d, c<restart count> under static: either counts the starts
        self._round = int(attempt[1:]) if attempt[1:].isdigit() else 0
        run = self.run_
        if run.endpoint_store is not None:
            self.job = JobRecord(run.run_id, self._round, group.group_world_size, run.spec.min_nodes,
                                 run.spec.max_nodes, time.time())
            admission.publish_start(run.endpoint_store, self.job, group.group_rank, run.host, os.getpid())

    def _warm_report_once(self) -> None:
        """The report's warm-up (:func:`warm_run_report`): on the node of rank 0, once a launch, where
        the machine has a CPU its workers do not take."""
        if not self.logs_specs.has_rank0 or self._report_warm:
            return
        self._report_warm = True
        spec = self.run_.spec
        if spare_cpu(processes_here(spec.nproc_per_node, spec.max_nodes, spec.master_addr), cpu_count()):
            warm_run_report()

    def _reforming(self) -> None:
        """torch is about to restart this round's group: a node coming back is let in from now on."""
        self.failures.on_reforming()
        if self.run_.endpoint_store is not None:
            admission.publish_reforming(self.run_.endpoint_store, self._round)

    def _membership_change(self) -> None:
        print("ddprun: a node waits to join; restarting the workers to take it in (a membership change, not "
              "counted against --max-restarts)", file=self.failures.out, flush=True)
        self._reforming()

    def _dropped(self) -> None:
        interval, attempts = defaults.keep_alive(self.run_.cfg.rdzv_conf)
        print(f"ddprun: this node was dropped from the job's rendezvous: its agent missed torch's keep-alive for "
              f"more than keep_alive_interval {interval} s x keep_alive_max_attempt {attempts} (the agent was "
              "frozen or starved of CPU), and the rendezvous went on without it; stopping its workers and joining "
              "again, so that two groups never train one run", file=self.failures.out, flush=True)
        self._reforming()

    def _restarting(self, left: int, most: int) -> None:
        self._reforming()  # before the restart line, which may wait for a first-hand record
        self.failures.on_restarting(left, most)

    def _on_signal(self, sig: int) -> None:
        self.failures.on_signal(sig, self.preemption.forced_why())

    def torch_config(self) -> Any:
        from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig

        run, spec, cfg = self.run_, self.run_.spec, self.run_.cfg
        rdzv: dict[str, Any] = dict(cfg.rdzv_conf)
        rdzv.setdefault("timeout", math.ceil(cfg.join_timeout))
        rdzv.setdefault("join_timeout", math.ceil(cfg.join_timeout))
        if spec.rdzv_backend == "static":
            rdzv["rank"] = spec.node_rank
        return TorchLaunchConfig(
            min_nodes=spec.min_nodes, max_nodes=spec.max_nodes, nproc_per_node=spec.nproc_per_node,
            logs_specs=self.logs_specs, run_id=run.rdzv_id, role=cfg.role, rdzv_endpoint=f"{run.dial}:{run.port}",
            rdzv_backend=spec.rdzv_backend, rdzv_configs=rdzv, max_restarts=cfg.max_restarts or 0,
            monitor_interval=cfg.monitor_interval, start_method=cfg.start_method, local_addr=cfg.local_addr)

    def run(self, err: TextIO) -> Outcome:
        from ddprun.agent.torch_agent import AgentHooks, run_agent

        hooks = AgentHooks(on_worker_exit=self.failures.on_worker_exit, on_workers_started=self._started,
                           on_restarting=self._restarting, on_membership_change=self._membership_change,
                           on_dropped=self._dropped,
                           on_rendezvous=self.attempts.set_round,
                           on_signal=self._on_signal, exit_barrier_done=self.failures.exit_barrier_done,
                           on_exit_barrier_left=self.failures.exit_barrier_left,
                           stop_grace_s=self.run_.cfg.stop_grace, preempt_signals=self.preemption.signals,
                           on_preempt_signal=self.preemption.on_signal, preempt_check=self.preemption.check,
                           preempting=self.preemption.preempting,
                           restart_forbidden=self.preemption.restart_forbidden, on_stopping=self.failures.mark_stopping,
                           answered_none=self.preemption.answered_none,
                           before_exit_barrier=self.preemption.before_exit, standby=self.run_.standby)
        spot = self._spot_watch(err)
        try:
            run_agent(self.torch_config(), sys.executable, [*WORKER_MODULE, *_entry_argv(self.run_.cfg)], hooks)
        except BaseException as e:  # noqa: BLE001 - every way torch's agent ends gets its one message
            self.final = ends_the_job(e, self.preemption.preempting())
            return ending(e, self, err)
        finally:
            if spot is not None:
                spot.stop()
        if self.preemption.ended_preempted():
            code, line = self.preemption.finished_line()
            print(line, file=err, flush=True)
            if code == pp.EXIT_CODE:
                self.requeue(err)
            return Outcome(code, self.run_.rundir.path, 0.0)
        return self._finished(err)

    def _finished(self, err: TextIO) -> Outcome:
        """Every worker of this node ended 0. The job failed all the same when another rank's failure
        is known (one that this node's ranks ended before it, say: every node names the cause), or a
        node was lost before it reached the agents' exit barrier (its ranks had not all finished)."""
        cause = self.failures.job_failed() or self.failures.lost_before_end()
        if cause is None:
            return Outcome(0, self.run_.rundir.path, 0.0)
        self.failures.linger(finished=True)  # the store's host stays until every rank has a record, as on a failure
        print("ddprun: this node's ranks ended their script (exit 0), but the job failed:", file=err)
        print(agent_console.summary({}, [cause], self.run_.rundir, self.run_.host), file=err, flush=True)
        return Outcome(1, self.run_.rundir.path, 0.0, {}, cause)

    def _spot_watch(self, err: TextIO) -> Any:
        """``--spot-notice``: the metadata poller, started (agent/spot.py); None when off."""
        if self.run_.spot is None:
            return None
        from ddprun.agent.spot import SpotWatch

        base, poll_s = self.run_.spot
        return SpotWatch(self.run_.cfg.spot_notice, base, poll_s, self.preemption.on_notice, err).start()

    def requeue(self, err: TextIO) -> None:
        """``--requeue``, after a preemption stop and its line: node rank 0 puts the SLURM job back in
        the queue, once, when every node has printed its own line (SLURM's requeue kills the job's
        steps at once), at most REQUEUE_WAIT_S after its own."""
        if not self.run_.requeue:
            return
        self.failures.mark_said()
        if self.failures.node_rank == 0:
            from ddprun.agent.preemption import REQUEUE_WAIT_S, requeue

            self.failures.wait_all_said(REQUEUE_WAIT_S)
            requeue(list(self.run_.requeue), err)


def _known(agent: _AgentRun, local: Mapping[int, fr.FailureRecord]) -> list[fr.FailureRecord]:
    """Every record this node knows of; when they hold no first-hand cause (only peers' echoes: the
    dead rank's agent could not write one), which nodes are gone (agent/failures.py probe)."""
    known = agent.failures.records()
    cause = fr.root_cause([*known, *local.values()])
    if cause is None or cause.is_echo:
        known = [*agent.failures.probe_lost(), *agent.failures.records()]
    return known


def _child_failed(e: Any, agent: _AgentRun, err: TextIO) -> Outcome:
    run, f = agent.run_, agent.failures
    f.linger()
    recorded = {rank: f.local_record(rank) for rank in e.failures}
    local = agent_console.local_records(e.failures, recorded, run.host, f.node_rank, f.root_cause())
    known = _known(agent, local)
    cause = fr.root_cause([*known, *local.values()])
    if agent.preemption.forced_by_peer(cause):
        return _forced(agent, err, cause)
    followed = {0} if agent.logs_specs.has_rank0 else set()
    print(agent_console.summary(local, known, run.rundir, run.host, followed), file=err, flush=True)
    return Outcome(1, run.rundir.path, 0.0, local, cause)


def _forced(agent: _AgentRun, err: TextIO, cause: fr.FailureRecord | None = None) -> Outcome:
    """The preemption's stop was forced (a grace ended, here or on ``cause``'s node, first): every
    node ends as a signalled one does (128 + the signal), and the job is requeued (its work since the
    last checkpoint is lost; the job is not done)."""
    pre = agent.preemption
    print(pre.forced_line(cause), file=err, flush=True)
    agent.requeue(err)
    return Outcome(128 + pre.stop_signal(), agent.run_.rundir.path, 0.0)


def _from_records(agent: _AgentRun, err: TextIO, fallback: str,
                  last_resort: Callable[[], list[fr.FailureRecord]] | None = None) -> Outcome:
    """The node's agent ended without torch naming a worker (the store host went first, a lost node):
    say the root cause this node knows of, else what ``last_resort`` finds, else ``fallback``."""
    run, f = agent.run_, agent.failures
    f.linger()
    local = {rank: rec for rank in agent.logs_specs.local_workers if (rec := f.local_record(rank)) is not None}
    known = _known(agent, local) if agent.logs_specs.local_workers else f.records()
    cause = fr.root_cause([*known, *local.values()])
    if cause is None and last_resort is not None:
        known = [*last_resort(), *known]
        cause = fr.root_cause([*known, *local.values()])
    if agent.preemption.forced_by_peer(cause):
        return _forced(agent, err, cause)
    if cause is not None:  # this node's workers without a record were stopped by torch's agent on its way out
        for rank, (local_rank, _) in agent.logs_specs.local_workers.items():
            local.setdefault(rank, fr.stopped_by(cause, rank=rank, node_rank=f.node_rank, host=run.host,
                                                 local_rank=local_rank, t=0.0))
    if cause is None:
        print(fallback, file=err, flush=True)
        return Outcome(1, run.rundir.path, 0.0)
    print(agent_console.summary(local, known, run.rundir, run.host, {0} if agent.logs_specs.has_rank0 else ()),
          file=err, flush=True)
    return Outcome(1, run.rundir.path, 0.0, local, cause)


def ends_the_job(e: BaseException, preempting: bool) -> bool:
    """Whether this agent's end by ``e`` ends the job: not a signal that stopped this agent alone
    (SIGQUIT, Ctrl-C, a SIGTERM that --preempt-signals does not name) outside a preemption, for the
    other nodes may re-form without it (--max-restarts) and take a relaunch of it back. Pure."""
    return preempting or not (isinstance(e, KeyboardInterrupt) or type(e).__name__ == "SignalException")


def ending(e: BaseException, agent: _AgentRun, err: TextIO) -> Outcome:
    """One table from the way torch's agent ended to (exit code, what the console says)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError

    run, name = agent.run_, type(e).__name__
    if isinstance(e, ChildFailedError):
        return _child_failed(e, agent, err)
    if isinstance(e, RendezvousTimeoutError) and not agent.failures.records():
        seen = agent.watcher.timeout_message() if agent.watcher else "the rendezvous did not complete"
        print(f"ddprun: not every node joined within {run.cfg.join_timeout:.0f} s: {seen}.\n"
              f"HINT: start ddprun on every node with the same --rdzv-endpoint {run.endpoint}"
              f"{f' and --rdzv-id {run.rdzv_id}' if run.explicit_id else ''}; check the missing nodes' own output; "
              "raise --join-timeout if nodes start late.",
              file=err, flush=True)
        return Outcome(1, run.rundir.path, 0.0)
    if isinstance(e, RendezvousError) and agent.watcher is not None and agent.watcher.refused:
        return Outcome(1, run.rundir.path, 0.0)  # left out and said so; the job it served has closed
    if isinstance(e, RendezvousError):  # torch's agent polls the endpoint's store while its workers run
        endpoint = (run.dial or run.addr, run.port)
        return _from_records(agent, err, (
            f"ddprun: rendezvous at {run.endpoint} failed: {name}: {e}\nHINT: check that every node runs ddprun "
            f"with the same --rdzv-endpoint and --rdzv-id, that {run.addr} is reachable from every "
            f"node, and see {run.rundir.agent_log(run.host)}"), lambda: agent.failures.endpoint_gone(*endpoint))
    if isinstance(e, KeyboardInterrupt):
        print("ddprun: interrupted; workers stopped.", file=err, flush=True)
        return Outcome(130, run.rundir.path, 0.0)
    if name == "SignalException":
        if agent.watcher is not None and agent.watcher.refused:
            return Outcome(1, run.rundir.path, 0.0)  # the refusal is printed already
        sig = int(getattr(e, "sigval", 15))
        if agent.preemption.preempting() and agent.preemption.grace_over():
            # requeued at once (the cluster's kill is near); the others read this node as lost
            print(agent.preemption.forced_line(), file=err, flush=True)
            agent.requeue(err)  # the work since the last checkpoint is lost, the job is not done
        else:
            agent.failures.linger()  # the store's host keeps its record of the stop up for the others to read
            print(f"ddprun: stopped by {fr.signal_name(-sig)}; workers stopped.", file=err, flush=True)
        return Outcome(128 + sig, run.rundir.path, 0.0)
    from ddprun.openfiles import exhausted_hint

    return _from_records(agent, err, f"ddprun: the launcher failed: {name}: {e}{exhausted_hint(e)}\n"
                                     f"See {run.rundir.agent_log(run.host)}")


def spare_cpu(processes: int | None, cpus: int) -> bool:
    """Whether this machine has a CPU beyond the worker processes it runs (``processes``:
    :func:`processes_here`; None: not known), which the run report's warm-up may take."""
    return processes is not None and cpus > processes


def warm_run_report() -> None:
    """Start :func:`ddprun.report.warm_up` on a daemon thread, so that the report written when the run
    ends (:func:`write_run_report`) does not wait for matplotlib's import (about 0.4 s of CPU, on the
    exit tail of the node of rank 0, the last node to exit). Only on a machine with a spare CPU
    (:func:`spare_cpu`): where the workers take every CPU, the warm-up's CPU is taken from them, and
    the job's wall did not change (benchmarks/launch_speed.py, 2 x 1 on 2 cores). Where the warm-up
    fails (matplotlib missing or broken) nothing is said here: the report itself says why it is not
    written."""
    import importlib.util
    import threading

    if importlib.util.find_spec("matplotlib") is None:
        return
    logging.getLogger("ddprun.agent.run").info("run report: importing matplotlib while the workers run")

    def warm() -> None:
        from ddprun.report import warm_up

        try:
            warm_up()
        except Exception:  # noqa: BLE001, S110 - write_run_report names the failure, once
            pass

    threading.Thread(target=warm, name="ddprun-report-warm-up", daemon=True).start()


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
