"""A process's open-files limit (RLIMIT_NOFILE): raised to what the job needs before anything starts,
and said on the console when the hard limit is below it.

Why: the process that hosts the job's store holds one socket per client, and torch's TCPStore server
drops the connections past its process's limit without a word: those clients retry, then fail with
"Connection reset by peer" (read as an echo of some other failure) after their timeout, and an agent
fails with ``OSError: [Errno 24] Too many open files``. Measured with ``ss`` on the store ports: under
``ddprun run`` (2 x 2) each rank holds 3 connections to the workers' store (torch's group store and
ddprun's two channels), each agent 2 there and 4 to the rendezvous store, and both stores live in one
agent when group rank 0 hosts the endpoint; under srun/mpirun with ``ddprun.init()`` (1 x 4), rank 0
hosts the store and each rank holds 1. A soft limit of 1,024, common on bare-metal clusters, ends an
agent's store at about 300 ranks; the hard limit is usually far higher, and raising the soft limit up
to it needs no privilege (Ray and the JVM do the same at start).
"""

from __future__ import annotations

import errno
import resource
from dataclasses import dataclass

FILES_PER_RANK = 3
"""Sockets a rank holds to the workers' store (measured, see the module docstring)."""
FILES_PER_NODE = 6
"""Sockets an agent holds to the stores: 2 to the workers', 4 to the rendezvous'."""
FILES_OWN = 256
"""The hosting process's own files: its store clients, node store, log files, pipes, torch's."""
FILES_PER_LOCAL_RANK = 16
"""The agent's files per local worker: its log files, pipes and node-store connections."""
RAISE_IT = ("nofile in /etc/security/limits.conf, LimitNOFILE= for a systemd service, `--ulimit nofile=N` "
            "for docker; a SLURM job takes the submitting shell's (`ulimit -n` there)")
"""How to raise the hard limit, for both HINTs."""
FLOOR = 65536
"""The soft limit is raised at least this far (within the hard limit): room for the workers' own
files too (a DataLoader passing tensors through file descriptors), whatever the job's size."""


@dataclass(frozen=True)
class Limits:
    soft: int
    hard: int
    """RLIM_INFINITY as -1."""


def needed(world_size: int, nnodes: int, nproc_per_node: int) -> int:
    """Open files the agent hosting the job's stores needs, at most (every rank and agent connected)."""
    return FILES_PER_RANK * world_size + FILES_PER_NODE * nnodes + FILES_OWN + FILES_PER_LOCAL_RANK * nproc_per_node


def needed_without_agent(world_size: int) -> int:
    """Open files rank 0 needs to host the store of a job without agents (srun/mpirun, ``ddprun.init()``)."""
    return world_size + FILES_OWN


def target(soft: int, hard: int, want: int) -> int:
    """The soft limit to set: ``want`` (at least FLOOR), never below ``soft`` nor above ``hard``
    (-1: unlimited)."""
    want = max(want, FLOOR)
    if soft == resource.RLIM_INFINITY:
        return soft
    return max(soft, want if hard == resource.RLIM_INFINITY else min(hard, want))


def raise_soft_limit(want: int = FLOOR) -> Limits:
    """Raise this process's soft open-files limit toward ``want`` (:func:`target`); workers started
    later inherit it. A limit that cannot be set (a sandbox) is left as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = target(soft, hard, want)
    if new != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (OSError, ValueError):
            new = soft
    return Limits(new, hard)


def too_low(limits: Limits, need: int, job: str, host: str) -> str | None:
    """The console's warning when ``limits`` are below ``need``; else None. ``job``: e.g. "8192 ranks
    on 1024 node(s)"; ``host``: which process hosts the store, and what each client costs it."""
    if limits.soft == resource.RLIM_INFINITY or limits.soft >= need:
        return None
    return (f"ddprun: warning: this job ({job}) needs about {need} open files {host}; this node's limit is "
            f"{limits.soft} (ulimit -n; hard limit {limits.hard}). Past it the store drops connections: ranks "
            f"fail with 'Connection reset by peer' after their timeout, or the process with 'Too many open "
            f"files'. HINT: raise the hard limit on every node to at least {need}: "
            f"{RAISE_IT.replace('nofile=N', f'nofile={need}')}.")


def agent_warning(limits: Limits, world_size: int, nnodes: int, nproc_per_node: int) -> str | None:
    """:func:`too_low` for the agent that may host the job's stores (any node may: group rank 0 hosts
    the workers' store)."""
    return too_low(limits, needed(world_size, nnodes, nproc_per_node), f"{world_size} ranks on {nnodes} node(s)",
                   f"on the node that hosts its stores, if this one does ({FILES_PER_RANK} a rank, "
                   f"{FILES_PER_NODE} a node, and the agent's own)")


def exhausted_hint(e: BaseException) -> str:
    """A HINT line for an ``OSError`` EMFILE (this process ran out of open files); else ""."""
    if not (isinstance(e, OSError) and e.errno == errno.EMFILE):
        return ""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"\nHINT: this process ran out of open files at its limit of {soft} (ulimit -n; hard limit {hard}); "
            f"raise the hard limit on every node: {RAISE_IT}.")
