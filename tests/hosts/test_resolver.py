"""A node whose DNS server never answers: torch's store connects look up the name of the address
they dial (getnameinfo), which waits out the resolver, 10 s with glibc's defaults. The job must start
anyway, as torchrun's does, the agent must say why its start was slow, and its advice must work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import DDPRUN, Finished, describe, job_env, run_agents
from tests.hosts.conftest import NETNS_ETC

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(150)]

JOB = str(Path(__file__).parents[1] / "faults" / "scripts" / "job.py")


def one_node_job(host, tmp_path) -> Finished:
    """A 1 node x 2 job of 3 steps on ``host``; fails unless it exited 0 and both ranks stepped."""
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = host.cmd([DDPRUN, "run", "--nnodes", "1", "--nproc-per-node", "2", JOB, "--steps", "3", "--step-s", "0",
                    "--pids", str(pids)])
    [res] = run_agents([cmd], timeout=120, cwd=tmp_path, env=job_env())
    assert res.returncode == 0, describe([res])
    assert sorted(p.name for p in pids.glob("rank-*.pid")) == ["rank-0.pid", "rank-1.pid"], describe([res])
    return res


def test_a_node_whose_dns_server_drops_every_query_trains_and_names_the_slow_resolver(silent_dns_host, tmp_path):
    res = one_node_job(silent_dns_host, tmp_path)
    notes = re.findall(r"ddprun: note: the rendezvous store at 127\.0\.0\.1 took ([\d.]+) s to start\. .*"
                       r"'::ffff:127\.0\.0\.1 localhost'", res.output)
    assert len(notes) == 1, describe([res])
    assert float(notes[0]) >= 5.0, describe([res])  # the resolver really held the connect: the case this test is for


def test_the_notes_hosts_line_removes_the_wait(silent_dns_host, tmp_path):
    """What the note advises: with '::ffff:127.0.0.1 localhost' in /etc/hosts, no lookup reaches
    the silent DNS server: the store starts at once and neither ddprun nor torch warns."""
    hosts = NETNS_ETC / silent_dns_host.ns / "hosts"
    before = hosts.read_text()
    hosts.write_text(before + "::ffff:127.0.0.1 localhost\n")
    try:
        res = one_node_job(silent_dns_host, tmp_path)
    finally:
        hosts.write_text(before)
    assert "took" not in res.output and "cannot be retrieved" not in res.output, describe([res])
