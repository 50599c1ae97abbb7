"""Which environment wins, how flags lay over it, and what `plan --explain` says."""

import subprocess
import sys

import pytest

from ddprun.cli import build_parser, config_from_args
from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import PRIORITY, detect, explain, resolve
from ddprun.cluster.probe import probe_node
from ddprun.cluster.torchrun import check_slurm_task
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError, ConfigError

NODE = NodeFacts(hostname="gpu01", cpus=32, cuda_devices=4)

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
SLURM = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2",
         "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_GPUS_ON_NODE": "4",
         "SLURM_STEP_ID": "0"}
MPI = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
       "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
SAGEMAKER = {"SM_HOSTS": '["algo-1","algo-2"]', "SM_CURRENT_HOST": "algo-1", "SM_NUM_GPUS": "4"}
KUBERNETES = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "MASTER_ADDR": "m", "MASTER_PORT": "1234", "RANK": "0",
              "WORLD_SIZE": "2"}


def merged(*envs):
    out = {}
    for env in envs:
        out.update(env)
    return out


def test_priority_order_is_the_designed_one():
    assert [e.name for e in PRIORITY] == ["torchrun", "slurm", "mpi", "lsf", "skypilot", "sagemaker",
                                         "kubernetes", "hostfile", "local"]


@pytest.mark.parametrize("envs, winner", [
    ((TORCHRUN, SLURM, MPI, SAGEMAKER, KUBERNETES), "torchrun"),
    ((SLURM, SAGEMAKER, KUBERNETES), "slurm"),
    ((MPI, SAGEMAKER, KUBERNETES), "mpi"),
    ((SAGEMAKER, KUBERNETES), "sagemaker"),
    ((KUBERNETES,), "kubernetes"),
    (({"HOME": "/root"},), "local"),
])
def test_first_detected_environment_wins(envs, winner):
    assert detect(merged(*envs)).name == winner


def test_flags_override_the_environment_and_keep_their_source():
    spec = resolve(LaunchConfig(nproc_per_node="2", master_port=31000), SLURM, NODE)
    assert spec.environment == "slurm"
    assert (spec.nproc_per_node, spec.sources["nproc_per_node"]) == (2, "--nproc-per-node 2")
    assert (spec.master_port, spec.sources["master_port"]) == (31000, "--master-port 31000")
    assert (spec.master_addr, spec.node_rank, spec.rdzv_backend) == ("gpu01", 0, "static")


def test_environment_static_backend_and_node_rank_are_honoured():
    spec = resolve(LaunchConfig(), merged(SLURM, {"SLURM_NODEID": "1"}), NODE)
    assert (spec.node_rank, spec.rdzv_backend) == (1, "static") and not spec.notes


def test_c10d_flag_over_slurm_drops_the_node_rank_with_a_note():
    spec = resolve(LaunchConfig(rdzv_backend="c10d"), merged(SLURM, {"SLURM_NODEID": "1"}), NODE)
    assert spec.node_rank is None and any("SLURM_NODEID=1" in n and "c10d" in n for n in spec.notes)


def test_flags_contradicting_a_per_process_launch_are_errors():
    per_process = merged(MPI, {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    with pytest.raises(ConfigError) as e:
        resolve(LaunchConfig(nproc_per_node="2"), per_process, NODE)
    msg = str(e.value)
    assert "world size 4 (OMPI_COMM_WORLD_SIZE=4)" in msg and "--nproc-per-node 2" in msg and "HINT" in msg


def test_unknown_backend_from_the_environment_is_an_error():
    with pytest.raises(ConfigError, match="(?s)PET_RDZV_BACKEND=zk.*HINT"):
        resolve(LaunchConfig(), {"PET_NNODES": "2", "PET_RDZV_BACKEND": "zk", "PET_RDZV_ENDPOINT": "h:1"}, NODE)


def test_local_and_torchrun_keep_working():
    local = resolve(LaunchConfig(), {}, NODE)
    assert (local.environment, local.nproc_per_node, local.max_nodes, local.rank) == ("local", 4, 1, None)
    tr = resolve(LaunchConfig(), merged(TORCHRUN, {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}), NODE)
    assert (tr.environment, tr.rank, tr.local_rank, tr.world_size, tr.nproc_per_node) == ("torchrun", 1, 1, 2, 2)


RAY_WORKER = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "1",
              "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
"""A Ray Train worker on its second node: no GROUP_WORLD_SIZE."""


def test_a_ray_train_worker_beyond_node_0_counts_the_nodes_from_its_world_size():
    spec = resolve(LaunchConfig(), RAY_WORKER, NODE)
    assert (spec.rank, spec.local_rank, spec.world_size, spec.nproc_per_node) == (5, 1, 8, 4)
    assert spec.max_nodes == 2 and "GROUP_WORLD_SIZE unset" in spec.sources["max_nodes"]
    uneven = resolve(LaunchConfig(), merged(RAY_WORKER, {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2",
                                                         "RANK": "1", "LOCAL_RANK": "0", "NODE_RANK": "3"}), NODE)
    assert uneven.max_nodes == 4  # the node rank is the larger bound


def test_hostfile_flag_wins_over_detected_environments_but_not_torchrun(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("gpu01 slots=4\ngpu02 slots=4\n")
    spec = resolve(LaunchConfig(hostfile=str(path)), SAGEMAKER, NODE)
    assert spec.environment == "hostfile" and any("sagemaker" in n for n in spec.notes)
    spec = resolve(LaunchConfig(hostfile=str(path)), TORCHRUN, NODE)
    assert spec.environment == "torchrun" and any("ignored" in n for n in spec.notes)


@pytest.mark.parametrize("env", [SLURM, merged(MPI, {"MASTER_ADDR": "n0"}), SAGEMAKER, KUBERNETES])
def test_explain_names_the_environment_and_a_source_for_every_number(env):
    spec = resolve(LaunchConfig(), env, NODE)
    lines = explain(spec)
    assert lines[0] == f"environment: {spec.environment}"
    for key in ("min_nodes", "max_nodes", "nproc_per_node", "node_rank", "master_addr", "master_port",
                "rdzv_backend", "run_id"):
        line = next(x for x in lines if x.startswith(f"{key}:"))
        assert "<- " in line and line.split("<- ")[1].strip()


LSF = {"LSB_JOBID": "4711", "LSB_MCPU_HOSTS": "gpu01 4 gpu02 4"}
SKYPILOT = {"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n", "SKYPILOT_NODE_RANK": "0"}


@pytest.mark.parametrize("blank", ["", " "])
@pytest.mark.parametrize("env", [SLURM, merged(MPI, {"MASTER_ADDR": "n0"}), LSF, SKYPILOT, SAGEMAKER, KUBERNETES])
def test_a_blank_master_port_is_read_as_unset_on_every_platform(env, blank):
    """`mpirun -x MASTER_PORT=$UNSET` exports it empty: it was refused as "not a whole number"."""
    unset = resolve(LaunchConfig(), {k: v for k, v in env.items() if k != "MASTER_PORT"}, NODE)
    assert resolve(LaunchConfig(), {**env, "MASTER_PORT": blank}, NODE).master_port == unset.master_port


@pytest.mark.parametrize("env, key, host", [
    (SLURM, "MASTER_ADDR", "gpu01"),  # the first host of the nodelist
    (MPI, "MASTER_ADDR", "127.0.0.1"),  # every rank on this node
    (merged(KUBERNETES, {"PET_MASTER_ADDR": "m"}), "PET_MASTER_ADDR", "m"),  # falls through to MASTER_ADDR
])
def test_a_blank_master_addr_is_read_as_unset_not_as_the_host_blank(env, key, host):
    """It became the rendezvous host '', refused later as "'' does not resolve" without naming the variable."""
    for blank in ("", "  "):
        spec = resolve(LaunchConfig(), {**env, key: blank}, NODE)
        assert spec.master_addr == host and not spec.sources["master_addr"].startswith(f"{key}=")


def test_a_torchrun_worker_with_a_blank_master_addr_is_refused_naming_it():
    with pytest.raises(ClusterError) as e:
        resolve(LaunchConfig(), merged(TORCHRUN, {"MASTER_ADDR": ""}), NODE)
    msg = str(e.value)
    assert "part of its environment is missing" in msg and "MASTER_ADDR=''" in msg and "RANK=1" in msg
    assert "HINT" in msg


def srun_task(procid, localid, **extra):
    """A task of `srun python train.py` in a 2 x 4-task job, with torchrun's variables set as well."""
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": str(procid // 4), "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
           "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_ID": "0",
           "RANK": str(procid), "LOCAL_RANK": str(localid), "WORLD_SIZE": "8", "MASTER_ADDR": "gpu01",
           "MASTER_PORT": "29500"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_rank_variables_a_task_inherited_from_the_batch_script_are_refused_naming_both():
    """`export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID ...; srun python train.py`: RANK=0 in every task."""
    with pytest.raises(ClusterError) as e:
        check_slurm_task(srun_task(5, 1, RANK="0", LOCAL_RANK="0"))
    msg = str(e.value)
    assert "RANK=0 but SLURM_PROCID=5" in msg and "LOCAL_RANK=0 but SLURM_LOCALID=1" in msg
    assert "batch script" in msg and "HINT" in msg and "srun bash -c 'RANK=$SLURM_PROCID" in msg
    with pytest.raises(ClusterError, match="LOCAL_RANK=0 but SLURM_LOCALID=1"):  # a rank that agrees is not enough
        check_slurm_task(srun_task(5, 1, LOCAL_RANK="0"))
    with pytest.raises(ClusterError, match="SLURM_STEP_NUM_TASKS=8"):  # srun -E: the step's count
        check_slurm_task(srun_task(5, 1, RANK="0", SLURM_NTASKS="16", SLURM_STEP_NUM_TASKS="8"))
    check_slurm_task(srun_task(5, 1))  # values that agree read as they did: torchrun's, first
    spec = resolve(LaunchConfig(), srun_task(5, 1), NODE)
    assert (spec.environment, spec.rank, spec.local_rank, spec.world_size) == ("torchrun", 5, 1, 8)


@pytest.mark.parametrize("env", [
    srun_task(5, 1),  # set per task (srun bash -c 'RANK=$SLURM_PROCID ...'): agrees
    srun_task(0, 0, RANK="0", LOCAL_RANK="0"),  # the task the batch step's values happen to fit
    srun_task(0, 0, RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", SLURM_NTASKS="2", TORCHELASTIC_RUN_ID="slurm-77"),
    srun_task(5, 1, RANK="0", SLURM_STEP_ID=None),  # the batch script itself: not an srun task
    srun_task(5, 1, RANK="0", OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="8"),  # mpirun's ranks
    srun_task(1, 0, RANK="12", LOCAL_RANK="4", WORLD_SIZE="16", SLURM_NTASKS="2"),  # mp.spawn under 1 task/node
    srun_task(5, 1, RANK="x"),  # not a number: the reader says so
])
def test_rank_variables_that_are_the_tasks_or_another_launchers_pass(env):
    """Under `srun ddprun run` (TORCHELASTIC_RUN_ID) torch's worker of rank 1 may run in task 0 (c10d)."""
    check_slurm_task(env)


def test_errors_name_the_values_and_a_hint():
    bad = merged(SLURM, {"SLURM_JOB_NODELIST": "gpu[01-"})
    with pytest.raises(ClusterError) as e:
        resolve(LaunchConfig(), bad, NODE)
    assert "gpu[01-" in str(e.value) and "HINT" in str(e.value)


def test_hostfile_flag_parses_into_the_config():
    args = build_parser().parse_args(["plan", "--hostfile", "/etc/hosts.ddp"])
    assert config_from_args(args).hostfile == "/etc/hosts.ddp"
    args = build_parser().parse_args(["run", "--hostfile", "hf", "train.py"])
    assert config_from_args(args).hostfile == "hf"


def test_probe_node_hostname_override_and_addresses():
    node = probe_node({"DDPRUN_HOSTNAME": "algo-1"})
    assert node.hostname == "algo-1" and isinstance(node.addresses, tuple)


def test_cluster_modules_do_not_import_torch():
    code = "import sys, ddprun.cluster.detect; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_gpu_count_asks_torch_only_on_a_node_with_a_gpu_device_file(tmp_path):
    """No /dev/nvidiactl (or the like): 0 without importing torch (~3 s); with one: torch's count."""
    code = ("import sys; from ddprun.cluster.probe import cuda_devices; "
            "print(cuda_devices((sys.argv[1],)), 'torch' in sys.modules)")
    device = tmp_path / "nvidiactl"

    def probe() -> str:
        return subprocess.run([sys.executable, "-c", code, str(device)], capture_output=True, text=True,
                              timeout=60).stdout.strip()

    assert probe() == "0 False"
    device.touch()
    import torch

    assert probe() == f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} True"


def test_a_node_with_an_nvidia_driver_whose_gpus_torch_cannot_use_says_why_it_trains_on_cpu(tmp_path, monkeypatch):
    """A CPU-only torch wheel on a GPU node: one CPU process a node, not four GPUs, and it is said."""
    import torch

    from ddprun.cluster.probe import unused_gpus

    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 22:23:56 UTC 2024\n")
    monkeypatch.setattr(torch.version, "cuda", None)
    why = unused_gpus(0, {}, str(driver))
    assert why.startswith("this node has NVRM version: NVIDIA UNIX x86_64 Kernel Module 550.54.15")
    assert f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch" in why
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert "(CUDA 12.4) cannot use them: check nvidia-smi" in unused_gpus(0, {}, str(driver))
    # GPUs seen, no driver, or hidden on purpose: nothing to say
    assert unused_gpus(4, {}, str(driver)) == unused_gpus(0, {}, str(tmp_path / "none")) == ""
    assert unused_gpus(0, {"CUDA_VISIBLE_DEVICES": "-1"}, str(driver)) == ""
    node = NodeFacts(hostname="gpu01", cpus=32, cuda_devices=0, unused_gpus=why)
    spec = resolve(LaunchConfig(), {}, node, launcher=True)
    assert (spec.nproc_per_node, spec.device) == (1, "cpu") and f"gpu01: {why}" in spec.notes


@pytest.mark.parametrize("flags, environ, source, fix", [
    ({"rdzv_backend": "etcd-v2"}, {}, "--rdzv-backend", "HINT: Use --rdzv-backend c10d"),
    ({}, {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m", "PET_RDZV_BACKEND": "etcd"},
     "PET_RDZV_BACKEND=etcd", "HINT: Set the PyTorchJob's elasticPolicy.rdzvBackend to c10d"),
], ids=["flag", "pytorchjob"])
def test_etcd_rendezvous_is_refused_for_c10d_with_where_it_came_from(flags, environ, source, fix):
    with pytest.raises(ConfigError) as e:
        resolve(LaunchConfig(nnodes="2", master_addr="m", **flags) if flags else LaunchConfig(), environ, NODE,
                launcher=True)
    assert "does not run on torch's etcd rendezvous" in str(e.value) and source in str(e.value)
    assert fix in str(e.value)


def test_the_etcd_refusal_says_the_endpoint_must_change_too():
    """Following the hint with --rdzv-endpoint still at the etcd server would wait out --join-timeout
    for a store that never answers: the hint names the endpoint given."""
    with pytest.raises(ConfigError) as e:
        resolve(LaunchConfig(nnodes="2", rdzv_backend="etcd", rdzv_endpoint="etcd:2379"), {}, NODE, launcher=True)
    assert "The endpoint (--rdzv-endpoint etcd:2379) must then be node 0's host:port" in str(e.value)
    with pytest.raises(ConfigError) as e:  # no endpoint given: nothing to change there
        resolve(LaunchConfig(rdzv_backend="etcd"), {}, NODE, launcher=True)
    assert "HINT: Use --rdzv-backend c10d" in str(e.value) and "The endpoint (" not in str(e.value)


@pytest.mark.parametrize("endpoint, why", [
    ("fe80::1:1234", "ambiguous"),  # torch reads ('fe80::1', 1234); it was [fe80::1:1234]:29500 here
    ("host:", "empty port"),  # torch refuses it; it was host:29500 here
    ("[::1]:", "empty port"),
    ("[::1]29501", "'29501' after its IPv6 address"),  # it was port 29500 here
    ("[::1", "no ']'"),
])
def test_an_endpoint_torch_would_read_otherwise_or_refuse_is_one_error_with_the_bracket_hint(endpoint, why):
    with pytest.raises(ConfigError) as e:
        resolve(LaunchConfig(nnodes="2", rdzv_endpoint=endpoint), {}, NODE, launcher=True)
    assert why in e.value.what and repr(endpoint) in e.value.seen and "[ADDR]:PORT" in e.value.hint


def test_an_ipv6_master_addr_in_brackets_as_torchrun_asks_is_the_address():
    spec = resolve(LaunchConfig(nnodes="2", master_addr="[::1]", master_port=29501), {}, NODE, launcher=True)
    assert (spec.master_addr, spec.master_port, spec.rdzv_endpoint) == ("::1", 29501, "[::1]:29501")
    spec = resolve(LaunchConfig(nnodes="2", rdzv_endpoint="[::1]:29501"), {}, NODE, launcher=True)
    assert (spec.master_addr, spec.master_port) == ("::1", 29501)
    with pytest.raises(ConfigError, match="--master-addr takes the rendezvous host only") as e:
        resolve(LaunchConfig(nnodes="2", master_addr="node1:29500"), {}, NODE, launcher=True)
    assert "--master-port" in e.value.hint


@pytest.mark.parametrize("environ, variable", [
    (merged(KUBERNETES, {"PET_RDZV_ID": "../../tmp/evil"}), "PET_RDZV_ID=../../tmp/evil"),
    (merged(KUBERNETES, {"PET_RDZV_ID": ".."}), "PET_RDZV_ID=.."),
    (merged(SAGEMAKER, {"TRAINING_JOB_NAME": "a/../../b"}), "TRAINING_JOB_NAME=a/../../b"),
])
def test_a_run_id_from_the_environment_that_is_a_path_is_refused_as_rdzv_id_is(environ, variable):
    """runs/<run id>: a run id from a variable must not put the run directory outside runs/ either."""
    with pytest.raises(ConfigError) as e:
        resolve(LaunchConfig(), environ, NODE, launcher=True)
    assert "names the run directory" in e.value.what and variable in e.value.seen and "--rdzv-id" in e.value.hint
    spec = resolve(LaunchConfig(rdzv_id="job1"), environ, NODE, launcher=True)  # the hint's way out
    assert spec.run_id == "job1"
    resolve(LaunchConfig(), environ, NODE)  # a rank reading its environment (ddprun.init) is left alone
