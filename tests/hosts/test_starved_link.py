"""A safety feature must never harm a healthy job: two hosts whose link is starved (a token bucket of
256 kbit/s on each side, so the store's small calls queue behind the gradients and a share of the
packets is dropped) train ``ddprun.fit``'s demo to its end, slower, and no node says a node was lost,
a rank stalled or straggled.

Every bound of the failure path (a store call within STORE_CALL_S, a node lost after LOST_AFTER_S of
silent beats, the stall watchdog, the straggler margin) meets here the delays TCP's retransmissions
give a small message on such a link; this kernel has no ``netem``, so ``tbf`` makes them.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers import DDPRUN, describe, job_env, run_agents

pytestmark = pytest.mark.hosts

RATE = "256kbit"
STEPS = "6"
ALARMS = re.compile(r"was lost|stopped answering|stall|straggler|did not answer|hang|warning", re.IGNORECASE)


def _tc(host, *args: str, check: bool = True) -> str:
    return subprocess.run(["ip", "netns", "exec", host.ns, "tc", *args], check=check, capture_output=True,
                          text=True, timeout=10).stdout


@pytest.fixture
def starved_link(two_hosts):
    """Both ends of the link limited to RATE (queueing at most 200 ms, dropping beyond); removed after."""
    try:
        for h in two_hosts:
            _tc(h, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", RATE, "burst", "16kbit", "latency", "200ms")
        yield two_hosts
    finally:
        for h in two_hosts:
            _tc(h, "qdisc", "del", "dev", "eth0", "root", check=False)


def _dropped(host) -> int:
    found = re.search(r"dropped (\d+)", _tc(host, "-s", "qdisc", "show", "dev", "eth0"))
    return int(found.group(1)) if found else 0


@pytest.mark.timeout(120)
def test_a_job_over_a_starved_link_that_drops_packets_trains_to_its_end_without_a_false_alarm(starved_link, tmp_path):
    hosts = starved_link
    argv = [DDPRUN, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "algo-1:29400",
            "--rdzv-id", "hosts-starved", "--log-dir", str(tmp_path / "runs"), "-m", "ddprun.demo_train",
            "--steps", STEPS]
    results = run_agents([h.cmd(argv) for h in hosts], timeout=90, cwd=tmp_path, env=job_env())
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert f"trained {STEPS} steps on 2 process(es)" in results[0].output, describe(results)
    for r in results:
        assert "ddprun: run hosts-starved finished on this node" in r.output, describe(results)
        alarms = [line for line in r.output.splitlines() if ALARMS.search(line) and "socket.cpp" not in line]
        assert alarms == [], describe(results)
    # the link was starved indeed: the token buckets dropped packets (the store's calls met TCP's retries)
    drops = [_dropped(h) for h in hosts]
    print(f"a job over {RATE} links: {max(r.wall_s for r in results):.1f} s, packets dropped {drops}")
    assert sum(drops) > 0, drops
