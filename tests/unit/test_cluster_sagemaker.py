"""SageMaker: SM_* variables and resourceconfig.json, node rank from the sorted hosts."""

import json

import pytest

from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import resolve
from ddprun.cluster.sagemaker import SageMakerEnvironment
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError

NODE = NodeFacts(hostname="ip-10-0-0-2", cpus=96, cuda_devices=8)


def sm(**extra):
    env = {"SM_HOSTS": '["algo-2","algo-1","algo-10"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "8",
           "SM_NUM_CPUS": "96", "SM_NETWORK_INTERFACE_NAME": "eth0"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def resourceconfig(tmp_path, **fields):
    data = {"current_host": "algo-2", "current_instance_type": "ml.p4d.24xlarge", "current_group_name": "homogeneousCluster",
            "hosts": ["algo-1", "algo-2"], "network_interface_name": "eth0"}
    data.update(fields)
    path = tmp_path / "resourceconfig.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_detects_on_sm_variables_or_an_existing_resourceconfig(tmp_path):
    assert SageMakerEnvironment.detect({"SM_HOSTS": '["algo-1"]'})
    assert SageMakerEnvironment.detect({"SM_CURRENT_HOST": "algo-1"})
    assert SageMakerEnvironment.detect({"DDPRUN_SAGEMAKER_RESOURCECONFIG": resourceconfig(tmp_path)})
    assert not SageMakerEnvironment.detect({"DDPRUN_SAGEMAKER_RESOURCECONFIG": str(tmp_path / "missing.json")})
    assert not SageMakerEnvironment.detect({})


def test_node_rank_is_the_index_in_the_numerically_sorted_hosts():
    r = SageMakerEnvironment().read(sm(), NODE)
    assert r["node_rank"].value == 1 and "algo-1, algo-2, algo-10" in r["node_rank"].source
    assert r["master_addr"].value == "algo-1"
    assert r["min_nodes"].value == r["max_nodes"].value == 3
    assert r["nproc_per_node"].value == 8 and "every GPU of the instance" in r["nproc_per_node"].source
    assert r["master_port"].value == 29500 and r["rdzv_backend"].value == "static"
    assert (r["ifname"].value, r["ifname"].source) == ("eth0", "SM_NETWORK_INTERFACE_NAME=eth0")


def test_master_port_variable_wins_and_zero_gpus_leaves_the_default():
    r = SageMakerEnvironment().read(sm(MASTER_PORT="7777", SM_NUM_GPUS="0"), NODE)
    assert r["master_port"].value == 7777 and "nproc_per_node" not in r


def test_hosts_and_current_host_from_resourceconfig(tmp_path):
    env = {"DDPRUN_SAGEMAKER_RESOURCECONFIG": resourceconfig(tmp_path)}
    r = SageMakerEnvironment().read(env, NODE)
    assert (r["node_rank"].value, r["max_nodes"].value, r["master_addr"].value) == (1, 2, "algo-1")
    assert "resourceconfig.json" in r["max_nodes"].source and "resourceconfig.json" in r["node_rank"].source
    assert r["ifname"].value == "eth0" and "network_interface_name" in r["ifname"].source


def test_resolve_and_explain_for_sagemaker(tmp_path):
    from ddprun.cluster.detect import explain

    spec = resolve(LaunchConfig(), sm(TRAINING_JOB_NAME="pt-ddp-2024"), NODE)
    assert (spec.environment, spec.node_rank, spec.max_nodes, spec.nproc_per_node) == ("sagemaker", 1, 3, 8)
    assert spec.run_id == "sagemaker-pt-ddp-2024"
    text = "\n".join(explain(spec))
    assert "environment: sagemaker" in text and "SM_NUM_GPUS=8" in text and "SM_NETWORK_INTERFACE_NAME=eth0" in text


def test_current_host_not_in_hosts_is_an_error_with_hint():
    with pytest.raises(ClusterError) as e:
        SageMakerEnvironment().read(sm(SM_CURRENT_HOST="algo-7"), NODE)
    msg = str(e.value)
    assert "algo-7" in msg and "algo-1" in msg and "HINT" in msg


def test_malformed_sm_hosts_is_an_error():
    with pytest.raises(ClusterError, match="SM_HOSTS=algo-1,algo-2"):
        SageMakerEnvironment().read(sm(SM_HOSTS="algo-1,algo-2"), NODE)


def test_broken_resourceconfig_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "resourceconfig.json"
    path.write_text("{not json")
    with pytest.raises(ClusterError) as e:
        SageMakerEnvironment().read({"DDPRUN_SAGEMAKER_RESOURCECONFIG": str(path)}, NODE)
    assert str(path) in str(e.value) and "HINT" in str(e.value)


def test_torchrun_wins_when_sagemaker_already_ran_torchrun():
    from ddprun.cluster.detect import detect

    env = sm(RANK="3", LOCAL_RANK="3", WORLD_SIZE="16", MASTER_ADDR="algo-1", MASTER_PORT="7777")
    assert detect(env).name == "torchrun"


HETERO = [{"instance_group_name": "data", "instance_type": "ml.c5.18xlarge", "hosts": ["algo-2"]},
          {"instance_group_name": "gpu", "instance_type": "ml.p4d.24xlarge", "hosts": ["algo-3", "algo-1"]}]


@pytest.mark.parametrize("from_toolkit", [False, True])
def test_a_heterogeneous_cluster_trains_on_this_hosts_instance_group_only(tmp_path, from_toolkit):
    """SM_HOSTS lists every group's instances; the CPU data group's algo-2 is no node of the job."""
    env = {"DDPRUN_SAGEMAKER_RESOURCECONFIG": resourceconfig(
        tmp_path, current_host="algo-3", current_group_name="gpu", hosts=["algo-1", "algo-2", "algo-3"],
        instance_groups=HETERO)}
    if from_toolkit:  # the training toolkit's variables, the file not read
        env = sm(SM_HOSTS='["algo-1","algo-2","algo-3"]', SM_CURRENT_HOST="algo-3",
                 SM_INSTANCE_GROUPS_DICT=json.dumps({g["instance_group_name"]: g for g in HETERO}),
                 DDPRUN_SAGEMAKER_RESOURCECONFIG=str(tmp_path / "missing.json"))
    r = SageMakerEnvironment().read(env, NODE)
    assert r["max_nodes"].value == 2 and "instance group 'gpu'" in r["max_nodes"].source
    assert (r["node_rank"].value, r["master_addr"].value) == (1, "algo-1")


def test_a_host_outside_the_distributions_instance_groups_is_refused_with_a_hint():
    groups = json.dumps({g["instance_group_name"]: g for g in HETERO})
    env = sm(SM_HOSTS='["algo-1","algo-2","algo-3"]', SM_INSTANCE_GROUPS_DICT=groups,
             SM_DISTRIBUTION_INSTANCE_GROUPS='["gpu"]')
    with pytest.raises(ClusterError, match="(?s)instance group 'data'.*SM_CURRENT_INSTANCE_GROUP"):
        SageMakerEnvironment().read(env, NODE)
    r = SageMakerEnvironment().read(dict(env, SM_CURRENT_HOST="algo-1"), NODE)
    assert r["max_nodes"].value == 2 and "SM_DISTRIBUTION_INSTANCE_GROUPS" in r["max_nodes"].source
