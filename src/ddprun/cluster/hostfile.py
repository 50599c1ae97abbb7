"""A hostfile given with ``--hostfile PATH``: the same file on every node, ``ddprun run`` once on each.

The format is DeepSpeed's and Open MPI's: one host per line, ``host slots=N``; ``#`` starts a comment,
blank lines are skipped, ``max_slots=8`` is ignored, any other item (a typo like ``slot=8``) is an error. Selected by the flag,
never by the environment (``detect`` is always false; resolve() picks it when --hostfile is given).

node rank = the line of the host that is this node: its hostname (or short name), or one of its
addresses (NodeFacts.addresses), compared without case. master = the first host, nproc_per_node =
slots (the same on every line, or left to ddprun's default when no line gives slots). Rendezvous is
static. Loopback names (localhost, 127.0.0.1) match any node, so they are accepted only in a
one-host file.
"""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from ddprun.cluster._values import count
from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading
from ddprun.errors import ClusterError

LOOPBACK = ("localhost", "127.0.0.1", "::1", "localhost.localdomain", "ip6-localhost")


@dataclass(frozen=True)
class HostLine:
    host: str
    slots: int | None
    line: int


def load_hostfile(path: str) -> str:
    """The file's text (the one read this environment does)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ClusterError("The hostfile cannot be read.", seen=f"--hostfile {path}: {e.strerror or e}",
                           hint="Give a path that exists on every node (lines like `node1 slots=4`).") from None


KNOWN_ITEMS = ("slots", "max_slots", "max-slots")
"""``key=value`` items of a line: slots (processes on that host); Open MPI's max_slots is ignored."""


def parse_hostfile(text: str, path: str) -> list[HostLine]:
    """Hosts in file order; ClusterError on a malformed line, a repeated host, or no host at all."""
    hosts: list[HostLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        slots = None
        for item in words[1:]:
            key, sep, value = item.partition("=")
            if not sep:
                raise ClusterError(f"Hostfile line {number} is not `host slots=N`.",
                                   seen=f"{path}:{number}: {raw.strip()!r}", hint="One host per line, e.g. `node1 slots=4`.")
            if key == "slots":
                if not value.isdigit() or int(value) < 1:
                    raise ClusterError(f"Hostfile line {number}: slots is not a positive number.",
                                       seen=f"{path}:{number}: {raw.strip()!r}", hint="e.g. `node1 slots=4`.")
                slots = int(value)
            elif key not in KNOWN_ITEMS:
                close = difflib.get_close_matches(key, KNOWN_ITEMS, n=1)
                raise ClusterError(f"Hostfile line {number}: unknown item {item!r}.", seen=f"{path}:{number}: "
                                   f"{raw.strip()!r}", hint=(f"did you mean {close[0]}={value}? " if close else "")
                                   + "Lines are `host slots=N` (max_slots=M is accepted and ignored).")
        if any(h.host.lower() == words[0].lower() for h in hosts):
            raise ClusterError(f"Hostfile line {number} repeats a host.", seen=f"{path}:{number}: {raw.strip()!r}",
                               hint="List each node once, with all its slots.")
        hosts.append(HostLine(words[0], slots, number))
    if not hosts:
        raise ClusterError("The hostfile names no host.", seen=f"--hostfile {path}",
                           hint="One host per line, e.g. `node1 slots=4`.")
    return hosts


def _short(name: str) -> str:
    """``node1.cluster.local`` -> ``node1``; an IP address stays whole."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        return name.split(".")[0]


def node_names(node: NodeFacts) -> set[str]:
    """Every name and address this node may be listed under, lower case."""
    names = {node.hostname.lower(), _short(node.hostname.lower())}
    return names | {a.lower() for a in node.addresses}


def _is_me(host: str, names: set[str]) -> bool:
    host = host.lower()
    return host in LOOPBACK or host in names or _short(host) in names


class HostfileEnvironment(ClusterEnvironment):
    name = "hostfile"

    def __init__(self, path: str | None = None):
        self.path = path

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return False  # chosen by --hostfile in resolve(), never by the environment

    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        if not self.path:
            raise ClusterError("The hostfile environment needs a file.", seen="no --hostfile",
                               hint="Give --hostfile PATH.")
        hosts = parse_hostfile(load_hostfile(self.path), self.path)
        listed = ", ".join(h.host for h in hosts)
        if len(hosts) > 1:
            loop = [h for h in hosts if h.host.lower() in LOOPBACK]
            if loop:
                raise ClusterError(
                    "A multi-host hostfile names a loopback address, which is a different machine on every node.",
                    seen=f"{self.path}:{loop[0].line}: {loop[0].host} (hosts: {listed})",
                    hint="List every node by a name or address the other nodes can reach.",
                )
        names = node_names(node)
        mine = [i for i, h in enumerate(hosts) if _is_me(h.host, names)]
        if len(mine) != 1:
            what = "This node is not in the hostfile." if not mine else "Several hostfile lines match this node."
            raise ClusterError(
                what, seen=f"hosts in {self.path}: {listed}; this node: {', '.join(sorted(names))}",
                hint="List this node under its hostname or one of its addresses, once "
                     "(DDPRUN_HOSTNAME overrides the name ddprun uses).",
            )
        slots = {h.slots for h in hosts}
        if len(slots) > 1:
            raise ClusterError(
                "The hostfile gives the nodes different slots; ddprun needs the same count on every node.",
                seen=", ".join(f"{h.host} slots={h.slots if h.slots is not None else '<unset>'}" for h in hosts),
                hint="Give every line the same slots=N (N = GPUs per node).",
            )
        rank = mine[0]
        nnodes = Fact(len(hosts), f"--hostfile {self.path} ({count(len(hosts), 'host')})")
        reading: Reading = {
            "min_nodes": nnodes,
            "max_nodes": nnodes,
            "node_rank": Fact(rank, f"line {hosts[rank].line} of {self.path}: {hosts[rank].host}"),
            "master_addr": Fact(hosts[0].host, f"first host of {self.path}"),
            "rdzv_backend": Fact("static", f"node ranks known from the lines of {self.path}"),
        }
        if hosts[0].slots is not None:
            reading["nproc_per_node"] = Fact(hosts[0].slots, f"slots={hosts[0].slots} in {self.path}")
        return reading
