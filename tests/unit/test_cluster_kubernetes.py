"""Kubeflow PyTorchJob: PET_* variables of the training operator, and the older WORLD_SIZE=pods form."""

import pytest

from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import detect, resolve
from ddprun.cluster.kubernetes import KubernetesEnvironment
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError

NODE = NodeFacts(hostname="job-worker-0", cpus=16, cuda_devices=2)
K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def pytorchjob(**extra):
    """Worker 0 of a job with 1 master + 2 workers, nprocPerNode=2 (current operator)."""
    env = dict(K8S, MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="6", RANK="1",
               PET_NNODES="3", PET_NPROC_PER_NODE="2", PET_NODE_RANK="1")
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_detects_pet_or_service_host_with_master_and_rank():
    assert KubernetesEnvironment.detect({"PET_NNODES": "2"})
    assert KubernetesEnvironment.detect(dict(K8S, MASTER_ADDR="m", RANK="0"))
    assert not KubernetesEnvironment.detect(dict(K8S, RANK="0"))
    assert not KubernetesEnvironment.detect({"MASTER_ADDR": "m", "RANK": "0"})


def test_torchrun_does_not_steal_a_pod_without_local_rank():
    assert detect(pytorchjob()).name == "kubernetes"
    assert detect(dict(K8S, MASTER_ADDR="m", MASTER_PORT="1", WORLD_SIZE="2", RANK="1")).name == "kubernetes"
    assert detect(pytorchjob(LOCAL_RANK="0")).name == "torchrun"


def test_pet_variables_give_per_node_topology():
    r = KubernetesEnvironment().read(pytorchjob(), NODE)
    assert r["min_nodes"].value == r["max_nodes"].value == 3 and r["max_nodes"].source == "PET_NNODES=3"
    assert (r["nproc_per_node"].value, r["nproc_per_node"].source) == (2, "PET_NPROC_PER_NODE=2")
    assert (r["node_rank"].value, r["node_rank"].source) == (1, "PET_NODE_RANK=1")
    assert (r["master_addr"].value, r["master_port"].value) == ("job-master-0", 23456)
    assert r["rdzv_backend"].value == "static"
    assert "rank" not in r and "world_size" not in r


def test_pet_master_variables_win_over_plain_ones():
    r = KubernetesEnvironment().read(pytorchjob(PET_MASTER_ADDR="pm", PET_MASTER_PORT="29999"), NODE)
    assert (r["master_addr"].source, r["master_port"].source) == ("PET_MASTER_ADDR=pm", "PET_MASTER_PORT=29999")


def test_elastic_job_uses_rdzv_endpoint_backend_and_range():
    env = {"PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "2", "PET_RDZV_BACKEND": "c10d",
           "PET_RDZV_ENDPOINT": "job-worker-0:29400", "PET_RDZV_ID": "elastic-job", "PET_MAX_RESTARTS": "3"}
    spec = resolve(LaunchConfig(), env, NODE)
    assert (spec.environment, spec.min_nodes, spec.max_nodes, spec.elastic) == ("kubernetes", 1, 3, True)
    assert (spec.master_addr, spec.master_port, spec.rdzv_backend, spec.run_id) == ("job-worker-0", 29400, "c10d", "elastic-job")
    assert spec.node_rank is None


def test_older_operator_world_size_is_the_pod_count():
    env = dict(K8S, MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="3", RANK="2")
    spec = resolve(LaunchConfig(), env, NODE)
    assert (spec.max_nodes, spec.node_rank, spec.rdzv_backend, spec.nproc_per_node) == (3, 2, "static", 2)
    assert "WORLD_SIZE=3" in spec.sources["max_nodes"] and spec.sources["node_rank"] == "RANK=2"


def test_nproc_auto_uses_visible_gpus():
    r = KubernetesEnvironment().read(pytorchjob(PET_NPROC_PER_NODE="auto"), NODE)
    assert r["nproc_per_node"].value == 2 and "auto" in r["nproc_per_node"].source


def test_nproc_gpu_without_gpus_is_an_error():
    with pytest.raises(ClusterError, match="(?s)PET_NPROC_PER_NODE=gpu.*HINT"):
        KubernetesEnvironment().read(pytorchjob(PET_NPROC_PER_NODE="gpu"), NodeFacts("p", 4))


def test_bad_pet_nnodes_is_an_error_naming_it():
    with pytest.raises(ClusterError) as e:
        KubernetesEnvironment().read(pytorchjob(PET_NNODES="3:1"), NODE)
    assert "PET_NNODES='3:1'" in str(e.value) and "HINT" in str(e.value)


def test_bad_rdzv_endpoint_is_an_error():
    with pytest.raises(ClusterError, match="PET_RDZV_ENDPOINT"):
        KubernetesEnvironment().read({"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "host:port"}, NODE)


def test_an_elastic_jobs_max_restarts_are_the_launchs_unless_the_flag_says_otherwise():
    from ddprun.cli import build_parser, config_from_args, with_cluster_restarts

    env = {"PET_NNODES": "1:3", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "job-worker-0:29400",
           "PET_MAX_RESTARTS": "3"}
    spec = resolve(LaunchConfig(), env, NODE, launcher=True)
    assert (spec.extra["max_restarts"], spec.sources["max_restarts"]) == (3, "PET_MAX_RESTARTS=3")

    def restarts(*flags):
        return with_cluster_restarts(config_from_args(build_parser().parse_args(["run", *flags, "t.py"])), spec)
    assert restarts().max_restarts == 3
    assert restarts("--max-restarts", "0").max_restarts == 0 and restarts("--max-restarts", "5").max_restarts == 5
    no_pet = resolve(LaunchConfig(), {k: v for k, v in env.items() if k != "PET_MAX_RESTARTS"}, NODE, launcher=True)
    assert with_cluster_restarts(LaunchConfig(), no_pet).max_restarts == 0


def test_a_max_restarts_that_is_no_count_is_named():
    with pytest.raises(ClusterError, match="PET_MAX_RESTARTS"):
        resolve(LaunchConfig(), {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m",
                                 "PET_MAX_RESTARTS": "lots"}, NODE, launcher=True)


def test_a_loopback_master_in_the_master_pod_of_a_job_of_several_pods_is_that_pods_own_name():
    # operators that set MASTER_ADDR=localhost in the master pod: read as loopback ("every node on this
    # machine"), the store it hosts listened on 127.0.0.1 only and the other pods waited out the join
    master_pod = NodeFacts(hostname="job-master-0", cpus=16, cuda_devices=2)
    env = pytorchjob(MASTER_ADDR="localhost", PET_MASTER_ADDR="localhost", RANK="0", PET_NODE_RANK="0")
    r = KubernetesEnvironment().read(env, master_pod)
    assert r["master_addr"].value == "job-master-0"
    assert r["master_addr"].source == "PET_MASTER_ADDR=localhost in a job of 3 pods: this pod's own name, job-master-0"
    one = KubernetesEnvironment().read(pytorchjob(MASTER_ADDR="localhost", PET_NNODES="1", RANK="0",
                                                  PET_NODE_RANK="0"), master_pod)
    assert one["master_addr"].value == "localhost"  # one pod: loopback is right


@pytest.mark.parametrize(("extra", "node", "run_id"), [
    ({}, NODE, "pytorchjob-job"),  # PyTorchJob without an elastic policy: MASTER_ADDR=<job>-master-0
    ({"MASTER_ADDR": "localhost"}, NodeFacts("job-master-0", 16, 2), "pytorchjob-job"),  # old operator, master pod
    ({"MASTER_ADDR": None, "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29400"}, NODE, "trainjob-tj"),
    ({"MASTER_ADDR": "trainer-0.svc"}, NODE, "k8s-trainer-0.svc"),
    ({"PET_RDZV_ID": "mine"}, NODE, "mine"),
])
def test_the_run_id_is_the_jobs_name_which_a_recreated_pod_shares(extra, node, run_id):
    spec = resolve(LaunchConfig(), pytorchjob(**extra), node)
    assert spec.run_id == run_id and spec.sources["run_id"]


def test_an_ip_master_names_no_run_and_the_launch_makes_one():
    spec = resolve(LaunchConfig(), pytorchjob(MASTER_ADDR="10.1.2.3"), NODE)
    assert spec.run_id == "" and "agreed by the nodes" in spec.sources["run_id"]
