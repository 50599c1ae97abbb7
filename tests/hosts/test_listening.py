"""What a job exposes on the network (SECURITY.md): every socket a job's processes listen on, read
with ``ss`` inside each host, and a connection from the other host to each of them.

A single-machine job listens on loopback only: the other host is refused on every port. A two-host
job's stores listen on the address the other host reaches them at, never on every interface.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import DDPRUN, job_env, run_agents

pytestmark = pytest.mark.hosts

JOB = str(Path(__file__).parents[1] / "faults" / "scripts" / "job.py")


def listening(host) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket listening in ``host``'s namespace."""
    out = subprocess.run(["ip", "netns", "exec", host.ns, "ss", "-ltnpH"], capture_output=True, text=True,
                         timeout=10).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        addr, _, port = local.rpartition(":")
        name = re.search(r'users:\(\("([^"]+)"', line)
        found.append((addr.strip("[]"), int(port), name.group(1) if name else "?"))
    return found


def refused_from(other, addr: str, port: int) -> str:
    """What a TCP connect from ``other``'s namespace to addr:port met: ``refused``, ``open``, or the error."""
    probe = (f"import socket\ntry:\n    socket.create_connection(({addr!r}, {port}), timeout=2).close(); print('open')\n"
             "except ConnectionRefusedError:\n    print('refused')\nexcept OSError as e:\n    print(repr(e))")
    r = subprocess.run(["ip", "netns", "exec", other.ns, "python3", "-c", probe], capture_output=True, text=True,
                       timeout=15)
    return r.stdout.strip() or r.stderr.strip()[-300:]


def while_training(two_hosts, tmp_path, cmds, pids: Path, ranks: int, look):
    """Run ``cmds`` (one per host; None: nothing there) with ``--until`` a file; once every rank stepped,
    ``look()`` while they train on, then the file ends the job. Fails if the ranks never all came."""
    seen: dict = {}
    until = tmp_path / "look-done"

    def watch():
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(list(pids.glob("rank-*.pid"))) < ranks:
                time.sleep(0.2)
            seen["ranks"] = len(list(pids.glob("rank-*.pid")))
            seen["sockets"] = look()
        finally:
            until.touch()

    t = threading.Thread(target=watch)
    t.start()
    results = run_agents([h.cmd([*c, "--until", str(until)]) for h, c in zip(two_hosts, cmds) if c], timeout=90,
                         cwd=tmp_path, env=job_env(OMP_NUM_THREADS="1"))
    t.join(30)
    assert seen.get("ranks") == ranks, (seen, [r.output for r in results])
    return results, seen["sockets"]


@pytest.mark.timeout(150)
def test_a_single_machine_job_listens_on_loopback_only(two_hosts, tmp_path):
    a, b = two_hosts
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = [DDPRUN, "run", "--nproc-per-node", "2", JOB, "--pids", str(pids), "--steps", "20", "--step-s", "0.05"]
    results, sockets = while_training(two_hosts, tmp_path, [cmd, None], pids, 2,
                                      lambda: [(s, refused_from(b, a.addr, s[1])) for s in listening(a)])
    assert results[0].returncode == 0, results[0].output
    print("single machine, listening:", sockets)  # nothing else runs in this namespace: every socket is the job's
    assert len([s for s, _ in sockets if s[2] == "ddprun"]) >= 2, sockets  # the agent's two stores at least
    assert all(s[0] == "127.0.0.1" for s, _ in sockets), sockets
    assert all(met == "refused" for _, met in sockets), sockets


@pytest.mark.timeout(150)
def test_a_two_host_job_listens_on_the_job_address_not_every_interface(two_hosts, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = [DDPRUN, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "algo-1:29411", JOB,
           "--pids", str(pids), "--steps", "20", "--step-s", "0.05"]
    b, a = two_hosts[1], two_hosts[0]
    results, sockets = while_training(two_hosts, tmp_path, [cmd, cmd], pids, 2,
                                      lambda: ({h.name: listening(h) for h in two_hosts},
                                               refused_from(b, a.addr, 29411)))
    sockets, endpoint = sockets
    assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    for h in two_hosts:
        mine = sockets[h.name]  # nothing else runs in these namespaces: every socket is the job's
        print(h.name, "listening:", mine)
        assert mine and all(s[0] in (h.addr, "127.0.0.1") for s in mine), (h.name, mine)
    host_stores = [s for s in sockets["algo-1"] if s[2] == "ddprun"]
    assert ("10.231.7.1", 29411, "ddprun") in host_stores, host_stores  # the endpoint, where algo-2 reaches it
    assert endpoint == "open", endpoint  # the probe itself works: algo-2 reaches the endpoint it must reach
