"""A real mpirun (Debian's openmpi-bin) on this machine.

The main use: mpirun starts the script itself, one process per rank, and ddprun.init() takes the
ranks from Open MPI's variables. And the misuse: mpirun starting `ddprun run` several times on one
node, which is refused with a hint (one `ddprun run` per node is tested across hosts in
tests/hosts/test_mpirun_hosts.py).
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from tests.helpers import DDPRUN, EXAMPLE, REPO, describe, free_port, run_agents
from tests.system import unavailable

pytestmark = pytest.mark.integrations


@pytest.fixture(autouse=True)
def needs_mpirun():
    if shutil.which("mpirun") is None:
        unavailable("mpirun is not installed (apt-get install openmpi-bin)")

INIT_SCRIPT = str(REPO / "tests" / "integrations" / "scripts" / "init_train.py")


def mpirun(np: int, argv: list[str], *extra: str) -> list[str]:
    # --oversubscribe: 4 ranks on 2 cores; root in CI containers needs --allow-run-as-root.
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np), "-x", f"MASTER_PORT={free_port()}",
            "-x", "OMP_NUM_THREADS=1", *extra, *argv]


@pytest.mark.timeout(90)
def test_mpirun_runs_the_script_and_ddprun_init_takes_the_ranks_from_open_mpi(tmp_path):
    out = tmp_path / "out"
    results = run_agents([mpirun(4, [sys.executable, INIT_SCRIPT, "--out", str(out), "--steps", "5"])],
                         timeout=75, cwd=tmp_path)
    assert results[0].returncode == 0, describe(results)
    facts = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert sorted(f["rank"] for f in facts) == [0, 1, 2, 3], describe(results)
    for f in facts:
        assert f["rank"] == int(f["OMPI_COMM_WORLD_RANK"]) == f["group_rank"]
        assert f["local_rank"] == int(f["OMPI_COMM_WORLD_LOCAL_RANK"]) == f["rank"]
        assert (f["world_size"], f["local_world_size"], f["node_rank"], f["group_size"]) == (4, 4, 0, 4)
        assert f["is_main"] == (f["rank"] == 0) and f["distributed"] and f["backend"] == "gloo"
        assert f["device"] == "cpu" and f["MASTER_ADDR"] == "127.0.0.1" and f["steps"] == 5
    ref = torch.load(out / "params-0.pt", weights_only=True)
    for rank in (1, 2, 3):
        other = torch.load(out / f"params-{rank}.pt", weights_only=True)
        assert all(torch.equal(ref[k], other[k]) for k in ref), f"rank {rank} params differ from rank 0"


@pytest.mark.timeout(60)
def test_mpirun_starting_ddprun_run_twice_on_one_node_is_refused_with_a_hint(tmp_path):
    cmd = mpirun(2, [DDPRUN, "run", "--nnodes", "2", "--nproc-per-node", "2", EXAMPLE, "--steps", "5"],
                 "--map-by", "ppr:2:node", "-x", "MASTER_ADDR=127.0.0.1")
    results = run_agents([cmd], timeout=45, cwd=tmp_path)
    r = results[0]
    assert r.returncode not in (0, None), describe(results)
    assert "`ddprun run` was started 2 times on this node by mpirun" in r.output, describe(results)
    assert "HINT" in r.output and "ppr:1:node" in r.output and "ddprun.init()" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "runs").exists()
