"""A node whose DNS server never answers: torch's store connects look up the name of the address
they dial (getnameinfo), which waits out the resolver, 10 s with glibc's defaults, once a process.
The job must start anyway, as torchrun's does, the agent must say why its start was slow, and its
advice must work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import DDPRUN, Finished, describe, job_env, run_agents
from tests.hosts.conftest import NETNS_ETC, fail_if_left

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(150)]

JOB = str(Path(__file__).parents[1] / "faults" / "scripts" / "job.py")
NOTE = (r"ddprun: note: the rendezvous store at 127\.0\.0\.1 took ([\d.]+) s to start\. .*"
        r"'::ffff:127\.0\.0\.1 localhost'")
TORCH_WARNING = "The hostname of the client socket cannot be retrieved"
"""What torch prints (c10d, socket.cpp) when its lookup of a dialled address's name failed."""


@pytest.fixture(autouse=True)
def nothing_left_on_the_dnsless_host(silent_dns_host):
    yield
    fail_if_left([silent_dns_host])


def one_node_job(host, tmp_path) -> tuple[Finished, dict[str, str]]:
    """A 1 node x 2 job of 3 steps on ``host``: its result and its rank logs; fails unless it exited
    0 and both ranks stepped."""
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = host.cmd([DDPRUN, "run", "--nnodes", "1", "--nproc-per-node", "2", JOB, "--steps", "3", "--step-s", "0",
                    "--pids", str(pids)])
    [res] = run_agents([cmd], timeout=120, cwd=tmp_path, env=job_env())
    assert res.returncode == 0, describe([res])
    assert sorted(p.name for p in pids.glob("rank-*.pid")) == ["rank-0.pid", "rank-1.pid"], describe([res])
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("runs/*/logs/rank-*.log")}
    assert sorted(logs) == ["rank-0.log", "rank-1.log"], describe([res])
    return res, logs


def test_a_node_whose_dns_server_drops_every_query_trains_and_names_the_slow_resolver(silent_dns_host, tmp_path):
    res, logs = one_node_job(silent_dns_host, tmp_path)
    notes = re.findall(NOTE, res.output)
    assert len(notes) == 1, describe([res])
    assert float(notes[0]) >= 5.0, describe([res])  # the resolver really held the connect: the case this test is for
    # the agent and each worker waited out the resolver once, and started all the same
    assert TORCH_WARNING in res.output and all(TORCH_WARNING in text for text in logs.values()), logs


def test_the_notes_hosts_line_removes_the_wait(silent_dns_host, tmp_path):
    """What the note advises: with '::ffff:127.0.0.1 localhost' in /etc/hosts, no lookup of the
    agent's or of a worker's reaches the silent DNS server, and no note is printed."""
    hosts = NETNS_ETC / silent_dns_host.ns / "hosts"
    before = hosts.read_text()
    hosts.write_text(before + "::ffff:127.0.0.1 localhost\n")
    try:
        res, logs = one_node_job(silent_dns_host, tmp_path)
    finally:
        hosts.write_text(before)
    assert not re.search(NOTE, res.output), describe([res])
    assert TORCH_WARNING not in res.output and not any(TORCH_WARNING in text for text in logs.values()), logs
