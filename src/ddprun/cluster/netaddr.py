"""This node's part in a multi-host rendezvous: does it host the store, at which address do other
nodes reach it, and which interface do gloo and NCCL use.

torch guesses all three from the hostname, and on real hosts the guesses fail silently: a hostname
that resolves to 127.0.0.1 (``127.0.0.1 algo-1`` in /etc/hosts, common in containers) makes the host
of the rendezvous endpoint not see that it should host the store (every node hangs), makes rank 0
advertise ``localhost`` as MASTER_ADDR (the other nodes' workers hang in init_process_group), and
makes gloo bind 127.0.0.1 (the other nodes get "Connection refused"). So ddprun decides from the
addresses this node really has:

* **is_host**: the rendezvous host resolves (here) to a loopback address or to an address of one of
  this node's interfaces. Passed to torch's c10d rendezvous as ``is_host``; ``--rdzv-conf is_host=..``
  wins. Under static rendezvous node rank 0 hosts the store, so node rank 0 must be that host.
* **local address**: ``--local-addr``; else the address of the interface named by the user's
  GLOO_SOCKET_IFNAME (an exact name) / NCCL_SOCKET_IFNAME (name prefixes, or exact names after ``=``:
  the one interface they match, or of several the one routing to the rendezvous host) or by SageMaker
  (SM_NETWORK_INTERFACE_NAME); else the
  source address of the route to the rendezvous host (a UDP ``connect`` + ``getsockname``: the kernel
  picks the route, no packet is sent); else, on the host itself when its name resolves to loopback,
  the address of the default route's interface, or of the one interface with an address.
* **interface**: the one named above, else the interface that owns the local address. Exported to the
  workers as GLOO_SOCKET_IFNAME and as NCCL_SOCKET_IFNAME (``=name``: NCCL's exact form, as a plain
  ``eth1`` would match ``eth10`` too) unless the user set them, or, for NCCL, its config file does
  (/etc/nccl.conf, ~/.nccl.conf or NCCL_CONF_FILE: NCCL lets the environment win over them).

One node (or a rendezvous on a loopback address: every node on this machine) changes nothing.

:func:`plan_network` is pure over a :class:`NetProbe`; :func:`probe_network` is the I/O (netlink
RTM_GETADDR for the interface addresses, SIOCGIFADDR when netlink is unavailable, /proc/net/route for
the default route, getaddrinfo for the rendezvous host, one unconnected UDP socket for the route).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ddprun.cluster.base import ClusterSpec
from ddprun.errors import ClusterError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class NetProbe:
    """What :func:`probe_network` found on this node."""

    interfaces: Mapping[str, tuple[str, ...]]
    """Interface name -> its IPv4/IPv6 addresses (strings, no prefix length)."""
    master_addrs: tuple[str, ...]
    """The rendezvous host resolved on this node, in getaddrinfo order; () when it does not resolve."""
    route_src: str | None = None
    """Source address of the route to ``master_addrs[0]``; None when there is no route."""
    default_ifname: str | None = None
    """Interface of the IPv4 default route, if any."""


@dataclass(frozen=True)
class NetworkPlan:
    """The three choices and why. ``None`` = left to torch (single node, loopback rendezvous)."""

    is_host: bool | None = None
    local_addr: str | None = None
    ifname: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    """is_host / local_addr / ifname -> why; ``network`` when nothing was decided."""
    worker_env: Mapping[str, str] = field(default_factory=dict)
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to add to every worker's environment."""
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    """``{"is_host": "1"|"0"}`` for torch's c10d rendezvous; the user's --rdzv-conf goes over it."""

    def explain(self) -> list[str]:
        """``plan --explain`` lines."""
        if "network" in self.sources:  # nothing decided; the user's --local-addr is still passed on
            extra = [f"local_addr: {self.local_addr!r}  <- {self.sources['local_addr']}"] if self.local_addr else []
            return [f"network: {self.sources['network']}", *extra]
        lines = [f"is_host: {self.is_host!r}  <- {self.sources.get('is_host', '')}",
                 f"local_addr: {self.local_addr!r}  <- {self.sources.get('local_addr', '')}",
                 f"ifname: {self.ifname!r}  <- {self.sources.get('ifname', '')}"]
        lines.extend(f"worker env: {k}={v}" for k, v in self.worker_env.items())
        return lines

    def summary(self) -> str:
        """One console line for a multi-host launch; empty when nothing was decided."""
        if "network" in self.sources:
            return ""
        role = "hosts the rendezvous" if self.is_host else "joins the rendezvous"
        via = f" via {self.ifname}" if self.ifname else ""
        return f"ddprun: this node {role}; other nodes reach it at {self.local_addr}{via}"


def is_loopback(addr: str) -> bool:
    """``localhost`` or a loopback IP (127.0.0.0/8, ::1, ::ffff:127.x)."""
    if addr.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def _usable(addr: str) -> bool:
    """An address another host could use: neither loopback nor link-local."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def owner(interfaces: Mapping[str, tuple[str, ...]], addr: str) -> str | None:
    """The interface that has ``addr``, or None."""
    for name, addrs in interfaces.items():
        if addr in addrs:
            return name
    return None


def _first_usable(addrs: tuple[str, ...]) -> str | None:
    """IPv4 first: gloo and torch's stores take an IPv4 address more readily."""
    usable = [a for a in addrs if _usable(a)]
    v4 = [a for a in usable if ":" not in a]
    first = v4 or usable
    return first[0] if first else None


def _master_host(spec: ClusterSpec) -> str:
    """The rendezvous host. Only a dry run leaves it None, and cli.py plans no network then."""
    if spec.master_addr is None:
        raise ClusterError("The rendezvous host is unknown, so this node's network cannot be planned.",
                           seen=spec.sources.get("master_addr", ""),
                           hint="Name it with --rdzv-endpoint HOST:PORT or --master-addr HOST.")
    return spec.master_addr


def needs_probe(spec: ClusterSpec) -> bool:
    """False when there is nothing to decide: one node, or the rendezvous on a loopback address."""
    return spec.max_nodes > 1 and not is_loopback(_master_host(spec))


def _named_interface(spec: ClusterSpec, probe: NetProbe, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The interface the user or the cluster named, and why: GLOO_SOCKET_IFNAME (an exact name; a
    list or ``^exclusion`` is left to gloo), else the interface NCCL_SOCKET_IFNAME matches
    (:func:`_nccl_named`), else SageMaker's. ``(None, note)`` when NCCL's value matches several and
    none can be told apart: the plan then goes on as if nothing were named."""
    gloo = environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if gloo and "," not in gloo and not gloo.startswith("^"):
        return gloo, f"GLOO_SOCKET_IFNAME={gloo} (set by the user)"
    nccl = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    named, src = (_nccl_named(nccl, probe, strict=spec.device == "cuda") if nccl and not nccl.startswith("^")
                  else (None, ""))
    if named is None and spec.ifname:
        return spec.ifname, spec.sources.get("ifname", "the cluster environment")
    return named, src


def _nccl_named(raw: str, probe: NetProbe, strict: bool = True) -> tuple[str | None, str]:
    """NCCL_SOCKET_IFNAME as NCCL reads it: a comma list of name prefixes (``ib`` matches ``ib0``),
    or of exact names after a leading ``=``. One match is the interface; of several, the one that owns
    the route to the rendezvous host, else None (NCCL picks among them, and an arbitrary one would be
    a wrong exact name for GLOO_SOCKET_IFNAME). ClusterError when nothing on this node matches and
    ``strict`` (a CUDA job, whose NCCL would fail on it; a CPU job's gloo does not read it: ignored)."""
    exact = raw.startswith("=")
    wanted = [p.strip() for p in raw.removeprefix("=").split(",") if p.strip()]
    if not wanted:
        return None, ""
    ifs, src = probe.interfaces, f"NCCL_SOCKET_IFNAME={raw} (set by the user)"
    matches = [n for n in ifs if any(n == w if exact else n.startswith(w) for w in wanted)]
    if not matches and not strict:
        return None, f"{src} matches no interface here: not read (a CPU job: gloo does not use it)"
    if not matches:
        raise ClusterError(
            "No network interface of this node matches NCCL_SOCKET_IFNAME.",
            seen=f"{', '.join(wanted)} ({'exact names' if exact else 'name prefixes'}; {src}); "
                 f"interfaces: {_interfaces_seen(ifs)}",
            hint="NCCL reads a plain value as name prefixes (ib matches ib0) and =NAME as an exact name: "
                 "name interfaces this node has (ip addr), or unset it to let ddprun pick the one that "
                 "routes to the rendezvous host.")
    if len(matches) == 1:
        return matches[0], f"{src}: the one interface it matches"
    route_if = owner(ifs, probe.route_src) if probe.route_src else None
    if route_if in matches:
        return route_if, f"{src}: of {', '.join(matches)}, the one that routes to the rendezvous host"
    return None, f"{src} matches {', '.join(matches)}, none the route to the rendezvous host: NCCL picks"


def plan_network(spec: ClusterSpec, probe: NetProbe, environ: Mapping[str, str],
                 local_addr: str | None = None, rdzv_conf: Mapping[str, str] | None = None,
                 nccl_conf: Mapping[str, str] | None = None) -> NetworkPlan:
    """Decide is_host, the local address and the interface (module docstring). Pure.

    ``local_addr``: the user's --local-addr; ``rdzv_conf``: the user's --rdzv-conf (its ``is_host``
    wins); ``nccl_conf``: what NCCL's config files set (:func:`nccl_conf`). Raises ClusterError when
    the job cannot work from this node: the rendezvous host does not resolve, a named interface does
    not exist (or none matches NCCL_SOCKET_IFNAME), no address is reachable, or under static
    rendezvous node rank 0 is not the rendezvous host.
    """
    rdzv_conf = rdzv_conf or {}
    if not needs_probe(spec):
        why = ("one node" if spec.max_nodes == 1 else
               f"rendezvous on loopback {spec.master_addr}: every node on this machine")
        src = {"network": f"{why}; torch's defaults"}
        if local_addr:
            src["local_addr"] = f"--local-addr {local_addr}"
        return NetworkPlan(local_addr=local_addr, sources=src)

    if not probe.master_addrs:
        raise ClusterError(
            "The rendezvous host does not resolve on this node.",
            seen=f"{spec.master_addr} ({spec.sources.get('master_addr', '')})",
            hint="Make every node resolve it (DNS or /etc/hosts), or give its IP address "
                 "(--rdzv-endpoint IP:PORT or --master-addr IP).",
        )
    is_host, is_host_src = _is_host(spec, probe, rdzv_conf)
    _check_static_host(spec, probe, is_host)
    ifs = probe.interfaces
    named, named_src = _named_interface(spec, probe, environ)
    if named is not None and named not in ifs:
        raise ClusterError(
            "The network interface named for this job does not exist on this node.",
            seen=f"{named} ({named_src}); interfaces: {_interfaces_seen(ifs)}",
            hint="Name an interface of this node (ip addr), or unset the variable to let ddprun pick "
                 "the one that routes to the rendezvous host.",
        )
    addr, addr_src = _local_address(spec, probe, is_host, local_addr, named, named_src)
    ifname: str | None
    if named is not None:
        ifname, if_src = named, named_src
    else:
        ifname = owner(ifs, addr)
        if_src = f"owner of {addr}" if ifname else f"no interface of this node has {addr}; left to the libraries"
        if_src = f"{named_src}; gloo: {if_src}" if named_src else if_src
    conf = nccl_conf or {}
    worker_env = {var: ("=" + ifname if var.startswith("NCCL") else ifname) for var in IFNAME_VARS
                  if ifname and var not in environ and var not in conf}
    if ifname and "NCCL_SOCKET_IFNAME" in conf and "NCCL_SOCKET_IFNAME" not in environ:
        if_src += f"; NCCL: NCCL_SOCKET_IFNAME={conf['NCCL_SOCKET_IFNAME']} (its config file)"
    rdzv = {"is_host": "1" if is_host else "0"} if spec.rdzv_backend == "c10d" else {}
    return NetworkPlan(is_host=is_host, local_addr=addr, ifname=ifname,
                       sources={"is_host": is_host_src, "local_addr": addr_src, "ifname": if_src},
                       worker_env=worker_env, rdzv_conf=rdzv)


def _interfaces_seen(ifs: Mapping[str, tuple[str, ...]]) -> str:
    """This node's interfaces and addresses, for messages."""
    return "; ".join(f"{n}: {', '.join(a) or '-'}" for n, a in ifs.items()) or "no interface found"


def _is_host(spec: ClusterSpec, probe: NetProbe, rdzv_conf: Mapping[str, str]) -> tuple[bool, str]:
    """Whether this node hosts the store, and why: the user's is_host, else whether the rendezvous
    host resolves to a loopback address or one of this node's."""
    master, resolved = spec.master_addr, ", ".join(probe.master_addrs)
    own = {a: n for n, addrs in probe.interfaces.items() for a in addrs}
    mine = [a for a in probe.master_addrs if is_loopback(a) or a in own]
    user_is_host = rdzv_conf.get("is_host")
    if user_is_host is not None:
        return (str(user_is_host).strip().lower() in ("1", "true", "t", "yes", "y"),
                f"--rdzv-conf is_host={user_is_host}")
    if mine:
        where = own.get(mine[0], "loopback")
        return True, f"{master} resolves to {resolved}; {mine[0]} is this node's ({where})"
    ifs_seen = _interfaces_seen(probe.interfaces)
    return False, f"{master} resolves to {resolved}, none of this node's addresses ({ifs_seen})"


def _check_static_host(spec: ClusterSpec, probe: NetProbe, is_host: bool) -> None:
    """Under static rendezvous node rank 0 hosts the store, so it must run on the rendezvous host."""
    if not (spec.rdzv_backend == "static" and spec.node_rank == 0 and not is_host):
        return
    raise ClusterError(
        "This node has node rank 0, which hosts the rendezvous store under static rendezvous, "
        "but the rendezvous host is another machine.",
        seen=f"node rank 0 ({spec.sources.get('node_rank', '')}); rendezvous host {spec.master_addr} "
             f"({spec.sources.get('master_addr', '')}) resolves to {', '.join(probe.master_addrs)}; this node's "
             f"addresses: {_interfaces_seen(probe.interfaces)}",
        hint="Node rank 0 must run on the rendezvous host: check which host is first (hostfile line, "
             "SLURM nodelist, SM_HOSTS) or that MASTER_ADDR/--master-addr names the host of rank 0, and that "
             "its name resolves to this node here. If the address is this node's behind NAT, pass "
             "--rdzv-conf is_host=1.",
    )


def _local_address(spec: ClusterSpec, probe: NetProbe, is_host: bool, local_addr: str | None, named: str | None,
                   named_src: str) -> tuple[str, str]:
    """The address other nodes reach this one at, and why (module docstring's order)."""
    ifs, master = probe.interfaces, _master_host(spec)
    if local_addr:
        return local_addr, f"--local-addr {local_addr}"
    if named is not None and (first := _first_usable(ifs[named])):
        return first, f"address of {named}, named by {named_src}"
    if probe.route_src and not is_loopback(probe.route_src):
        return probe.route_src, f"source address of the route to {master} ({probe.master_addrs[0]})"
    resolved, ifs_seen = ", ".join(probe.master_addrs), _interfaces_seen(ifs)
    if is_host:
        return _host_address(ifs, probe.default_ifname, master, resolved, ifs_seen)
    raise ClusterError(
        "This node has no route to the rendezvous host.",
        seen=f"{master} ({spec.sources.get('master_addr', '')}) resolves to {resolved}; this node's addresses: "
             f"{ifs_seen}",
        hint="Check the network between the nodes (ip route get <address>), or the rendezvous host's name.",
    )


def _host_address(ifs: Mapping[str, tuple[str, ...]], default_ifname: str | None, master: str, resolved: str,
                  ifs_seen: str) -> tuple[str, str]:
    """The rendezvous host's reachable address when its name resolves to loopback here."""
    why = f"{master} resolves to {resolved} here"
    if default_ifname and (first := _first_usable(ifs.get(default_ifname, ()))):
        return first, f"{why}; address of {default_ifname}, the default route's interface"
    candidates = {n: usable for n, a in ifs.items() if (usable := _first_usable(a))}
    if len(candidates) == 1:
        (name, addr), = candidates.items()
        return addr, f"{why}; address of {name}, the only interface with one"
    raise ClusterError(
        "This node hosts the rendezvous but its name resolves to a loopback address, and it has several "
        "interfaces: ddprun cannot tell which one the other nodes reach.",
        seen=f"{why}; interfaces: {ifs_seen}; no default route",
        hint="Give --local-addr ADDRESS (as the other nodes reach this node) or GLOO_SOCKET_IFNAME=IFACE, "
             "or make the name resolve to that address in /etc/hosts.",
    )


# ---- I/O ----------------------------------------------------------------------------------------

def _netlink_addresses() -> dict[str, tuple[str, ...]]:
    """Every interface address via one rtnetlink RTM_GETADDR dump (Linux); OSError if unavailable."""
    rtm_getaddr, rtm_newaddr, nlmsg_done, nlmsg_error = 22, 20, 3, 2
    ifa_address, ifa_local = 1, 2
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.bind((0, 0))
        s.settimeout(2.0)
        # nlmsghdr (len, type, flags = REQUEST|DUMP, seq, pid) + ifaddrmsg (family AF_UNSPEC = all)
        s.send(struct.pack("=LHHLL", 24, rtm_getaddr, 0x301, 1, 0) + struct.pack("=BBBBL", 0, 0, 0, 0, 0))
        while True:
            data, off = s.recv(1 << 16), 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=LH", data, off)
                if kind == nlmsg_done or length < 16:
                    return {k: tuple(dict.fromkeys(v)) for k, v in found.items()}
                if kind == nlmsg_error:
                    raise OSError("netlink RTM_GETADDR failed")
                if kind == rtm_newaddr:
                    family, _, _, _, index = struct.unpack_from("=BBBBL", data, off + 16)
                    attrs, a = {}, off + 24
                    while a + 4 <= off + length:
                        alen, atype = struct.unpack_from("=HH", data, a)
                        if alen < 4:
                            break
                        attrs[atype] = data[a + 4:a + alen]
                        a += (alen + 3) & ~3
                    raw = attrs.get(ifa_local) or attrs.get(ifa_address)  # LOCAL is ours on point-to-point links
                    if raw and family in (socket.AF_INET, socket.AF_INET6):
                        try:
                            name = socket.if_indextoname(index)
                        except OSError:
                            name = f"if{index}"
                        found.setdefault(name, []).append(socket.inet_ntop(family, raw))
                off += (length + 3) & ~3


def _ioctl_addresses() -> dict[str, tuple[str, ...]]:
    """Each interface's primary IPv4 address (SIOCGIFADDR): the fallback without netlink."""
    import fcntl

    found: dict[str, tuple[str, ...]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # the address is bytes 20-24 of struct ifreq
                ifreq = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                found[name] = (socket.inet_ntoa(ifreq[20:24]),)
            except OSError:
                pass
    return found


def interface_addresses() -> dict[str, tuple[str, ...]]:
    """Interface name -> addresses; best effort ({} when neither netlink nor ioctl answers)."""
    try:
        return _netlink_addresses()
    except (OSError, AttributeError, struct.error):
        pass
    try:
        return _ioctl_addresses()
    except (ImportError, OSError, AttributeError):
        return {}


def _default_ifname(route_table: str = "/proc/net/route") -> str | None:
    try:
        with open(route_table, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if len(cols) > 7 and cols[1] == "00000000" and cols[7] == "00000000":
                    return cols[0]
    except OSError:
        pass
    return None


def route_source(addr: str) -> str | None:
    """The address this node sends from to reach ``addr`` (connect on UDP sends nothing)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return str(s.getsockname()[0]).split("%", 1)[0]
    except OSError:
        return None


def resolve_host(host: str) -> tuple[str, ...]:
    """``host``'s addresses in getaddrinfo order; () when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return ()
    return tuple(dict.fromkeys(str(i[4][0]).split("%", 1)[0] for i in infos))


def probe_network(master_host: str) -> NetProbe:
    """The I/O behind :func:`plan_network`."""
    addrs = resolve_host(master_host)
    return NetProbe(interfaces=interface_addresses(), master_addrs=addrs,
                    route_src=route_source(addrs[0]) if addrs else None, default_ifname=_default_ifname())


def network_plan(spec: ClusterSpec, environ: Mapping[str, str], local_addr: str | None = None,
                 rdzv_conf: Mapping[str, str] | None = None,
                 probe: Callable[[str], NetProbe] | None = None) -> NetworkPlan:
    """Probe (only when there is something to decide) and plan: what launch.py, ``plan`` and
    runtime.init() call. ``probe`` defaults to :func:`probe_network`."""
    if not needs_probe(spec):
        return plan_network(spec, NetProbe({}, ()), environ, local_addr, rdzv_conf)
    return plan_network(spec, (probe or probe_network)(_master_host(spec)), environ, local_addr, rdzv_conf,
                        nccl_conf(environ))


def nccl_conf_files(environ: Mapping[str, str]) -> dict[str, str]:
    """The config files NCCL reads, by the name to show -> path: NCCL_CONF_FILE (else ~/.nccl.conf),
    then /etc/nccl.conf. A variable set in the environment wins over both."""
    user = environ.get("NCCL_CONF_FILE") or os.path.join(environ.get("HOME", "/nonexistent"), ".nccl.conf")
    return {"~/.nccl.conf": user, "/etc/nccl.conf": "/etc/nccl.conf"}


def nccl_conf(environ: Mapping[str, str], root: str = "/") -> dict[str, str]:
    """``KEY=VALUE`` settings of NCCL's config files (the first file to set a key wins, as in NCCL);
    {} where none is readable. ``root``: where the files are (tests: a fake tree)."""
    found: dict[str, str] = {}
    for path in nccl_conf_files(environ).values():
        try:
            with open(os.path.join(root, path.lstrip("/")), errors="replace") as fp:
                lines = fp.read(1 << 20).splitlines()
        except OSError:
            continue
        for line in lines:
            key, eq, value = line.split("#", 1)[0].partition("=")
            if eq and key.strip():
                found.setdefault(key.strip(), value.strip())
    return found
