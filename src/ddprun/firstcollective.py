"""A bounded first collective right after ``init_process_group``: a wrong interface or transport is
named within seconds instead of hanging in the first NCCL collective, whose wait ignores the
process-group timeout (pytorch#124950).

Two phases, so that a slow rank is not mistaken for a broken network:
1. arrival, through the process group's store (TCP, already working): every rank counts itself in
   and waits, bounded by the generous init timeout, until all have (ranks may still be importing);
2. one 1-element all_reduce over the new backend, bounded by the short probe timeout and run in a
   daemon thread (a blocked NCCL collective cannot be interrupted). gloo runs it under that timeout
   too, so its op ends by itself; after a failure the group is destroyed (gloo) or aborted (NCCL):
   a gloo op left blocked at interpreter exit aborts the process (SIGABRT) after the clear error.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Mapping
from datetime import timedelta

from ddprun.errors import ClusterError, ConfigError
from ddprun.protocol.defaults import MAX_SECONDS

DEFAULT_TIMEOUT_S = 30.0
"""Seconds the first all_reduce may take once every rank has arrived (NCCL connects here)."""
TIMEOUT_ENV = "DDPRUN_FIRST_COLLECTIVE_TIMEOUT"
ARRIVAL_KEY = "ddprun/first_collective"
GLOO_END_S = 2.0
"""Seconds past the probe timeout to wait for gloo's own timeout to end the probe's op."""
LEAVE_S = 5.0
"""At most this long to destroy (gloo) or abort (NCCL) the group after a failed probe."""


def probe_timeout(environ: Mapping[str, str]) -> float:
    """Seconds for the first collective from DDPRUN_FIRST_COLLECTIVE_TIMEOUT (default 30; 0 = no probe).
    nan, inf or a number past MAX_SECONDS is refused here: timedelta would raise on every rank."""
    raw = environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
        raise ConfigError(f"{TIMEOUT_ENV} must be a finite number of seconds from 0 to {MAX_SECONDS:g}.",
                          seen=f"{TIMEOUT_ENV}={raw!r}",
                          hint=f"e.g. {TIMEOUT_ENV}=30, or 0 to skip the first-collective check.")
    return value


def transport_seen(backend: str, environ: Mapping[str, str], host: str, addresses: Mapping[str, tuple]) -> str:
    """The transport settings in use, for the error: backend, interfaces, MASTER_ADDR:PORT, this host."""
    ifnames = ", ".join(f"{k}={environ[k]!r}" if environ.get(k) else f"{k} unset (the library picks)"
                        for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"))
    here = "; ".join(f"{name} {', '.join(a)}" for name, a in addresses.items() if a) or "no address found"
    return (f"backend {backend}; {ifnames}; MASTER_ADDR:MASTER_PORT={environ.get('MASTER_ADDR', '?')}:"
            f"{environ.get('MASTER_PORT', '?')}; this rank {environ.get('RANK', '?')} on {host} ({here})")


def _failure(what: str, backend: str, environ: Mapping[str, str]) -> ClusterError:
    from ddprun.cluster.netaddr import interface_addresses

    try:
        addresses = interface_addresses()
    except OSError:
        addresses = {}
    hint = ("the ranks reach each other's store but not each other's transport: set "
            f"{'NCCL' if backend == 'nccl' else 'GLOO'}_SOCKET_IFNAME on every node to the interface that reaches "
            "the other nodes (ip -br addr), and open the ports between nodes (firewall, security group)"
            + ("; NCCL_DEBUG=INFO shows the interface and transport NCCL picked" if backend == "nccl" else "") + ".")
    return ClusterError(what, seen=transport_seen(backend, environ, socket.gethostname(), addresses), hint=hint)


def _arrive(store, world_size: int, timeout_s: float) -> None:
    """Count this rank in; wait until all ``world_size`` ranks of this round have. The counter only
    grows, so a store that outlives one group (a restart under plain torchrun) keeps rounds apart."""
    n = store.add(ARRIVAL_KEY, 1)
    round_no = (n - 1) // world_size
    done = f"{ARRIVAL_KEY}/done/{round_no}"
    if n % world_size == 0:
        store.set(done, "1")
    store.wait([done], timedelta(seconds=timeout_s))


def _all_reduce(device) -> float:
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)  # the current device is per thread
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    return float(t.item())  # .item() waits for the GPU too


def first_collective(device, backend: str, world_size: int, environ: Mapping[str, str], *,
                     arrival_timeout_s: float, timeout_s: float) -> None:
    """Every rank: wait (``arrival_timeout_s``) for all ranks, then all_reduce one element within
    ``timeout_s`` seconds. Raises ClusterError naming backend, interfaces and addresses otherwise."""
    import torch.distributed as dist

    if timeout_s <= 0:
        return
    store = dist.distributed_c10d._get_default_store()
    try:
        _arrive(store, world_size, arrival_timeout_s)
    except Exception as e:  # noqa: BLE001 - DistStoreError (timeout) or a lost store
        seen_n = store.add(ARRIVAL_KEY, 0) % world_size
        raise ClusterError(f"Only {seen_n} of {world_size} ranks joined the process group within "
                           f"{arrival_timeout_s:g} s.", seen=f"{type(e).__name__}: {e}",
                           hint="a rank is slow before ddprun.init() or has died; see its log.") from e
    if backend == "gloo":
        # gloo itself then ends the wait: a gloo op still blocked at interpreter exit aborts the process
        _set_timeout(timeout_s)
    box = _bounded_all_reduce(device, timeout_s, timeout_s + (GLOO_END_S if backend == "gloo" else 0.0))
    if "sum" in box and box["sum"] == world_size:
        if backend == "gloo":
            _set_timeout(arrival_timeout_s)
        return
    _leave_group(backend)
    if "sum" in box:
        raise _failure(f"The first collective summed to {box['sum']:g} instead of {world_size}: ranks of "
                       "different jobs or groups are mixed.", backend, environ)
    if "error" in box and box["seconds"] < timeout_s:
        raise _failure(f"The first collective ({backend} all_reduce of one element) failed: "
                       f"{type(box['error']).__name__}: {box['error']}", backend, environ) from box["error"]
    raise _failure(f"The first collective ({backend} all_reduce of one element) did not complete within "
                   f"{timeout_s:g} s, although all {world_size} ranks joined the process group.", backend, environ)


def _bounded_all_reduce(device, timeout_s: float, end_s: float) -> dict:
    """Run the all_reduce in a daemon thread (a blocked collective cannot be interrupted); return
    {"sum"} or {"error", "seconds"} (seconds after the start), or {} if it is still running after
    ``timeout_s``. Then wait until ``end_s`` for it to end by itself (gloo's own timeout)."""
    box: dict = {}
    start = time.monotonic()

    def run() -> None:
        try:
            box["sum"] = _all_reduce(device)
        except Exception as e:  # noqa: BLE001 - reported by the caller with the transport in use
            box["error"], box["seconds"] = e, time.monotonic() - start

    t = threading.Thread(target=run, name="ddprun-first-collective", daemon=True)
    t.start()
    t.join(timeout_s)
    result = dict(box)
    if "sum" not in result and "error" not in result:
        t.join(max(0.0, end_s - (time.monotonic() - start)))
        if "error" in box:
            result = {"error": box["error"], "seconds": box["seconds"]}
    return result


def _set_timeout(seconds: float) -> None:
    """The default group's collective timeout (gloo reads it when an op starts)."""
    from torch.distributed import distributed_c10d as c10d

    c10d._set_pg_timeout(timedelta(seconds=seconds))


def _leave_group(backend: str) -> None:
    """After a failed probe: end the group, bounded (LEAVE_S), so that init() leaves none behind.
    gloo: destroy (its probe op has ended); NCCL: abort, which also ends a blocked NCCL kernel."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    end = dist.destroy_process_group if backend == "gloo" else c10d._abort_process_group
    t = threading.Thread(target=end, name="ddprun-leave-group", daemon=True)
    t.start()
    t.join(LEAVE_S)
