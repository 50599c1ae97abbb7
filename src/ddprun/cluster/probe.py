"""The I/O behind detection: this node's hostname, addresses, CPUs and CUDA devices (the one node probe)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from ddprun._util import cpu_count
from ddprun.cluster.base import NodeFacts


def _node_addresses(hostname: str) -> tuple[str, ...]:
    """This node's addresses: its name resolved, and every interface's addresses (netaddr).

    Best effort: whatever fails is left out, so a node without DNS still starts.
    """
    from ddprun.cluster.netaddr import interface_addresses

    found: list[str] = []
    try:
        found += [str(info[4][0]) for info in socket.getaddrinfo(hostname, None)]
    except (OSError, UnicodeError):
        pass
    for addrs in interface_addresses().values():
        found += addrs
    return tuple(dict.fromkeys(found))


def probe_node(environ: Mapping[str, str]):
    """The I/O behind detection: hostname (DDPRUN_HOSTNAME overrides it), addresses, CPUs, CUDA devices."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    hostname = environ.get("DDPRUN_HOSTNAME") or socket.gethostname()
    return NodeFacts(hostname=hostname, cpus=cpu_count(), cuda_devices=gpus, addresses=_node_addresses(hostname))
