"""A host that dies without a word: power lost, a kernel panic. Every packet it would send is dropped
first (a qdisc that queues nothing), then every process on it is killed, so no FIN or RST ever
reaches the other host (a kill -9 on a live machine sends them: tests/faults/test_deaths.py), and
its kernel answers nothing: the survivor's packets go out and vanish, as behind a switch. (Taking
its link down instead would drop the carrier under the survivor, whose kernel then fails its own
sends: not what a dead machine does.) The dead host ran the rendezvous endpoint and rank 0, so every
store the survivor talks to sits there: its store calls get no answer, not an error, and torch's
client waits its whole timeout.

The survivor names the lost host and ends within seconds, with no process left: its worker, blocked
in a collective and in a store call, ends by its agent's stop at once, not after torch's 30 s
SIGTERM-to-SIGKILL grace (the grace a worker gets to save; nothing can be saved here).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import DDPRUN, Watched, job_env
from tests.hosts.conftest import _kill_namespace_processes

pytestmark = pytest.mark.hosts

JOB = str(Path(__file__).parents[1] / "faults" / "scripts" / "job.py")
LOST = re.compile(r"^ddprun: the job failed: (node \d \(algo-1\) was lost: its agent stopped answering"
                  r"|the node hosting the job store was lost: the job store at 10\.231\.7\.1:\d+ stopped answering)",
                  re.M)


def _silence(host, on: bool) -> None:
    """Every packet ``host`` sends dropped (``pfifo limit 0``), or its link as before."""
    args = ["add", "dev", "eth0", "root", "pfifo", "limit", "0"] if on else ["del", "dev", "eth0", "root"]
    subprocess.run(["ip", "netns", "exec", host.ns, "tc", "qdisc", *args], check=on, timeout=10)


@pytest.mark.timeout(90)
def test_a_host_that_dies_silently_is_named_and_the_survivor_ends_within_seconds(two_hosts, tmp_path):
    dead, survivor = two_hosts
    pids = tmp_path / "pids"
    pids.mkdir()
    argv = [DDPRUN, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "algo-1:29400",
            "--rdzv-id", "hosts-silent", "--log-dir", str(tmp_path / "runs"), JOB, "--pids", str(pids),
            "--step-s", "0.1", "--steps", "600"]
    env = job_env()
    with Watched(dead.cmd(argv), cwd=tmp_path, env=env), Watched(survivor.cmd(argv), cwd=tmp_path, env=env) as other:
        deadline = time.monotonic() + 40
        while len(list(pids.glob("rank-*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(pids.glob("rank-*.pid"))) == 2, other.output
        try:
            _silence(dead, True)  # first: the kill below must send nothing the survivor could read
            dark = time.monotonic() - other.t0
            assert _kill_namespace_processes(dead.ns), "nothing ran on the dead host"
            rc, ended = other.finish(timeout=45)
        finally:
            _silence(dead, False)  # the hosts are shared by the other tests
    print(f"a host that died silently -> the survivor exited {rc} {ended - dark:.1f} s after")
    assert rc == 1, other.output
    assert LOST.search(other.output), other.output
    assert "Traceback" not in other.output, other.output
    # 10 s of silence name the host lost; its stop is not torch's 30 s grace (which ended at ~41 s)
    assert ended - dark < 20, other.output
