"""``python train.py`` with ``ddprun.init()``, started once on every node by a job that states it is one
of its processes but names no process rank (an srun step with one task per node, a PyTorchJob pod,
SageMaker):
that process is its node's rank, as torch's ``env://`` and Lightning take it; never a job of one that
trains alone on every node. Where one process cannot be right, init() says which launcher to use;
rank_info(), a query, never refuses. SkyPilot and LSF name hosts only (a script on the head node alone
is as likely): such a process is a job of one, and init() says so in one line."""

import os

import pytest

from ddprun import runtime
from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import alone_note, one_rank_per_node, resolve
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError

CPU = NodeFacts(hostname="node2", cpus=8, cuda_devices=0)
GPUS4 = NodeFacts(hostname="node2", cpus=8, cuda_devices=4)

SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
              "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
              "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)"}
K8S_OLD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
           "WORLD_SIZE": "3", "RANK": "2"}
K8S_PET = {**K8S_OLD, "PET_NNODES": "3", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "2"}
SAGEMAKER = {"SM_HOSTS": '["algo-1","algo-2"]', "SM_CURRENT_HOST": "algo-2"}
SKYPILOT = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NUM_NODES": "2"}
LSF = {"LSB_JOBID": "42", "LSB_MCPU_HOSTS": "node1 4 node2 4"}


def in_process(environ, node=CPU, joining=True):
    return one_rank_per_node(resolve(LaunchConfig(), environ, node), joining=joining)


@pytest.fixture
def clean_runtime():
    saved = dict(os.environ)
    runtime._reset()
    yield
    runtime._reset()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("environ, rank, world, source", [
    (SLURM_STEP, 1, 2, "SLURM_NODEID=1"),
    (K8S_OLD, 2, 3, "RANK=2"),
    (K8S_PET, 2, 3, "PET_NODE_RANK=2"),
    (SAGEMAKER, 1, 2, "algo-2"),
], ids=["slurm-1-task-per-node", "pytorchjob-older", "pytorchjob-pet", "sagemaker"])
def test_the_nodes_one_process_is_the_nodes_rank_of_a_world_of_nodes(environ, rank, world, source):
    spec = in_process(environ)
    assert (spec.rank, spec.local_rank, spec.world_size, spec.node_rank) == (rank, 0, world, rank)
    assert source in spec.sources["rank"] and "one process on each of" in spec.sources["rank"]
    assert spec.master_addr and spec.master_port > 0


@pytest.mark.parametrize("environ, node, hint", [
    (SKYPILOT, CPU, "make the task's run command `ddprun run train.py`"),
    (SKYPILOT, GPUS4, "make the task's run command `ddprun run train.py`"),
    (LSF, NodeFacts(hostname="node1", cpus=8, cuda_devices=0), "start one `ddprun run` per host from the job "
                                                               "script: blaunch -z"),
], ids=["skypilot", "skypilot-4-gpus", "lsf"])
def test_a_host_that_runs_the_script_itself_where_only_hosts_are_named_is_a_job_of_one_said_in_one_line(
        environ, node, hint):
    """A SkyPilot task's head-node-only eval step, or a helper script, must run, not wait for ranks
    that never come; a script on every host trains alone, and the note says how to train on all."""
    spec = in_process(environ, node)
    assert spec.rank is None and spec.max_nodes == 2
    note = alone_note(spec)
    assert note.startswith(f"ddprun: note: a multi-node {spec.environment} job (2 nodes: ")
    assert "nothing names this process one of its ranks: it runs as a job of one" in note and hint in note


def test_init_on_a_skypilot_head_node_alone_runs_at_once_as_a_job_of_one(clean_runtime, monkeypatch, capsys):
    monkeypatch.setattr(runtime, "_node_facts", lambda: CPU)
    info = runtime.init(environ={**SKYPILOT, "SKYPILOT_NODE_RANK": "0"}, timeout=5)
    assert (info.rank, info.world_size, info.distributed) == (0, 1, False)
    err = capsys.readouterr().err
    assert err.count("ddprun: note: a multi-node skypilot job (2 nodes: ") == 1 and "ddprun run train.py" in err
    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ  # nothing exported for a job of one


def test_ddprun_run_under_the_same_variables_still_starts_the_nodes_workers_itself():
    spec = resolve(LaunchConfig(), SLURM_STEP, GPUS4, launcher=True)  # what the agent plans with
    assert (spec.rank, spec.world_size, spec.nproc_per_node, spec.node_rank) == (None, None, 4, 1)


def test_one_node_is_still_one_process_that_joins_nothing():
    spec = in_process({**SAGEMAKER, "SM_HOSTS": '["algo-2"]'}, GPUS4)
    assert spec.rank is None and spec.max_nodes == 1


@pytest.mark.parametrize("environ, hint, rank, world", [
    ({**SLURM_STEP, "SLURM_GPUS_ON_NODE": "4"}, "srun --ntasks-per-node=4 python train.py", 1, 2),
    ({**K8S_PET, "PET_NPROC_PER_NODE": "4"}, "Make the pod's command `ddprun run train.py`", 2, 3),
    (SAGEMAKER, "torch_distributed", 1, 2),
], ids=["slurm-4-gpus-1-task", "pytorchjob-nproc-4", "sagemaker-4-gpus"])
def test_one_process_on_a_node_planned_for_several_is_refused_by_init_with_the_launcher_to_use(
        environ, hint, rank, world):
    with pytest.raises(ClusterError) as e:
        in_process(environ, GPUS4)
    text = str(e.value)
    assert "started once on its node" in text and "processes per node 4" in text and hint in text
    assert "creates its process group before ddprun.init()" in text  # the way out for model parallel
    spec = in_process(environ, GPUS4, joining=False)  # rank_info(): a query, never refused
    assert (spec.rank, spec.world_size) == (rank, world)


def test_an_elastic_pytorchjob_pod_running_python_is_told_to_use_ddprun_run():
    elastic = {**K8S_PET, "PET_NNODES": "2:3", "PET_RDZV_BACKEND": "c10d"}
    with pytest.raises(ClusterError) as e:
        in_process(elastic)
    assert "only a launcher can give it a rank" in str(e.value) and "by arrival" in str(e.value)
    assert "ddprun run train.py" in str(e.value)
    assert in_process(elastic, joining=False).rank is None  # rank_info(): no rank to give, no error


def test_rank_info_in_such_a_process_reports_the_job(monkeypatch):
    monkeypatch.setattr(runtime, "_node_facts", lambda: CPU)
    info = runtime.rank_info(K8S_OLD)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank,
            info.is_main) == (2, 3, 0, 1, 2, False)


def test_a_process_group_made_before_is_taken_as_it_is_even_where_one_process_per_node_is_refused(monkeypatch):
    """`srun --ntasks-per-node=1 python train.py` that mp.spawn's one process per GPU and makes its own
    group: dist's ranks are the truth, never the one-process-per-node refusal."""
    import torch.distributed as dist

    from ddprun import runtime
    from tests.helpers import free_port, store_server

    monkeypatch.setattr(runtime, "_node_facts", lambda: GPUS4)
    monkeypatch.setattr(runtime, "_use_cuda", lambda environ: False)
    env = {**SLURM_STEP, "SLURM_GPUS_ON_NODE": "4"}
    with pytest.raises(ClusterError):
        runtime._from_environ(env, joining=True)  # what init() reads with no group: one process, 4 planned
    store = store_server(free_port(), 10.0)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        info = runtime.rank_info(env)
        assert (info.rank, info.world_size, info.distributed) == (0, 1, True)
    finally:
        dist.destroy_process_group()


def test_a_torchrun_worker_inside_such_a_job_keeps_its_own_ranks():
    worker = {**K8S_PET, "PET_NPROC_PER_NODE": "4", "LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "4",
              "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    spec = in_process(worker, GPUS4)  # K8S_PET alone would be refused: 4 processes planned per node
    assert (spec.environment, spec.rank, spec.local_rank, spec.world_size) == ("torchrun", 3, 3, 4)
