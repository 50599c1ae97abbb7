"""This process's place in the job: ``init()`` joins the process group, ``rank_info()`` says who we are.

Where the numbers come from: :func:`ddprun.cluster.detect.resolve` over the environment mapping
(read once per call, never at import). A torchrun/``ddprun run`` worker states RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT itself; a cluster that starts one process per rank (srun
tasks, mpirun) states them in its own variables, which resolve() translates. A multi-node job that
starts the script once per node (srun with one task per node, a PyTorchJob pod, SageMaker) makes it
the node's rank (detect.one_rank_per_node). Otherwise, with no rank found (plain ``python script.py``; a
SkyPilot or LSF host running the script itself, said in one line by init()), this is one process and
no process group is created.

Timeouts are two-phase (torchtitan's ``init_distributed``/``set_pg_timeouts``):
joining the process group and the first step may be slow (every node imports torch, compiles,
loads data), so the group starts with a generous ``timeout``. After the first completed step
:func:`use_training_timeout` tightens it to ``train_timeout`` so that a rank that dies or hangs mid-run
is noticed within that time instead of half an hour later.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING

from ddprun.errors import ClusterError, ConfigError
from ddprun.pgkeep import keep_destroyed_groups, release_kept
from ddprun.protocol import defaults
from ddprun.protocol.env import WorkerEnv, device_kind, inside_worker, soft_exit
from ddprun.telemetry import setup_phase

if TYPE_CHECKING:
    import torch

    from ddprun.cluster.base import ClusterSpec

DEFAULT_INIT_TIMEOUT_S = defaults.INIT_TIMEOUT_S
"""Seconds for joining the process group and for every collective until the first step completes."""
DEFAULT_TRAIN_TIMEOUT_S = defaults.TRAIN_TIMEOUT_S
"""Seconds a collective may wait once training runs (torch's default: 30 min for gloo, 10 for NCCL)."""

EXPORTED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the job. One process without a process group: rank 0 of 1."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    """``cuda:<local_rank>`` when CUDA is available (and not turned off by DDPRUN_DEVICE_KIND=cpu), else cpu."""
    is_main: bool
    """True on global rank 0: the one rank that prints and saves."""
    distributed: bool = False
    """True when a process group exists (possibly of size 1)."""
    backend: str | None = None
    bound: bool = False
    """A per-process launcher gave this process one GPU of its own (``srun --gpus-per-task=1``, an mpirun
    wrapper's CUDA_VISIBLE_DEVICES): ``device`` is cuda:0 whatever the local rank, and the node's other
    GPUs are not visible here."""


@dataclass
class _State:
    info: RankInfo
    init_timeout_s: float
    train_timeout_s: float
    tightened: bool = False
    phase_timeout_s: float = 0.0
    """A wait on another rank's busy phase: at least ``init_timeout_s`` (:func:`use_phase_timeout`)."""
    users_group: bool = False
    """The process group was there before init (the user's, Lightning's): its timeout is left as set."""


_state: _State | None = None


def _node_facts():
    """The node probe resolve() needs (the only I/O here besides torch.cuda)."""
    import torch

    from ddprun import cpus
    from ddprun.cluster.base import NodeFacts

    gpus = torch.cuda.device_count()  # NVML where it answers: rank_info() initialises no CUDA
    mine = cpus.probe()
    return NodeFacts(hostname=socket.gethostname(), cpus=mine.usable, cuda_devices=gpus, cpus_note=mine.note())


def _use_cuda(environ: Mapping[str, str]) -> bool:
    import torch

    # The launcher decided cuda|cpu for the whole job; cpu there wins over a GPU seen here.
    return torch.cuda.is_available() and device_kind(environ) != "cpu"


def _device(local_rank: int | None, use_cuda: bool, bound: bool = False) -> torch.device:
    """``cuda:<local_rank>``; ``bound``: this process was given one GPU of its own (a per-process
    launcher set CUDA_VISIBLE_DEVICES for it: srun --gpus-per-task, an mpirun wrapper), so its one
    visible device, ``cuda:0``, whatever its local rank."""
    import torch

    if not use_cuda:
        return torch.device("cpu")
    if local_rank is None:  # a process group the user made without LOCAL_RANK: trust their set_device
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if bound and count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise ConfigError(
            "This process's local rank has no GPU of its own.",
            seen=f"LOCAL_RANK={local_rank}, {count} visible CUDA device(s)",
            hint="Start one process per GPU (leave --nproc-per-node out, or give at most the GPU count), "
                 "and check CUDA_VISIBLE_DEVICES.",
        )
    return torch.device("cuda", local_rank)


def _from_environ(environ: Mapping[str, str], per_node: bool = True, joining: bool = False):
    """(ClusterSpec, RankInfo-without-process-group) from the environment; pure apart from probing.
    ``per_node``: a process a multi-node job started once per node is that node's rank
    (detect.one_rank_per_node, which refuses what cannot join only when ``joining``); False when a
    process group exists already, whose ranks are the truth; else RANK/LOCAL_RANK an srun task
    inherited instead of its own are refused first (cluster.torchrun.check_slurm_task)."""
    from ddprun.cluster.detect import one_rank_per_node, resolve
    from ddprun.cluster.torchrun import check_slurm_task
    from ddprun.config import LaunchConfig

    if per_node:  # an existing group's ranks are the truth (Ray Train's, mp.spawn's under srun): not checked
        check_slurm_task(environ)
    spec = resolve(LaunchConfig(), environ, _node_facts())
    if per_node:
        spec = one_rank_per_node(spec, joining=joining)
    use_cuda = _use_cuda(environ)
    if spec.rank is None or spec.world_size is None:
        return spec, RankInfo(rank=0, local_rank=0, node_rank=0, world_size=1, local_world_size=1,
                              device=_device(0, use_cuda), is_main=True)
    local_rank = spec.local_rank if spec.local_rank is not None else 0
    local_world = spec.nproc_per_node or 1
    # resolve() drops GROUP_RANK under c10d (arrival order); torchrun's ranks are node-major with the
    # same process count on every node, so rank // local_world_size is that node rank.
    # Under --allow-uneven-nodes (or Ray Train's placement) the counts differ, so a torchrun-style
    # worker's GROUP_RANK (set by torch's agent after rendezvous), then NODE_RANK (Ray Train's), is read first.
    named = environ.get("GROUP_RANK", environ.get("NODE_RANK", "")) if spec.environment == "torchrun" else ""
    node_rank = (spec.node_rank if spec.node_rank is not None else
                 int(named) if named.isdigit() else spec.rank // local_world)
    bound = use_cuda and _bound(environ)
    info = RankInfo(rank=spec.rank, local_rank=local_rank, node_rank=node_rank, world_size=spec.world_size,
                    local_world_size=local_world, device=_device(local_rank, use_cuda, bound),
                    is_main=spec.rank == 0, bound=bound)
    return spec, info


def _bound(environ: Mapping[str, str]) -> bool:
    """Whether a per-process launcher gave this process one GPU of its own through
    CUDA_VISIBLE_DEVICES. Not under torch's agent (torchrun, ``ddprun run``: TORCHELASTIC_RUN_ID is
    set), which shows every worker the node's GPUs; an mpirun wrapper that exports RANK, LOCAL_RANK
    and WORLD_SIZE itself looks like torchrun to detection but is such a launcher."""
    from ddprun.cluster._values import visible_gpus

    seen = visible_gpus(environ)
    return "TORCHELASTIC_RUN_ID" not in environ and seen is not None and seen.value == 1


def _export(spec, target: MutableMapping[str, str]) -> None:
    """Write what ``init_method="env://"`` reads, for launchers that did not (srun, mpirun, a
    script a multi-node job starts once per node).

    The one place ddprun writes the environment of a running process. A value already present and
    different is an error rather than overwritten: two launchers disagree about this process. A blank
    one (``mpirun -x MASTER_ADDR=$UNSET``) counts as unset, as detection read it, and is replaced.
    """
    wanted = {"MASTER_ADDR": str(spec.master_addr), "MASTER_PORT": str(spec.master_port),
              "RANK": str(spec.rank), "WORLD_SIZE": str(spec.world_size),
              "LOCAL_RANK": str(spec.local_rank if spec.local_rank is not None else 0)}
    clash = {k: (target[k], v) for k, v in wanted.items() if target.get(k, "").strip() not in ("", v)}
    if clash:
        raise ClusterError(
            f"The {spec.environment} environment and variables already set disagree about this process.",
            seen=", ".join(f"{k}={old} (set) vs {new} ({spec.environment})" for k, (old, new) in clash.items()),
            hint="Unset the stale variables, or start the script under one launcher only.",
        )
    target.update(wanted)  # what was there is equal, blank or unset


def _info_from_group(environ: Mapping[str, str]) -> RankInfo:
    """RankInfo for a process group somebody else created (Lightning, the user's own init)."""
    import torch.distributed as dist

    spec, env_info = _from_environ(environ, per_node=False)  # e.g. mp.spawn'ed ranks under srun 1 task/node
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = spec.local_rank if spec.rank is not None else None
    use_cuda = _use_cuda(environ)
    bound = use_cuda and _bound(environ)
    device = _device(local_rank, use_cuda, bound)
    local_world = env_info.local_world_size if spec.rank is not None else 1
    return RankInfo(rank=rank, local_rank=local_rank if local_rank is not None else 0,
                    node_rank=env_info.node_rank if spec.rank is not None else 0,
                    world_size=world, local_world_size=local_world, device=device, is_main=rank == 0,
                    distributed=True, backend=str(dist.get_backend()), bound=bound)


def init(backend: str | None = None, *, timeout: float = DEFAULT_INIT_TIMEOUT_S,
         train_timeout: float = DEFAULT_TRAIN_TIMEOUT_S, environ: Mapping[str, str] | None = None) -> RankInfo:
    """Join the job's process group (if it has one) and select this process's device.

    ``backend``: None picks ``nccl`` on CUDA and ``gloo`` on CPU. ``timeout``: seconds for joining
    and for collectives until :func:`use_training_timeout` is called, and while waiting for another
    rank's busy phase (:func:`use_phase_timeout`: under ``ddprun run`` at least 4 x --stall-timeout);
    ``train_timeout``: seconds after that. ``environ``: the environment to read, default
    ``os.environ`` (read now, not at import).

    Under srun/mpirun (resolve() found the rank in the cluster's own variables), or in a script a
    multi-node job starts once per node (its node rank is its rank: detect.one_rank_per_node), MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK are exported to ``os.environ`` before
    ``init_process_group(init_method="env://")``: the one explicit export ddprun does in a worker.

    Right after joining, one bounded all_reduce (:mod:`ddprun.firstcollective`; seconds from
    DDPRUN_FIRST_COLLECTIVE_TIMEOUT, default 30, 0 = off) names a blocked transport with its
    interface and addresses (ClusterError) instead of hanging in the first collective.

    The group init creates is destroyed at a normal interpreter exit (:func:`_destroy_at_exit`, at
    most 10 s; under ``ddprun run`` its hard exit does that job).

    Idempotent: a second call returns the first call's RankInfo. If a process group already exists
    (the user's, Lightning's) it is used as it is. On CUDA, ``torch.cuda.set_device`` is called.
    """
    global _state
    if _state is not None:
        return _state.info
    if timeout <= 0 or train_timeout <= 0:
        raise ConfigError("Process-group timeouts must be positive seconds.",
                          seen=f"timeout={timeout}, train_timeout={train_timeout}",
                          hint="e.g. timeout=600 (joining), train_timeout=300 (during training).")
    environ = os.environ if environ is None else environ
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        info = _info_from_group(environ)
        if info.device.type == "cuda":
            torch.cuda.set_device(info.device)
        _state = _State(info, timeout, train_timeout, users_group=True)
        return info

    spec, info = _from_environ(environ, joining=True)
    if spec.rank is None:
        from ddprun.cluster.detect import alone_note

        note = alone_note(spec)
        if note:
            print(note, file=sys.stderr, flush=True)
        _state = _State(info, timeout, train_timeout)
        return info
    backend = _join_group(spec, info, backend, timeout, environ)
    info = replace(info, distributed=True, backend=backend)
    _state = _State(info, timeout, train_timeout, phase_timeout_s=_phase_timeout(timeout, environ))
    return info


def _phase_timeout(timeout: float, environ: Mapping[str, str]) -> float:
    """``timeout``, or under ``ddprun run`` with the stall watch on the time it lets a busy phase last
    (WorkerEnv.busy_limit_s: BUSY_LIMIT_FACTOR x --stall-timeout) where that is longer."""
    wenv = WorkerEnv.from_environ(environ)
    if wenv is None or wenv.stall_timeout <= 0:
        return timeout
    return max(timeout, wenv.busy_limit_s)


def _join_group(spec: ClusterSpec, info: RankInfo, backend: str | None, timeout: float,
                environ: Mapping[str, str]) -> str:
    """:func:`init`'s join: the device, the exported variables, the group, the bounded first
    collective, and the exit handling of a script no ``ddprun run`` ends; the backend used."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("This torch build has no torch.distributed, but the job has several ranks.",
                          seen=f"RANK={info.rank}, WORLD_SIZE={info.world_size}",
                          hint="Install a torch build with distributed support (the PyPI wheels have it).")
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    backend = backend or ("nccl" if info.device.type == "cuda" else "gloo")
    _export(spec, os.environ)  # a no-op under torchrun/ddprun run, which set them all already
    if spec.environment != "torchrun":
        # srun/mpirun across hosts: gloo/NCCL must use the interface that reaches MASTER_ADDR, not the
        # hostname's address (127.0.0.1 in many containers). Nothing happens on one node (netaddr.py).
        from ddprun.cluster.netaddr import network_plan

        for key, value in network_plan(spec, os.environ).worker_env.items():
            os.environ.setdefault(key, value)
    from ddprun.firstcollective import first_collective, probe_timeout

    probe_s = probe_timeout(environ)
    _open_files(info, environ)
    ends_groups = not inside_worker(environ) or soft_exit(environ)  # ddprun run's hard exit skips that teardown
    if ends_groups:
        _import_dynamo()
    # device_id binds each rank to its GPU (NCCL connects eagerly, no rank lands on another's GPU)
    try:
        dist.init_process_group(backend=backend, init_method="env://", rank=info.rank, world_size=info.world_size,
                                timeout=timedelta(seconds=timeout),
                                device_id=info.device if info.device.type == "cuda" else None)
    except Exception as e:
        _raise_if_duplicate_gpu(e, info, environ)
        raise
    # gloo/NCCL read os.environ (exported above), so the error names what they really used
    with setup_phase():  # the probe is not the script's loop: its data preparation may follow
        first_collective(info.device, backend, info.world_size, os.environ, arrival_timeout_s=timeout,
                         timeout_s=probe_s)
    if ends_groups:
        keep_destroyed_groups()  # the script's own destroy_process_group too: released at exit, not freed mid-run
        atexit.register(_destroy_at_exit)
    return backend


def _raise_if_duplicate_gpu(error: BaseException, info: RankInfo, environ: Mapping[str, str]) -> None:
    """NCCL's "Duplicate GPU detected" named as the launch fault it is: two ranks were shown the same
    GPU (an mpirun wrapper or a scheduler that gives every rank of a node CUDA_VISIBLE_DEVICES=0, or
    two launches on one machine)."""
    if "Duplicate GPU detected" not in str(error):
        return
    cvd = environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    raise ClusterError(
        "Two ranks of this job were given the same GPU, and NCCL refuses to share one.",
        seen=f"rank {info.rank} (local rank {info.local_rank}) on {socket.gethostname()} uses {info.device}, "
             f"CUDA_VISIBLE_DEVICES={cvd}; NCCL: {str(error).strip().splitlines()[-1]}",
        hint="Give each rank of a node its own GPU: per rank, CUDA_VISIBLE_DEVICES=<its local rank> (or srun "
             "--gpus-per-task=1), or leave CUDA_VISIBLE_DEVICES unset and let ddprun pick cuda:<local rank>.",
    ) from error


def _open_files(info: RankInfo, environ: Mapping[str, str]) -> None:
    """Rank 0 of a job without an agent's store (srun/mpirun) hosts the group's store, one socket a
    rank: its open-files limit is raised to that, and a hard limit below it is said (openfiles.py)."""
    from ddprun.openfiles import needed_without_agent, raise_soft_limit, too_low

    if info.rank != 0 or environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    need = needed_without_agent(info.world_size)
    warning = too_low(raise_soft_limit(need), need, f"{info.world_size} ranks",
                      "in rank 0, which hosts the job's store (1 a rank, and its own)")
    if warning:
        print(warning, file=sys.stderr, flush=True)


def _import_dynamo() -> None:
    """Import ``torch._dynamo`` before the group exists. Its import records objects it finds in torch's
    modules, the default group among them (10 references, from containers the garbage collector does
    not see), which then outlives ``destroy_process_group`` and :func:`_destroy_at_exit` until the
    interpreter's finalization frees it. DDP imports it at construction anyway: this only moves the
    import (about 1 s) before the group."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - a torch without it, or a broken one: nothing it would record
        pass


DESTROY_AT_EXIT_S = 10.0
"""At most this long for :func:`_destroy_at_exit`; then the process exits without it."""


def _destroy_at_exit(limit_s: float = DESTROY_AT_EXIT_S) -> None:
    """End the process groups of a script that called :func:`init`, at a normal interpreter exit
    (atexit): destroy the group :func:`init` created if the script did not, then free every gloo group
    destroyed meanwhile (:func:`_end_groups`) while the interpreter still runs.

    Why: a gloo group still alive in the interpreter's finalization (never destroyed, or destroyed but
    held by the script's DDP model) can abort the rank with SIGABRT ("terminate called without an
    active exception", pytorch/pytorch#190489) after its work was done, which the launcher reports as
    a failed rank (pgkeep.py). The live group is not destroyed after an unhandled exception
    (``sys.last_value``): peers may still be inside a collective with this rank, and destroying then
    can block (NCCL); the groups the script destroyed itself are freed still. Bounded: it runs in a
    daemon thread for at most ``limit_s`` seconds."""
    failed = getattr(sys, "last_value", None) is not None
    t = threading.Thread(target=_end_groups, args=(not failed,), name="ddprun-end-groups", daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        print(f"ddprun: ending the process groups did not finish within {limit_s:g} s; "
              "exiting without it.", file=sys.stderr, flush=True)


def _end_groups(destroy: bool) -> None:
    """Destroy the default group if it lives (and ``destroy``); collect the script's garbage, so a
    DDP model in a reference cycle lets go of its group now and not in the finalization; then free
    the groups destroyed."""
    import gc

    import torch.distributed as dist

    if destroy and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    release_kept()


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """The current RankInfo, creating nothing: :func:`init`'s result once it ran, else what the
    process group (if somebody made one) or the environment says. Plain ``python``: rank 0 of 1."""
    if _state is not None:
        return _state.info
    environ = os.environ if environ is None else environ
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _info_from_group(environ)
    return _from_environ(environ)[1]


def _set_timeout(seconds: float) -> bool:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)  # private in torch; absent = keep the one timeout
    if setter is None or not dist.is_initialized():
        return False
    setter(timedelta(seconds=seconds))
    return True


def use_training_timeout() -> None:
    """After the first completed step: barrier, then collectives use ``train_timeout``.

    The barrier is why this is called once and by every rank: no rank may wait with the short
    timeout while another is still inside the slow first step (torchtitan ``set_pg_timeouts``).
    """
    import torch.distributed as dist

    if _state is None or _state.tightened or _state.users_group or not (dist.is_available() and dist.is_initialized()):
        return
    _barrier()
    _set_timeout(_state.train_timeout_s)
    _state.tightened = True


def use_phase_timeout() -> None:
    """The generous timeout, locally, before work one rank does while the others wait (a checkpoint
    write, ``fit(on_checkpoint=...)``): init's ``timeout``, or under ``ddprun run`` the stall watch's
    allowance for a busy phase where that is longer (:func:`_phase_timeout`), so that a write the
    stall watch lets run is not failed by the others' barrier. No collective: each rank's own waits
    use its own timeout; :func:`use_training_timeout` tightens it again. A group of the user's keeps
    its own."""
    if _state is None or _state.users_group:
        return
    if _set_timeout(max(_state.init_timeout_s, _state.phase_timeout_s)):
        _state.tightened = False


def _barrier() -> None:
    import torch.distributed as dist

    info = _state.info if _state is not None else None
    if info is not None and info.device.type == "cuda" and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[info.device.index])
    else:
        dist.barrier()


def barrier() -> None:
    """Wait for every rank; a no-op without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _barrier()


def _reset() -> None:
    """Forget init()'s result (tests); does not destroy a process group."""
    global _state
    _state = None
