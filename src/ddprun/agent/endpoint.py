"""Sockets at the rendezvous endpoint: is something listening, a free port, and a store server
bound to one address (admission.py decides who may join).

torch's TCPStore server listens on every interface. :func:`bound_server` gives it a socket bound to
the one address its clients use (a single-machine job: loopback; a multi-node job: the address of
the job's interface), through TCPStore's ``master_listen_fd``; ``multi_tenant`` lets torch's own
handler in this process share that server.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

from ddprun.protocol import defaults


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something listens at host:port (a plain connect: refused at once when nothing does)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port(host: str) -> int:
    """A port free on ``host`` now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return s.getsockname()[1]


def bind_address(addr: str) -> tuple[int, str]:
    """(family, IP) that ``addr`` (a name or an IP) resolves to here: what its clients will dial."""
    if addr.lower() == "localhost":
        return socket.AF_INET, "127.0.0.1"
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0]
    return family, str(sockaddr[0])


def is_local(ip: str) -> bool:
    """Whether ``ip`` is an address of this machine (it can be bound)."""
    try:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def store_bind(endpoint_host: str, local_addr: str | None, user_named: bool) -> str | None:
    """Where this node's endpoint store listens when it hosts it: the IP the endpoint's name resolves
    to here, when that is an address of this machine; where the name resolves to loopback on a
    multi-node job (a container's own name), the network plan's local address unless the user named
    an interface or address (it may be another network than the one the peers dial); else None:
    every interface (a virtual IP, a name that does not resolve)."""
    from ddprun.cluster.netaddr import is_loopback

    try:
        ip = bind_address(endpoint_host)[1]
    except OSError:
        return None
    if is_loopback(ip):
        if local_addr is None or is_loopback(local_addr):
            return ip  # every node on this machine
        return None if user_named else local_addr
    return ip if is_local(ip) else None


def bound_server(addr: str, port: int, timeout_s: float) -> Any:
    """A TCPStore server listening on ``addr``'s IP only, at ``port`` (0: the OS picks). Raises OSError
    when the address cannot be bound (in use: another agent on this machine hosts it already)."""
    family, ip = bind_address(addr)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(1024)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    try:
        return store_server(ip, port, timeout_s, multi_tenant=True, master_listen_fd=sock.detach())
    except (RuntimeError, ValueError) as e:
        raise OSError(f"the store server at {ip}:{port} did not start: {e}") from e


def store_server(host: str, port: int, timeout_s: float, **kw: Any) -> Any:
    """A TCPStore server at host:port (``kw``: TCPStore's own, e.g. ``master_listen_fd``) whose own
    client's calls wait up to ``timeout_s``; its connect to itself, at least SELF_CONNECT_S (see
    :func:`_open`)."""
    return _open(host, port, timeout_s, is_master=True, **kw)


def store_client(host: str, port: int, timeout_s: float) -> Any:
    """A client of the store at host:port whose calls wait up to ``timeout_s``; its connect, at least
    SELF_CONNECT_S (see :func:`_open`)."""
    return _open(host, port, timeout_s, is_master=False)


def _open(host: str, port: int, timeout_s: float, **kw: Any) -> Any:
    """A TCPStore connected within max(``timeout_s``, SELF_CONNECT_S), then bounded by ``timeout_s``:
    torch looks up the name of the address it dials (getnameinfo on ``::ffff:<ip>``, which the usual
    /etc/hosts does not list), so a DNS server that drops queries holds a process's first connect for
    the resolver's timeouts (10 s with glibc's defaults); that wait says nothing about the store."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, wait_for_workers=False,
                     timeout=timedelta(seconds=max(timeout_s, defaults.SELF_CONNECT_S)), **kw)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def dialled_as(addr: str) -> str | None:
    """How torch's connect looks up ``addr``'s name: an IPv4 address as its IPv6 mapping, an IPv6
    address as itself; None for a name (its address is known only once resolved)."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    return f"::ffff:{ip}" if ip.version == 4 else str(ip)
