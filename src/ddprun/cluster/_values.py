"""Small readers shared by the cluster environments: integers and ports from a mapping, the rank rule.

Each raises ClusterError naming the variable and its value, so no environment repeats the wording.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddprun.cluster.base import Fact
from ddprun.cluster.netaddr import is_loopback
from ddprun.errors import ClusterError

DEFAULT_PORT = 29500
"""torchrun's default rendezvous port, used when an environment names no port."""

DERIVED_PORT_BASE = 15000
DERIVED_PORT_SPAN = 17000
"""A scheduler's job gets port ``BASE + job id % SPAN`` (15000-31999; SLURM, LSF): every node derives
the same one without talking. It stays below 32768, where Linux's default ephemeral range
(ip_local_port_range 32768-60999) starts: there an outgoing connection's local port could already
hold it, and the store's bind would fail, or admission would take another agent's for this job's."""


ARRAY_STRIDE = 1009
"""Ports between elements of one job array: a prime, so the first DERIVED_PORT_SPAN elements all differ,
and an element's port is that of a job id about 1009 x index later, not of the next job submitted."""


def derived_port(job_id: int, key: str, index: int = 0, index_key: str = "") -> Fact:
    """The rendezvous port derived from the job id in variable ``key`` (:data:`DERIVED_PORT_BASE`).

    ``index``: the element of a job array, from ``index_key`` (0: none). Elements share the job id
    and may run on one host, where one port for all would refuse every element but the first."""
    if not index:
        return Fact(DERIVED_PORT_BASE + job_id % DERIVED_PORT_SPAN,
                    f"{DERIVED_PORT_BASE} + {key} % {DERIVED_PORT_SPAN} ({key}={job_id})")
    return Fact(DERIVED_PORT_BASE + (job_id + ARRAY_STRIDE * index) % DERIVED_PORT_SPAN,
                f"{DERIVED_PORT_BASE} + ({key} + {ARRAY_STRIDE} x {index_key}) % {DERIVED_PORT_SPAN} "
                f"({key}={job_id}, {index_key}={index})")


def env_value(environ: Mapping[str, str], key: str) -> str | None:
    """``environ[key]`` stripped; None when unset or blank. A launcher that forwards an unset shell
    variable exports it empty (``mpirun -x MASTER_ADDR=$UNSET``): read as a value, '' became the
    rendezvous host, refused later as "'' does not resolve" without naming the variable."""
    value = environ.get(key, "").strip()
    return value or None


def env_int(environ: Mapping[str, str], key: str, minimum: int = 0) -> int:
    """``int(environ[key])``, at least ``minimum``; the key must be present."""
    raw = environ[key]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ClusterError(f"{key} is not a whole number.", seen=f"{key}={raw!r}",
                           hint=f"Unset {key} or give a whole number.") from None
    if value < minimum:
        raise ClusterError(f"{key} must be at least {minimum}.", seen=f"{key}={raw!r}",
                           hint=f"Check the launcher or the script that set {key}.")
    return value


def env_port(environ: Mapping[str, str], key: str = "MASTER_PORT") -> int:
    """A TCP port from ``environ[key]`` (1-65535)."""
    port = env_int(environ, key, minimum=1)
    if port > 65535:
        raise ClusterError(f"{key} is not a TCP port.", seen=f"{key}={environ[key]!r}",
                           hint="Give a free port in 1-65535, e.g. 29500.")
    return port


def check_rank_rule(rank: int, local_rank: int, world_size: int, node_rank: int, nproc: int,
                    seen: str, hint: str) -> None:
    """One process per rank must follow ddprun's plan: rank = node rank × nproc + local rank.

    A launcher that places ranks round-robin (SLURM ``--distribution=cyclic``, ``mpirun --map-by
    node``) would give a rank table different from the printed plan, so it is refused.
    """
    if not 0 <= rank < world_size:
        raise ClusterError("The rank is outside the world size.", seen=seen,
                           hint="Ranks run from 0 to world size - 1; check the launcher that set them.")
    if not 0 <= local_rank < nproc:
        raise ClusterError("The local rank is outside the processes on this node.", seen=seen,
                           hint="Local ranks run from 0 to processes per node - 1; check the launcher.")
    if rank != node_rank * nproc + local_rank:
        raise ClusterError(
            f"Ranks are not placed node by node: rank {rank} should be node rank {node_rank} x {nproc} "
            f"+ local rank {local_rank} = {node_rank * nproc + local_rank}.",
            seen=seen, hint=hint,
        )


def _strtoul(entry: str) -> int:
    """The number an entry starts with, as C's strtoul reads it (``1gpu`` is 1); -1 when none."""
    m = re.match(r"[+-]?\d+", entry)
    return int(m.group()) if m else -1


def visible_devices(raw: str) -> list[int] | list[str]:
    """CUDA_VISIBLE_DEVICES's entries as CUDA reads them, by torch.cuda._parse_visible_devices' rules:
    ``GPU-``/``MIG-`` UUIDs (or unique prefixes of them) up to the first entry of another kind, else
    ordinals, each read as strtoul does, up to the first negative or non-number (``-1``, SLURM's
    ``NoDevFiles``). A repeated entry makes the list empty: CUDA then shows no device."""
    if raw.startswith(("GPU-", "MIG-")):
        names: list[str] = []
        for entry in raw.split(","):
            if entry in names:
                return []
            if not entry.startswith(raw[:4]):
                break
            names.append(entry)
        return names
    ordinals: list[int] = []
    for entry in raw.split(","):
        number = _strtoul(entry.strip())
        if number in ordinals:
            return []
        if number < 0:
            break
        ordinals.append(number)
    return ordinals


def visible_gpus(environ: Mapping[str, str]) -> Fact | None:
    """How many GPUs CUDA_VISIBLE_DEVICES names, counted as CUDA reads it (:func:`visible_devices`);
    None when unset or it names none (``-1``, ``NoDevFiles``, a repeated entry)."""
    raw = environ.get("CUDA_VISIBLE_DEVICES", "")
    used = visible_devices(raw) if raw.strip() else []
    if not used:
        return None
    entries = raw.split(",")
    stop = f": CUDA stops at {entries[len(used)].strip()!r}" if len(used) < len(entries) else ""
    return Fact(len(used), f"CUDA_VISIBLE_DEVICES={raw} ({count(len(used), 'GPU')}{stop})")


def refuse_loopback_master(addr: str, nnodes: int, nodes_seen: str, job: str, hint: str) -> None:
    """ClusterError for a loopback MASTER_ADDR in a job of several nodes (left over from a one-node
    recipe, or passed on from the submit shell): every node would dial itself, or host a store of its
    own, and wait out the join timeout with no cause named. ``job`` names the launch, e.g. "SLURM job"."""
    if nnodes > 1 and is_loopback(addr):
        raise ClusterError(
            f"MASTER_ADDR is a loopback address, but the {job} spans several nodes: the others cannot reach it.",
            seen=f"MASTER_ADDR={addr}, {nodes_seen}", hint=hint)


def split_endpoint(raw: str, key: str) -> tuple[str, int | None]:
    """``host:port``, ``[v6addr]:port`` or ``host`` (port None) from the variable ``key``."""
    value = raw.strip()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else rest
    elif value.count(":") == 1:
        host, port_s = value.split(":")
    else:
        host, port_s = value, ""
    port = None
    if port_s:
        port = int(port_s) if port_s.isdigit() else -1
    if not host or (port is not None and not 0 < port <= 65535):
        raise ClusterError(f"{key} is not HOST:PORT.", seen=f"{key}={raw!r}",
                           hint="Expected e.g. myjob-master-0:29400; check the job's spec.")
    return host, port


def count(n: int, noun: str) -> str:
    """``count(1, "host")`` -> ``1 host``; ``count(6, "host")`` -> ``6 hosts``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
