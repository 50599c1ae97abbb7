"""`ddprun run` on two real hosts (network namespaces, see conftest.py): 2 hosts x 2 CPU ranks train
examples/torchrun_style.py under SageMaker's environment, a hostfile, and c10d with an endpoint.

Each host's name resolves to 127.0.0.1 on itself, as in the measurement where plain torchrun hangs
or binds loopback: ddprun must find that algo-1 hosts the rendezvous, the address the other host
reaches it at, and eth0 for gloo.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import DDPRUN, EXAMPLE, job_env, run_agents
from tests.hosts.checks import check_trained, reaches_algo1

pytestmark = pytest.mark.hosts

STEPS = ["--steps", "12"]


def run_on_hosts(hosts, argv_for, env_for, tmp_path, timeout=75):
    cmds = [h.cmd(argv_for(h), env_for(h)) for h in hosts]
    return run_agents(cmds, timeout=timeout, cwd=tmp_path, env=job_env(OMP_NUM_THREADS="1"))


@pytest.mark.timeout(120)
def test_sagemaker_two_hosts_of_two(two_hosts, tmp_path):
    out = tmp_path / "out"

    def env_for(h):
        rc = tmp_path / f"resourceconfig-{h.name}.json"
        rc.write_text(json.dumps({"current_host": h.name, "hosts": [x.name for x in two_hosts],
                                  "network_interface_name": "eth0"}))
        return {"SM_HOSTS": json.dumps([x.name for x in two_hosts]), "SM_CURRENT_HOST": h.name,
                "SM_NUM_GPUS": "0", "SM_NETWORK_INTERFACE_NAME": "eth0", "TRAINING_JOB_NAME": "hosts-sm",
                "DDPRUN_SAGEMAKER_RESOURCECONFIG": str(rc)}

    results = run_on_hosts(two_hosts, lambda h: [DDPRUN, "run", "--nproc-per-node", "2", EXAMPLE, *STEPS,
                                                 "--out", str(out), "--destroy"], env_for, tmp_path)
    facts = check_trained(out, results, two_hosts)
    # SageMaker's sorted hosts fix the node ranks: algo-1 is node 0 and hosts the store
    assert {f["NODE_RANK"] for f in facts if f["host"] == "algo-1"} == {"0"}
    remote = [f for f in facts if f["host"] == "algo-2"]
    assert remote and all(reaches_algo1(f["MASTER_ADDR"], two_hosts) for f in remote), remote
    assert "this node hosts the rendezvous; other nodes reach it at 10.231.7.1 via eth0" in results[0].output


@pytest.mark.timeout(120)
def test_hostfile_two_hosts_of_two(two_hosts, tmp_path):
    out = tmp_path / "out"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h.name} slots=2\n" for h in two_hosts))
    results = run_on_hosts(two_hosts, lambda h: [DDPRUN, "run", "--hostfile", str(hostfile), "--rdzv-id", "hosts-hf",
                                                 EXAMPLE, *STEPS, "--out", str(out), "--destroy"],
                           lambda h: {}, tmp_path)
    facts = check_trained(out, results, two_hosts)
    assert {f["NODE_RANK"] for f in facts if f["host"] == "algo-2"} == {"1"}
    remote = [f for f in facts if f["host"] == "algo-2"]
    assert remote and all(reaches_algo1(f["MASTER_ADDR"], two_hosts) for f in remote), remote
    # the interface was found from the route, not named by anyone
    assert "joins the rendezvous; other nodes reach it at 10.231.7.2 via eth0" in results[1].output


@pytest.mark.timeout(120)
def test_c10d_endpoint_on_a_host_whose_name_is_loopback(two_hosts, tmp_path):
    """torch's own guesses fail here: is_host from the name, MASTER_ADDR from getfqdn() = localhost."""
    out = tmp_path / "out"
    results = run_on_hosts(two_hosts, lambda h: [DDPRUN, "run", "--nnodes", "2", "--nproc-per-node", "2",
                                                 "--rdzv-endpoint", "algo-1:29400", "--rdzv-id", "hosts-c10d",
                                                 EXAMPLE, *STEPS, "--out", str(out), "--destroy"],
                           lambda h: {}, tmp_path)
    facts = check_trained(out, results, two_hosts)
    # MASTER_ADDR is rank 0's agent's advertised address: a real address of one host, on every rank
    assert {f["MASTER_ADDR"] for f in facts} <= {h.addr for h in two_hosts}, facts
    assert len({f["MASTER_ADDR"] for f in facts}) == 1
