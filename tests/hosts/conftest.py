"""Two real hosts on this machine (and, for tests/hosts/test_resolver.py, a host whose DNS server
drops every query): network namespaces joined by a veth pair, each with its own address,
``eth0``, hostname (UTS namespace per command) and /etc/hosts naming both (shared/testbeds/README.md).

Like many containers, each host's own name resolves to 127.0.0.1 there (``127.0.0.1 algo-1``): the
case that makes torchrun hang or bind loopback. Every namespace has ``lo`` up and a resolv.conf
pointing at 127.0.0.1 (refused at once), so that no process waits out a resolver on its first
store connect (torch looks up the dialled address's name: tests/hosts/test_resolver.py).
A veth pair needs no bridge, so Docker's FORWARD DROP policy does not apply and no iptables rule is
added. Everything created is removed in the fixture's teardown, whatever happened.

Needs root and ``ip netns``; skipped (with the reason) otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.system import unavailable

SUBNET = "10.231.7"
"""A private /24 (unused on this machine): it exists only on the veth pair between our two
namespaces, so it cannot clash with the machine's own networks."""
NETNS_ETC = Path("/etc/netns")


@dataclass(frozen=True)
class Host:
    name: str
    """Its hostname and the name the other host knows it by (algo-1, algo-2)."""
    ns: str
    addr: str

    def cmd(self, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run on this host: in its namespace, with its hostname, plus ``env``."""
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, "env", *extra, *argv]


def _sh(*argv: str, check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, timeout=timeout, capture_output=True, text=True)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    try:
        if _sh("ip", "netns", "list", check=False).returncode != 0:
            return "`ip netns` is unavailable"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns` is unavailable: {e}"
    return None


def _namespace_pids(ns: str) -> list[str]:
    return _sh("ip", "netns", "pids", ns, check=False).stdout.split()


def _kill_namespace_processes(ns: str, within_s: float = 5.0) -> list[str]:
    """Processes still inside a namespace we created are ours (a test that timed out): SIGKILL them,
    again for any forked meanwhile, until none is left (bounded). Returns the pids first seen."""
    first = pids = _namespace_pids(ns)
    deadline = time.monotonic() + within_s
    while pids and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.1)
        pids = _namespace_pids(ns)
    return first


@pytest.fixture(scope="session")
def two_hosts():
    """(algo-1, algo-2) as :class:`Host`; torn down completely at the end of the session."""
    reason = _why_not()
    if reason:
        unavailable(reason)
    tag = f"ddp{os.getpid() % 100000}"
    hosts = [Host(f"algo-{i}", f"{tag}h{i}", f"{SUBNET}.{i}") for i in (1, 2)]
    veths = [f"{tag}v{i}" for i in (1, 2)]  # unique while in the root namespace; eth0 inside
    created: list[str] = []
    try:
        for h in hosts:
            added = _sh("ip", "netns", "add", h.ns, check=False)
            if added.returncode != 0:  # e.g. a container without CAP_SYS_ADMIN
                unavailable(f"`ip netns add` is unavailable here: {added.stderr.strip()}")
            created.append(h.ns)
            etc = NETNS_ETC / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost"] + [
                f"{'127.0.0.1' if o is h else o.addr} {o.name}" for o in hosts]
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        _sh("ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for h, v in zip(hosts, veths):
            _sh("ip", "link", "set", v, "netns", h.ns)
            _sh("ip", "-n", h.ns, "link", "set", v, "name", "eth0")
            _sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _sh("ip", "-n", h.ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", h.ns, "link", "set", "lo", "up")
        yield tuple(hosts)
    finally:
        for ns in created:
            _kill_namespace_processes(ns)
            _sh("ip", "-n", ns, "link", "del", "eth0", check=False)
            _sh("ip", "netns", "del", ns, check=False)
        for v in veths:  # only left in the root namespace if setup failed half-way
            _sh("ip", "link", "del", v, check=False)
        for ns in created:
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


DNS_SUBNET = "10.231.9"
"""The silent nameserver's /24, inside :func:`silent_dns_host`'s two namespaces only."""


@pytest.fixture(scope="module")
def silent_dns_host():
    """A host whose nameserver drops every query, as behind a firewall that drops DNS: its
    resolv.conf names ``DNS_SUBNET.53``, which answers ARP (a namespace of its own holds it, joined
    by a veth pair) but has no route back, so every query goes unanswered and the resolver waits out
    its timeouts. /etc/hosts names localhost and the host itself. Torn down whatever happened."""
    reason = _why_not()
    if reason:
        unavailable(reason)
    tag = f"ddp{os.getpid() % 100000}"
    host, dns = Host("dnsless", f"{tag}d", f"{DNS_SUBNET}.1"), f"{tag}n"
    created: list[str] = []
    try:
        for ns in (host.ns, dns):
            added = _sh("ip", "netns", "add", ns, check=False)
            if added.returncode != 0:
                unavailable(f"`ip netns add` is unavailable here: {added.stderr.strip()}")
            created.append(ns)
        etc = NETNS_ETC / host.ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{host.addr} {host.name}\n")
        (etc / "resolv.conf").write_text(f"nameserver {DNS_SUBNET}.53\n")
        _sh("ip", "link", "add", f"{tag}w1", "netns", host.ns, "type", "veth", "peer", "name", f"{tag}w2",
            "netns", dns)
        _sh("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", f"{tag}w1")
        _sh("ip", "-n", dns, "addr", "add", f"{DNS_SUBNET}.53/32", "dev", f"{tag}w2")  # /32: no route back
        for ns, dev in ((host.ns, f"{tag}w1"), (dns, f"{tag}w2"), (host.ns, "lo")):
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        yield host
    finally:
        for ns in created:
            _kill_namespace_processes(ns)
            _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(NETNS_ETC / host.ns, ignore_errors=True)


def fail_if_left(hosts) -> None:
    """No process is left on ``hosts`` (:class:`Host`): a leftover gets 5 s to end by itself, then is
    killed and fails the test, so the next test finds clean hosts (free fixed ports) either way."""
    deadline = time.monotonic() + 5
    while any(_namespace_pids(h.ns) for h in hosts) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {h.name: _kill_namespace_processes(h.ns) for h in hosts}
    left = {name: pids for name, pids in left.items() if pids}
    if left:
        pytest.fail(f"processes left on the hosts after the test (killed now): {left}", pytrace=False)


@pytest.fixture(autouse=True)
def nothing_left_on_the_hosts(two_hosts):
    """After each test: no process of it is left on either host (its agents' workers die with them)."""
    yield
    fail_if_left(two_hosts)


RSH_AGENT = """#!/bin/sh
# Open MPI's plm_rsh_agent for hosts that are network namespaces: `agent HOST CMD...` runs CMD on
# HOST (its namespace and hostname), as ssh would run it in HOST's shell.
host=$1; shift
case "$host" in
{cases}
  *) echo "rsh agent: unknown host $host" >&2; exit 1;;
esac
exec ip netns exec "$ns" unshare --uts -- sh -c "hostname $host && $*"
"""


@pytest.fixture(scope="session")
def mpi_rsh_agent(two_hosts):
    """Path of an rsh agent that lets a real mpirun (run on algo-1) start its daemons on both hosts:
    ``mpirun --mca plm_rsh_agent PATH --host algo-1:2,algo-2:2 ...``. Skipped without mpirun."""
    if shutil.which("mpirun") is None:
        unavailable("mpirun is not installed (apt-get install openmpi-bin)")
    folder = tempfile.mkdtemp(prefix="ddprun-rsh-")
    try:
        agent = Path(folder) / "rsh-netns"
        agent.write_text(RSH_AGENT.format(cases="\n".join(f"  {h.name}) ns={h.ns};;" for h in two_hosts)))
        agent.chmod(0o755)
        yield str(agent)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
