"""ddprun.init()'s bounded first collective over two real gloo ranks: it passes when both answer,
and when one never enters it the other names backend, interface and MASTER_ADDR:PORT in seconds."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import free_port, job_env

pytestmark = pytest.mark.multiprocess

SCRIPT = str(Path(__file__).parent / "scripts" / "first_collective.py")


def start(rank, port, *args, **env):
    environ = job_env(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
                      GROUP_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_RUN_ID="tfirst", GLOO_SOCKET_IFNAME="lo", **env)
    return subprocess.Popen([sys.executable, SCRIPT, *args], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(procs, timeout):
    out = []
    for p in procs:
        try:
            out.append((p.communicate(timeout=timeout)[0], p.returncode))
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


@pytest.mark.timeout(60)
def test_two_ranks_pass_the_first_collective():
    port = free_port()
    results = finish([start(0, port), start(1, port)], timeout=45)
    assert [rc for _, rc in results] == [0, 0], results
    assert "rank 0 ok" in results[0][0] and "rank 1 ok" in results[1][0]
    # the group init made is gone before the interpreter's teardown (where gloo can abort the process)
    assert all("group alive at exit: False" in out for out, _ in results), results


@pytest.mark.timeout(60)
def test_a_rank_whose_collective_never_arrives_is_named_within_the_probe_timeout():
    port = free_port()
    t0 = time.monotonic()
    procs = [start(0, port, DDPRUN_FIRST_COLLECTIVE_TIMEOUT="3"),
             start(1, port, "--stuck", DDPRUN_FIRST_COLLECTIVE_TIMEOUT="3")]
    (out0, rc0), (out1, rc1) = finish(procs, timeout=45)
    assert (rc0, rc1) == (3, 3), (out0, out1)
    assert time.monotonic() - t0 < 25  # interpreter + torch start, then 3 s: not gloo's 30 s timeout
    assert "ClusterError: The first collective (gloo all_reduce of one element) did not complete within 3 s, " \
           "although all 2 ranks joined the process group." in out0, out0
    assert f"Seen: backend gloo; GLOO_SOCKET_IFNAME='lo', NCCL_SOCKET_IFNAME unset (the library picks); " \
           f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}; this rank 0 on " in out0, out0
    assert "HINT: the ranks reach each other's store but not each other's transport: set GLOO_SOCKET_IFNAME" in out0
    # neither rank leaves its group (nor rank 0 its timed-out gloo op) to the interpreter's teardown,
    # where a blocked gloo op aborts the process (SIGABRT) after the clear error
    assert "group alive at exit: False" in out0 and "group alive at exit: False" in out1, (out0, out1)
