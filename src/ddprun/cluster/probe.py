"""The I/O behind detection: this node's hostname, addresses, CPUs and CUDA devices (the one node probe)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping

from ddprun import cpus
from ddprun.cluster.base import ClusterSpec, NodeFacts
from ddprun.errors import ConfigError


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


GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
"""A node without any of these has no NVIDIA (driver or container), AMD ROCm or WSL GPU: torch would
count no CUDA device there."""


def cuda_devices(device_files: tuple[str, ...] = GPU_DEVICE_FILES) -> int:
    """CUDA devices torch sees (after CUDA_VISIBLE_DEVICES). On a node without a GPU device file this is
    0 without importing torch, which costs the agent ~3 s of CPU before its standbys can start."""
    if "torch" not in sys.modules and not any(os.path.exists(f) for f in device_files):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


NVIDIA_DRIVER = "/proc/driver/nvidia/version"


def unused_gpus(gpus: int, environ: Mapping[str, str], driver_file: str = NVIDIA_DRIVER) -> str:
    """Why torch sees no CUDA device on a node whose NVIDIA driver is loaded ('' when it sees some,
    when there is no driver, or when CUDA_VISIBLE_DEVICES hides them on purpose)."""
    if gpus or "torch" not in sys.modules or not os.path.exists(driver_file):
        return ""
    if "CUDA_VISIBLE_DEVICES" in environ:
        from ddprun.cluster._values import visible_gpus

        if visible_gpus(environ) is None:  # -1, NoDevFiles, empty: the GPUs are hidden on purpose
            return ""
    import torch

    try:
        with open(driver_file) as fp:
            driver = " ".join(fp.readline().split()[:8])
    except OSError:
        driver = "an NVIDIA driver"
    if not torch.version.cuda:
        why = f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch to use the GPUs"
    else:
        why = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use them: check nvidia-smi, a driver "
               "older than that CUDA, and that the job was given GPUs")
    return f"this node has {driver}, but torch sees no CUDA device, so it trains on cpu: {why}."


def probe_node(environ: Mapping[str, str]):
    """The I/O behind detection: hostname (DDPRUN_HOSTNAME overrides it), addresses, CPUs, CUDA devices."""
    gpus = cuda_devices()
    hostname = environ.get("DDPRUN_HOSTNAME") or socket.gethostname()
    mine = cpus.probe()
    return NodeFacts(hostname=hostname, cpus=mine.usable, cuda_devices=gpus, addresses=_node_addresses(hostname),
                     cpus_note=mine.note(), unused_gpus=unused_gpus(gpus, environ))


def check_endpoint(spec: ClusterSpec) -> None:
    """Refuse an endpoint that cannot work, before anything starts: port 0 across nodes (each node
    would pick its own), or a rendezvous host whose name does not resolve."""
    check_shared_port(spec)
    try:
        socket.getaddrinfo(spec.master_addr, None)
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"The rendezvous host {spec.master_addr!r} does not resolve.", seen=f"{e}",
                          hint="check --rdzv-endpoint / --master-addr (every node's value must name the same "
                               "host, reachable from every node), or give its IP address.") from None


def check_shared_port(spec: ClusterSpec) -> None:
    """Port 0 (a free port) across nodes is refused: every node would pick its own. ``ddprun plan``
    checks it too: unlike the host's name lookup, it needs no network."""
    if spec.max_nodes > 1 and spec.master_port == 0:
        raise ConfigError("Port 0 (a free port) cannot be the rendezvous port of a multi-node job: every node "
                          "would pick a different one.", seen=f"port 0 for {spec.max_nodes} nodes "
                          f"(<- {spec.sources.get('master_port', 'the flags')})",
                          hint="give every node the same port, e.g. --rdzv-endpoint HOST:29500 or --master-port 29500.")
