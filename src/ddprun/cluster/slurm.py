"""SLURM: ``srun ddprun run ...`` inside an allocation (sbatch or salloc).

Detected when SLURM_JOB_ID and SLURM_JOB_NODELIST (or SLURM_NODELIST) are present, unless an MPI
launcher started this process (see :func:`ddprun.cluster.mpi.started_by_mpi_launcher`): under
``mpirun`` inside an allocation, the SLURM task variables describe mpirun's daemon, not this process.
An interactive ``salloc`` shell or the batch script itself also detects as SLURM; there, a job of
more than one task is a ClusterError (no SLURM_STEP_ID: not started by ``srun``), since one process
would wait for the others until a timeout. Inside an srun step the step's own variables are read
(SLURM_STEP_NODELIST, SLURM_STEP_NUM_NODES, SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NUM_TASKS): a step
may cover part of the allocation (``srun -N1 ddprun run cfg1 &`` in a sweep), and ``srun -E`` passes
the job's SLURM_NNODES and SLURM_NTASKS on. Outside a step (the batch script, an salloc shell), or
where SLURM sets no SLURM_STEP_NODELIST, the job's are read (SLURM_JOB_NUM_NODES, SLURM_JOB_NODELIST).

Two launch styles, told apart by the tasks per node (SLURM_STEP_TASKS_PER_NODE in a step, else
SLURM_TASKS_PER_NODE, else SLURM_NTASKS_PER_NODE, else one):

* one task per node: ddprun starts the node's processes itself. node_rank = SLURM_NODEID,
  nproc_per_node = SLURM_GPUS_ON_NODE, else the entries of CUDA_VISIBLE_DEVICES, else ddprun's default.
  SLURM's count wins even where torch sees no CUDA device (a node whose GPUs SLURM allocated but the
  driver does not show, or a test bed's fake gres): the processes then run on cpu, and the reading's
  ``allocated_gpus`` lets resolve() say so in a note.
* several tasks per node: SLURM started one process per rank. rank = SLURM_PROCID,
  local_rank = SLURM_LOCALID, world_size = SLURM_STEP_NUM_TASKS in a step, else SLURM_NTASKS,
  nproc_per_node = tasks on this node. The
  tasks must be even across nodes, match the GPUs per node when SLURM_GPUS_ON_NODE is set, and be
  placed block-wise (rank = node × tasks per node + local rank).

Rendezvous is static (SLURM_NODEID, the node's index in the step, is the node rank) at the first
host of the nodelist, on
port ``15000 + SLURM_JOB_ID % 17000`` (_values.derived_port: below the ephemeral range): every node
computes the same port without talking, and concurrent jobs on one master node rarely collide.
MASTER_ADDR and MASTER_PORT in the environment win (as in Lightning's SLURMEnvironment: a recipe that
exports the first host, or an InfiniBand address); blank ones count as unset.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import hostlist

from ddprun.cluster._values import (
    DERIVED_PORT_BASE,
    DERIVED_PORT_SPAN,
    check_rank_rule,
    count,
    derived_port,
    env_int,
    env_port,
    env_value,
    refuse_loopback_master,
    visible_gpus,
)
from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading
from ddprun.cluster.mpi import started_by_mpi_launcher
from ddprun.errors import ClusterError, ConfigError


@dataclass(frozen=True)
class _Keys:
    """Which variables state the nodes and tasks: the job's, or inside an srun step the step's."""

    nodelist: str
    nnodes: tuple[str, ...]
    tasks_per_node: str
    ntasks: str
    whole: str
    """What to do when they disagree."""


JOB_KEYS = _Keys("SLURM_JOB_NODELIST", ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"), "SLURM_TASKS_PER_NODE",
                 "SLURM_NTASKS", "Start ddprun with srun over the whole allocation (srun -N <all nodes>).")
STEP_KEYS = _Keys("SLURM_STEP_NODELIST", ("SLURM_STEP_NUM_NODES",), "SLURM_STEP_TASKS_PER_NODE",
                  "SLURM_STEP_NUM_TASKS", "These are srun's own; do not set SLURM_STEP_* by hand.")


def _keys(environ: Mapping[str, str]) -> _Keys:
    """The step's variables inside an srun step that states them, else the job's. The job's would
    describe the whole allocation to a step that runs on part of it (srun -N1 in a 2-node job),
    which then waits for nodes that never come, or is refused over a count that is not its own."""
    return STEP_KEYS if _in_step(environ) and STEP_KEYS.nodelist in environ else JOB_KEYS


def _nodelist(environ: Mapping[str, str], keys: _Keys) -> tuple[str, list[str]]:
    key = keys.nodelist if keys.nodelist in environ else "SLURM_NODELIST"
    raw = environ[key]
    try:
        hosts = hostlist.expand_hostlist(raw)
    except hostlist.BadHostlist as e:
        raise ClusterError(f"{key} is not a SLURM host list ({e}).", seen=f"{key}={raw!r}",
                           hint="Expected a list like gpu[01-05,07],cpu3; do not set it by hand.") from None
    if not hosts:
        raise ClusterError(f"{key} names no host.", seen=f"{key}={raw!r}",
                           hint="Run ddprun inside a SLURM allocation (sbatch/salloc, then srun).")
    return key, hosts


def _nnodes(environ: Mapping[str, str], keys: _Keys, nodelist_key: str, hosts: list[str]) -> Fact:
    for key in keys.nnodes:
        if key in environ:
            n = env_int(environ, key, minimum=1)
            if n != len(hosts):
                raise ClusterError(
                    f"{key} and {nodelist_key} disagree on the number of nodes.",
                    seen=f"{key}={n}, {nodelist_key}={environ[nodelist_key]} ({count(len(hosts), 'host')})",
                    hint=keys.whole,
                )
            return Fact(n, f"{key}={n}")
    return Fact(len(hosts), f"{nodelist_key}={environ[nodelist_key]} ({count(len(hosts), 'host')})")


def _tasks_per_node(environ: Mapping[str, str], keys: _Keys, nnodes: int) -> tuple[list[int], str]:
    """Tasks on each node, and the variable they came from."""
    key = next((k for k in (keys.tasks_per_node, "SLURM_TASKS_PER_NODE") if k in environ), None)
    if key is not None:
        raw = environ[key]
        try:
            counts = hostlist.parse_slurm_tasks_per_node(raw)
        except hostlist.BadHostlist:
            counts = []
        if len(counts) != nnodes or min(counts) < 1:
            raise ClusterError(
                f"{key} does not give a task count for every node.",
                seen=f"{key}={raw!r}, {nnodes} nodes",
                hint="Expected e.g. 2(x2) or 4(x3),2; start ddprun with srun inside the allocation.",
            )
        return counts, f"{key}={raw}"
    if "SLURM_NTASKS_PER_NODE" in environ:  # set only when --ntasks-per-node was given
        n = env_int(environ, "SLURM_NTASKS_PER_NODE", minimum=1)
        return [n] * nnodes, f"SLURM_NTASKS_PER_NODE={n}"
    return [1] * nnodes, "no SLURM_TASKS_PER_NODE: one task per node"


def _visible_gpus(environ: Mapping[str, str]) -> Fact | None:
    if "SLURM_GPUS_ON_NODE" in environ:
        n = env_int(environ, "SLURM_GPUS_ON_NODE")
        if n > 0:
            return Fact(n, f"SLURM_GPUS_ON_NODE={n}")
    return visible_gpus(environ)


def _master_addr(environ: Mapping[str, str], nnodes: Fact, nodelist_key: str, hosts: list[str]) -> Fact:
    """MASTER_ADDR when set, else the nodelist's first host. A loopback MASTER_ADDR in a job of several
    nodes (left over from a one-node recipe; sbatch passes the submit shell's environment on) is an
    error: every other node would wait out its join timeout dialling itself."""
    addr = env_value(environ, "MASTER_ADDR")  # blank: as unset
    if addr is None:
        return Fact(hosts[0], f"first host of {nodelist_key}={environ[nodelist_key]}")
    refuse_loopback_master(addr, nnodes.value, nnodes.source, "SLURM job",
                           hint=f"Unset MASTER_ADDR (ddprun then uses the first host, {hosts[0]}), or set it to "
                                "an address every node reaches.")
    return Fact(addr, f"MASTER_ADDR={addr}")


def _in_step(environ: Mapping[str, str]) -> bool:
    return "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ


def _partial_step(environ: Mapping[str, str]) -> int | None:
    """The step id of an srun step over part of the allocation's nodes (SLURM_STEP_NODELIST other
    than SLURM_JOB_NODELIST: a sweep's `srun -N1 ddprun run cfgN &`), else None. Such steps may run
    side by side: under the job's id alone they would share a run directory, its checkpoints and a
    port. A requeued job numbers its steps from 0 again, so each step resumes its own run."""
    step = (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "").strip()
    nodes, job_nodes = env_value(environ, "SLURM_STEP_NODELIST"), env_value(environ, "SLURM_JOB_NODELIST")
    if not step.isdigit() or nodes is None or job_nodes is None or nodes == job_nodes:
        return None
    try:
        if set(hostlist.expand_hostlist(nodes)) == set(hostlist.expand_hostlist(job_nodes)):
            return None  # the same nodes, written otherwise
    except hostlist.BadHostlist:
        return None  # the node list's own reader names it
    return int(step)


def _check_in_step(environ: Mapping[str, str], nnodes: Fact, counts: list[int], counts_src: str) -> None:
    """A job of several tasks needs ddprun inside an srun step (which sets SLURM_STEP_ID).

    The batch script and an salloc shell carry the job's variables too (the batch script even
    SLURM_NODEID=0): started there, one process would wait for nodes or ranks that never start.
    """
    if sum(counts) > 1 and not _in_step(environ):
        raise ClusterError(
            f"ddprun is not running in an srun step, but the SLURM job has {count(sum(counts), 'task')}: "
            "started from the batch script (or an salloc shell) it runs once, and the other tasks never start.",
            seen=f"SLURM_STEP_ID=<unset>, {nnodes.source}, {counts_src}",
            hint="Start it with srun: `srun --ntasks-per-node=1 ddprun run train.py` (one launcher per node), or "
                 "`srun python train.py` for a script that calls ddprun.init()/ddprun.fit() (one task per GPU).",
        )


class SlurmEnvironment(ClusterEnvironment):
    name = "slurm"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        has_nodelist = "SLURM_JOB_NODELIST" in environ or "SLURM_NODELIST" in environ
        return "SLURM_JOB_ID" in environ and has_nodelist and not started_by_mpi_launcher(environ)

    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        job_id = env_int(environ, "SLURM_JOB_ID")
        keys = _keys(environ)
        nodelist_key, hosts = _nodelist(environ, keys)
        nnodes = _nnodes(environ, keys, nodelist_key, hosts)
        counts, counts_src = _tasks_per_node(environ, keys, nnodes.value)
        if launcher and nnodes.value == 1 and not _in_step(environ) and environ.get("SLURMD_NODENAME") == hosts[0]:
            # `ddprun run` in the batch script of a one-node job (torchrun's usual place; slurmd runs it
            # on the job's node, where an salloc shell may be on a login host): it starts the node's
            # workers itself, whatever task count the job asked for
            counts_src = f"{counts_src}, but this is `ddprun run` in the job's batch script: the node's one launcher"
            counts = [1]
        _check_in_step(environ, nnodes, counts, counts_src)
        reading: Reading = {
            "min_nodes": nnodes,
            "max_nodes": nnodes,
            "master_addr": _master_addr(environ, nnodes, nodelist_key, hosts),
            "rdzv_backend": Fact("static", "node ranks known from SLURM_NODEID"),
            "run_id": Fact(f"slurm-{job_id}", f"SLURM_JOB_ID={job_id}"),
        }
        step = _partial_step(environ)
        if step is not None:  # a sweep's steps side by side: each its own run (directory, checkpoints) and port
            reading["run_id"] = Fact(f"slurm-{job_id}.{step}", f"SLURM_JOB_ID={job_id}, SLURM_STEP_ID={step}: a "
                                     f"step on part of the allocation ({environ['SLURM_STEP_NODELIST']} of "
                                     f"{environ['SLURM_JOB_NODELIST']})")
        if env_value(environ, "MASTER_PORT") is not None:
            reading["master_port"] = Fact(env_port(environ), f"MASTER_PORT={environ['MASTER_PORT']}")
        else:
            reading["master_port"] = derived_port(job_id, "SLURM_JOB_ID", step or 0, "SLURM_STEP_ID")

        if "SLURM_NODEID" in environ:
            node_id = env_int(environ, "SLURM_NODEID")
            reading["node_rank"] = Fact(node_id, f"SLURM_NODEID={node_id}")
        elif nnodes.value == 1:
            node_id = 0
            reading["node_rank"] = Fact(0, "single-node SLURM job")
        else:
            raise ClusterError(
                "A multi-node SLURM job without SLURM_NODEID: ddprun was not started by srun.",
                seen=f"{nnodes.source}, SLURM_NODEID=<unset>",
                hint="Start it with srun, one task per node: srun --ntasks-per-node=1 ddprun run train.py",
            )
        if not 0 <= node_id < nnodes.value:
            raise ClusterError("SLURM_NODEID is outside the job's nodes.",
                               seen=f"SLURM_NODEID={node_id}, {nnodes.source}",
                               hint="Start ddprun with srun over the whole allocation.")

        gpus = _visible_gpus(environ)
        if gpus is not None:
            reading["allocated_gpus"] = gpus
        if max(counts) == 1:
            if gpus is not None:
                reading["nproc_per_node"] = gpus
            return reading
        reading.update(self._per_process(environ, keys, counts, counts_src, node_id))
        return reading

    @staticmethod
    def _per_process(environ: Mapping[str, str], keys: _Keys, counts: list[int], counts_src: str,
                     node_id: int) -> Reading:
        """srun started one process per rank (several tasks per node)."""
        if len(set(counts)) > 1:
            raise ClusterError(
                "SLURM gave the nodes different numbers of tasks; ddprun needs the same count on every node.",
                seen=f"{counts_src} (tasks per node: {', '.join(map(str, counts))})",
                hint="Ask for an even layout: sbatch/srun --ntasks-per-node=<GPUs per node> "
                     "(or one task per node and let ddprun start the processes).",
            )
        tasks = counts[node_id]
        if "SLURM_GPUS_ON_NODE" in environ:
            gpus = env_int(environ, "SLURM_GPUS_ON_NODE")
            if gpus and gpus != tasks:
                raise ClusterError(
                    "SLURM tasks per node differ from GPUs per node.",
                    seen=f"{counts_src} ({tasks} tasks on this node), SLURM_GPUS_ON_NODE={gpus}",
                    hint=f"Use --ntasks-per-node={gpus} (one task per GPU), "
                         "or --ntasks-per-node=1 and let ddprun start one process per GPU.",
                )
        missing = [k for k in ("SLURM_PROCID", "SLURM_LOCALID") if k not in environ]
        if missing:
            raise ClusterError(
                "Several SLURM tasks per node, but this process has no task rank: it was not started by srun.",
                seen=f"{counts_src}, " + ", ".join(f"{k}=<unset>" for k in missing),
                hint="Start ddprun with srun, or use --ntasks-per-node=1.",
            )
        rank, local_rank = env_int(environ, "SLURM_PROCID"), env_int(environ, "SLURM_LOCALID")
        ntasks = next((k for k in (keys.ntasks, "SLURM_NTASKS") if k in environ), None)
        if ntasks is not None:
            world = Fact(env_int(environ, ntasks, minimum=1), f"{ntasks}={environ[ntasks]}")
            if world.value != sum(counts):
                raise ClusterError(
                    f"{ntasks} differs from the sum of the tasks per node.",
                    seen=f"{world.source}, {counts_src} (sum {sum(counts)})",
                    hint="Start ddprun with srun over the whole allocation, with --ntasks-per-node.",
                )
        else:
            world = Fact(sum(counts), f"sum of {counts_src}")
        check_rank_rule(
            rank, local_rank, world.value, node_id, tasks,
            seen=f"SLURM_PROCID={rank}, SLURM_LOCALID={local_rank}, SLURM_NODEID={node_id}, "
                 f"{world.source}, {counts_src}",
            hint="Use block distribution (srun --distribution=block, the default).",
        )
        return {
            "nproc_per_node": Fact(tasks, f"{counts_src} (tasks on node {node_id})"),
            "rank": Fact(rank, f"SLURM_PROCID={rank}"),
            "local_rank": Fact(local_rank, f"SLURM_LOCALID={local_rank}"),
            "world_size": world,
        }


def requeue_command(environ: Mapping[str, str]) -> list[str]:
    """``scontrol requeue <SLURM_JOB_ID>`` for ``ddprun run --requeue``; ConfigError, at the start of
    the launch, when this is no SLURM job or scontrol is not on PATH (found only at the end otherwise)."""
    import shutil

    job = environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise ConfigError("--requeue requeues the SLURM batch job this runs in, but this is not a SLURM job.",
                          seen=f"SLURM_JOB_ID={job!r}" if job else "SLURM_JOB_ID unset",
                          hint="Drop --requeue, or run `srun ddprun run --requeue ...` inside an sbatch job "
                               "(ddprun slurm-template writes one).")
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol is None:
        raise ConfigError("--requeue needs SLURM's scontrol, which is not on PATH.",
                          seen=f"PATH={environ.get('PATH', '')!r}",
                          hint="Add SLURM's bin directory to PATH, or drop --requeue.")
    return [scontrol, "requeue", job]


TEMPLATE_PREEMPT_LEAD_S = 120
"""Seconds before the time limit at which the template has SLURM send SIGUSR1 to every `ddprun run`."""
TEMPLATE_MIN_LEAD_S = 30


def _preempt_comment(lead: int, requeue: bool) -> list[str]:
    lines = [f"# {lead} s before the time limit SLURM sends SIGUSR1 to every `ddprun run` (it may come up to",
             "# 60 s early): every rank stops after one agreed step with ddprun.fit's checkpoint, within",
             f"# {lead * 3 // 4} s (--preempt-grace)."]
    if requeue:
        lines.append("# Then node 0 requeues the job (--requeue): it resumes from that checkpoint, output appended.")
    return lines


TEMPLATE_CPUS_PER_GPU = 8
"""--cpus-per-task in the sbatch template when none is given: per GPU, for its process and its
DataLoader workers (the one task on a node runs all of the node's processes)."""


def sbatch_script(script: str = "train.py", args: Sequence[str] = (), *, nodes: int = 5, gpus_per_node: int = 4,
                  cpus_per_task: int | None = None, time: str = "01:00:00", partition: str | None = None,
                  job_name: str = "ddprun", preempt_lead: int = TEMPLATE_PREEMPT_LEAD_S, requeue: bool = True) -> str:
    """A ready-to-submit sbatch script: ``nodes`` x ``gpus_per_node`` processes, one ``ddprun run`` per node.

    One task per node (``--ntasks-per-node=1``): each ``ddprun run`` reads the topology from SLURM
    and starts one process per GPU, so the ``srun`` line has no topology flags. ``cpus_per_task``:
    the CPUs of that one task, default ``TEMPLATE_CPUS_PER_GPU`` x ``gpus_per_node``; passed on to
    srun through SRUN_CPUS_PER_TASK (srun 22.05+ does not inherit it from sbatch). ``script`` and
    ``args`` are shell-quoted. Pure; ConfigError for counts below 1.

    ``preempt_lead``: seconds before the time limit at which SLURM sends every ``ddprun run`` SIGUSR1
    (``--signal=USR1@N``, to the steps, not ``B:`` the batch shell); they stop at one step with a
    checkpoint within a grace of 3/4 of it. ``requeue``: ``--requeue`` on both sides, so the job goes
    back in the queue and resumes (output appended). ``preempt_lead=0``: neither.
    """
    if preempt_lead < 0 or 0 < preempt_lead < TEMPLATE_MIN_LEAD_S:
        raise ConfigError(f"--preempt-lead takes 0 (none) or at least {TEMPLATE_MIN_LEAD_S} seconds.",
                          seen=f"--preempt-lead {preempt_lead}",
                          hint="e.g. --preempt-lead 120: SLURM may send it up to 60 s early, and the checkpoint "
                               "must fit in the rest.")
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--cpus-per-task", cpus_per_task)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1.", seen=f"{flag} {value}",
                              hint="The template is for GPU jobs: e.g. --nodes 5 --gpus-per-node 4.")
    cpus = cpus_per_task if cpus_per_task is not None else TEMPLATE_CPUS_PER_GPU * gpus_per_node
    world = nodes * gpus_per_node
    directives = [f"--job-name={job_name}", f"--nodes={nodes}", "--ntasks-per-node=1",
                  f"--gpus-per-node={gpus_per_node}", f"--cpus-per-task={cpus}", f"--time={time}"]
    if partition:
        directives.append(f"--partition={partition}")
    directives.append("--output=%x-%j.out")
    run_flags: list[str] = []
    if preempt_lead:
        directives.append(f"--signal=USR1@{preempt_lead}")
        run_flags += ["--preempt-grace", str(preempt_lead * 3 // 4)]
        if requeue:
            directives += ["--requeue", "--open-mode=append"]
            run_flags.insert(0, "--requeue")
    command = shlex.join(["srun", "ddprun", "run", *run_flags, script, *args])
    return "\n".join([
        "#!/bin/bash",
        f"# ddprun under SLURM: {count(nodes, 'node')} x {count(gpus_per_node, 'GPU')} = {world} processes. "
        "Submit with: sbatch THIS_FILE",
        "#",
        "# srun starts one `ddprun run` per node. Each reads the job from SLURM: the nodes",
        "# (SLURM_JOB_NUM_NODES, SLURM_JOB_NODELIST), its node rank (SLURM_NODEID), the rendezvous host",
        f"# (the first host of the nodelist) and port ({DERIVED_PORT_BASE} + SLURM_JOB_ID % {DERIVED_PORT_SPAN}), "
        "and the processes",
        "# per node (SLURM_GPUS_ON_NODE: one per GPU). The run directory is runs/slurm-<job id>.",
        "# SLURM older than 19.05 has no --gpus-per-node: use --gres=gpu:N instead.",
        *(_preempt_comment(preempt_lead, requeue) if preempt_lead else []),
        *(f"#SBATCH {d}" for d in directives),
        "",
        "# sbatch passes on the environment it was submitted from: activate the one with ddprun and",
        "# torch before submitting, or here (e.g. source .venv/bin/activate).",
        "",
        "# srun (SLURM 22.05 and later) does not take --cpus-per-task from sbatch; without this every",
        "# node's processes would share one CPU.",
        'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"',
        "",
        command,
        "",
    ])
