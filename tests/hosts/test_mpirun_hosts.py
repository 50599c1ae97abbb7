"""A real mpirun (Open MPI) across the two namespace hosts, started on algo-1, its daemons on algo-2
through an rsh agent (conftest.py): both ways ddprun runs under mpirun.

* one `ddprun run` per host (``--map-by ppr:1:node``): the MPI rank is the node rank and each agent
  starts --nproc-per-node workers;
* the script itself, one process per rank (``--map-by ppr:2:node``), calling ddprun.init(): ranks
  come from OMPI_COMM_WORLD_*, gloo uses eth0 although each host's name resolves to 127.0.0.1.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.helpers import DDPRUN, EXAMPLE, REPO, describe, free_port, job_env, run_agents
from tests.hosts.checks import check_trained, reaches_algo1

pytestmark = pytest.mark.hosts

INIT_SCRIPT = str(REPO / "tests" / "integrations" / "scripts" / "init_train.py")


def mpirun_on_algo1(hosts, agent, per_host: int, argv: list[str], tmp_path, timeout=75):
    cmd = ["mpirun", "--allow-run-as-root", "--mca", "plm_rsh_agent", agent,
           "--host", ",".join(f"{h.name}:{per_host}" for h in hosts), "-np", str(per_host * len(hosts)),
           "--map-by", f"ppr:{per_host}:node", "-x", "MASTER_ADDR=algo-1", "-x", f"MASTER_PORT={free_port()}",
           "-x", "OMP_NUM_THREADS=1", *argv]
    return run_agents([hosts[0].cmd(cmd)], timeout=timeout, cwd=tmp_path, env=job_env(OMP_NUM_THREADS="1"))


@pytest.mark.timeout(120)
def test_mpirun_one_ddprun_run_per_host(two_hosts, mpi_rsh_agent, tmp_path):
    out = tmp_path / "out"
    results = mpirun_on_algo1(two_hosts, mpi_rsh_agent, 1, [DDPRUN, "run", "--nproc-per-node", "2", EXAMPLE,
                                                             "--steps", "12", "--out", str(out), "--destroy"], tmp_path)
    facts = check_trained(out, results, two_hosts)
    # MPI rank = node rank: mpirun placed rank 0 on algo-1
    assert {f["NODE_RANK"] for f in facts if f["host"] == "algo-1"} == {"0"}
    assert all(reaches_algo1(f["MASTER_ADDR"], two_hosts) for f in facts if f["host"] == "algo-2")
    assert "static rendezvous at algo-1:" in results[0].output


@pytest.mark.timeout(120)
def test_mpirun_runs_the_script_with_ddprun_init_on_two_hosts(two_hosts, mpi_rsh_agent, tmp_path):
    out = tmp_path / "out"
    results = mpirun_on_algo1(two_hosts, mpi_rsh_agent, 2, [sys.executable, INIT_SCRIPT,
                                                             "--out", str(out)], tmp_path)
    assert results[0].returncode == 0, describe(results)
    facts = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert sorted(f["rank"] for f in facts) == [0, 1, 2, 3], describe(results)
    for f in facts:
        assert f["rank"] == int(f["OMPI_COMM_WORLD_RANK"]) == f["group_rank"]
        assert f["local_rank"] == int(f["OMPI_COMM_WORLD_LOCAL_RANK"])
        assert (f["world_size"], f["local_world_size"], f["group_size"]) == (4, 2, 4)
        assert f["node_rank"] == {"algo-1": 0, "algo-2": 1}[f["host"]] == f["rank"] // 2
        assert f["is_main"] == (f["rank"] == 0) and f["backend"] == "gloo"
        assert f["GLOO_SOCKET_IFNAME"] == "eth0", f  # ddprun.init's network plan, not the loopback name
        assert f["MASTER_ADDR"] == "algo-1", f
    ref = torch.load(out / "params-0.pt", weights_only=True)
    for rank in (1, 2, 3):
        other = torch.load(out / f"params-{rank}.pt", weights_only=True)
        assert all(torch.equal(ref[k], other[k]) for k in ref), f"rank {rank} params differ from rank 0"
