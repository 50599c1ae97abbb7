"""SkyPilot: SKYPILOT_NODE_IPS (one IP a line, head first), SKYPILOT_NODE_RANK, SKYPILOT_NUM_GPUS_PER_NODE."""

import pytest

from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import detect, explain, resolve
from ddprun.cluster.skypilot import SkyPilotEnvironment
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError

NODE = NodeFacts(hostname="ip-172-31-19-199", cpus=48, cuda_devices=4)
TASK_ID = "sky-2023-07-06-21-18-31-563597_myclus_1"


def sky(**extra):
    """What SkyPilot exports on the second node of a 2-node `accelerators: A100:4` task."""
    env = {"SKYPILOT_NODE_IPS": "172.31.23.14\n172.31.19.199\n", "SKYPILOT_NODE_RANK": "1",
           "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "4", "SKYPILOT_TASK_ID": TASK_ID,
           "SKYPILOT_CLUSTER_INFO": '{"cluster_name": "myclus", "cloud": "AWS", "region": "us-east-1"}'}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_detects_on_node_ips_and_rank_and_wins_over_sagemaker_and_kubernetes():
    assert SkyPilotEnvironment.detect(sky())
    assert not SkyPilotEnvironment.detect(sky(SKYPILOT_NODE_RANK=None))
    assert not SkyPilotEnvironment.detect({"SKYPILOT_TASK_ID": TASK_ID})
    assert detect({**sky(), "SM_HOSTS": '["algo-1"]', "PET_NNODES": "2"}).name == "skypilot"
    assert detect({**sky(), "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}).name == "mpi"


def test_reads_nodes_rank_head_node_gpus_and_run_id():
    spec = resolve(LaunchConfig(), sky(), NODE, launcher=True)
    assert (spec.environment, spec.max_nodes, spec.node_rank, spec.nproc_per_node) == ("skypilot", 2, 1, 4)
    assert (spec.master_addr, spec.master_port, spec.rdzv_backend) == ("172.31.23.14", 29500, "static")
    assert spec.run_id == TASK_ID
    assert spec.sources["master_addr"] == "first of SKYPILOT_NODE_IPS (the head node)"
    assert spec.sources["nproc_per_node"] == "SKYPILOT_NUM_GPUS_PER_NODE=4"


def test_explain_names_skypilot_and_a_source_for_every_number():
    lines = explain(resolve(LaunchConfig(), sky(), NODE, launcher=True))
    assert lines[0] == "environment: skypilot"
    assert "node_rank: 1  <- SKYPILOT_NODE_RANK=1" in lines
    assert "run_id: 'sky-2023-07-06-21-18-31-563597_myclus_1'  <- SKYPILOT_TASK_ID=" + TASK_ID in lines


def test_older_skypilot_without_num_nodes_counts_the_ips_and_master_port_wins():
    spec = resolve(LaunchConfig(), sky(SKYPILOT_NUM_NODES=None, MASTER_PORT="8008"), NODE, launcher=True)
    assert spec.max_nodes == 2 and "2 nodes: 172.31.23.14,172.31.19.199" in spec.sources["max_nodes"]
    assert (spec.master_port, spec.sources["master_port"]) == (8008, "MASTER_PORT=8008")


def test_cpu_task_keeps_ddprun_default_and_flags_override():
    cpu = NodeFacts(hostname="h", cpus=8)
    assert resolve(LaunchConfig(), sky(SKYPILOT_NUM_GPUS_PER_NODE="0"), cpu, launcher=True).nproc_per_node == 1
    assert resolve(LaunchConfig(nproc_per_node="2"), sky(), NODE, launcher=True).nproc_per_node == 2


@pytest.mark.parametrize("bad, message, seen", [
    ({"SKYPILOT_NODE_IPS": "\n"}, "names no node", "SKYPILOT_NODE_IPS='\\n'"),
    ({"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.1"}, "twice", "10.0.0.1\\n10.0.0.1"),
    ({"SKYPILOT_NUM_NODES": "3"}, "disagree", "SKYPILOT_NUM_NODES=3"),
    ({"SKYPILOT_NODE_RANK": "2"}, "outside", "SKYPILOT_NODE_RANK=2"),
    ({"SKYPILOT_NODE_RANK": "one"}, "not a whole number", "SKYPILOT_NODE_RANK='one'"),
    ({"SKYPILOT_NUM_GPUS_PER_NODE": "4.5"}, "not a whole number", "SKYPILOT_NUM_GPUS_PER_NODE='4.5'"),
])
def test_bad_values_are_one_message_with_the_values_and_a_hint(bad, message, seen):
    with pytest.raises(ClusterError) as e:
        resolve(LaunchConfig(), sky(**bad), NODE, launcher=True)
    text = str(e.value)
    assert message in text and "Seen: " in text and seen in text and "HINT: " in text


def test_plan_explain_names_skypilot(monkeypatch, capsys):
    from ddprun.cli import main

    for key, value in sky().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main(["plan", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "(skypilot)" in out and "rendezvous: 172.31.23.14:29500 (static)" in out
    assert "environment: skypilot" in out and "SKYPILOT_NODE_RANK=1" in out
