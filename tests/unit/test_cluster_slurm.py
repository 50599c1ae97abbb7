"""SLURM: nodelists, tasks per node, the two launch styles, and the errors that name the fix."""

import pytest

from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import resolve
from ddprun.cluster.slurm import SlurmEnvironment
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError

NODE = NodeFacts(hostname="gpu03", cpus=64, cuda_devices=4)


def job(**extra):
    """srun --ntasks-per-node=1 on 6 nodes of gpu[01-05,07], as seen by the task on gpu03."""
    env = {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-05,07]", "SLURM_JOB_NUM_NODES": "6",
        "SLURM_NNODES": "6", "SLURM_NODEID": "2", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x6)",
        "SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_STEP_ID": "0",
    }
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def per_process(**extra):
    """srun --ntasks-per-node=4 on gpu[01-02]: the task with SLURM_PROCID=6 (node 1, local 2)."""
    base = dict(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2", SLURM_NODEID="1",
                SLURM_PROCID="6", SLURM_LOCALID="2", SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4",
                SLURM_TASKS_PER_NODE="4(x2)")
    return job(**{**base, **extra})


def read(env):
    return SlurmEnvironment().read(env, NODE)


def test_detects_only_with_job_id_and_nodelist():
    assert SlurmEnvironment.detect(job())
    assert SlurmEnvironment.detect({"SLURM_JOB_ID": "1", "SLURM_NODELIST": "n1"})
    assert not SlurmEnvironment.detect({"SLURM_JOB_ID": "1"})
    assert not SlurmEnvironment.detect({"SLURM_JOB_NODELIST": "n1"})


def test_steps_aside_when_mpirun_started_the_process_inside_an_allocation():
    assert not SlurmEnvironment.detect(job(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="8"))
    assert not SlurmEnvironment.detect(job(PMI_RANK="0", PMI_SIZE="8", MPI_LOCALRANKID="0"))
    # srun --mpi=pmi2 sets PMI_RANK itself: still SLURM.
    assert SlurmEnvironment.detect(job(PMI_RANK="2", PMI_SIZE="6"))


def test_one_task_per_node_is_per_node_mode_with_compressed_nodelist():
    r = read(job())
    assert r["min_nodes"].value == r["max_nodes"].value == 6
    assert r["min_nodes"].source == "SLURM_JOB_NUM_NODES=6"
    assert (r["node_rank"].value, r["node_rank"].source) == (2, "SLURM_NODEID=2")
    assert r["master_addr"].value == "gpu01" and "gpu[01-05,07]" in r["master_addr"].source
    assert (r["nproc_per_node"].value, r["nproc_per_node"].source) == (4, "SLURM_GPUS_ON_NODE=4")
    assert r["rdzv_backend"].value == "static" and "SLURM_NODEID" in r["rdzv_backend"].source
    assert r["run_id"].value == "slurm-4242"
    assert "rank" not in r and "world_size" not in r


def test_master_is_first_host_of_a_mixed_nodelist():
    r = read(job(SLURM_JOB_NODELIST="cpu3,gpu[01-05]", SLURM_JOB_NUM_NODES="6", SLURM_NNODES="6"))
    assert r["master_addr"].value == "cpu3"


def test_port_is_derived_from_the_job_id_and_master_addr_and_master_port_in_the_environment_win():
    r = read(job(SLURM_JOB_ID="123456"))
    assert r["master_port"].value == 15000 + 123456 % 17000 == 19456
    assert "SLURM_JOB_ID=123456" in r["master_port"].source
    assert read(job(MASTER_PORT="31000"))["master_port"].value == 31000
    addr = read(job(MASTER_ADDR="10.1.0.1"))["master_addr"]  # e.g. the first host's InfiniBand address
    assert addr.value == "10.1.0.1" and addr.source == "MASTER_ADDR=10.1.0.1"


@pytest.mark.parametrize("job_id", ["12768", "16999", "19999", "999999"])
def test_the_derived_port_stays_below_the_ephemeral_range(job_id):
    """Linux's default ip_local_port_range is 32768-60999: a port there may be an outgoing connection's."""
    assert 15000 <= read(job(SLURM_JOB_ID=job_id))["master_port"].value < 32768


@pytest.mark.parametrize("addr", ["localhost", "127.0.0.1"])
def test_a_loopback_master_addr_left_in_a_multi_node_job_is_refused_naming_it(addr):
    """Left over from a one-node recipe, it would have every other node dial itself until the join timeout."""
    with pytest.raises(ClusterError) as e:
        read(job(MASTER_ADDR=addr))
    msg = str(e.value)
    assert f"MASTER_ADDR={addr}" in msg and "loopback" in msg and "Unset MASTER_ADDR" in msg and "gpu01" in msg
    one_node = job(MASTER_ADDR=addr, SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_JOB_NODELIST="gpu01",
                   SLURM_NODEID="0", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_TASKS_PER_NODE="1")
    assert read(one_node)["master_addr"].value == addr  # one node: loopback is where the rendezvous is


def test_nproc_falls_back_to_cuda_visible_devices_then_to_the_default():
    r = read(job(SLURM_GPUS_ON_NODE=None, CUDA_VISIBLE_DEVICES="0,1"))
    assert r["nproc_per_node"].value == 2 and "CUDA_VISIBLE_DEVICES=0,1" in r["nproc_per_node"].source
    assert "nproc_per_node" not in read(job(SLURM_GPUS_ON_NODE=None, CUDA_VISIBLE_DEVICES=None))


@pytest.mark.parametrize("hidden", ["-1", "NoDevFiles", "-1,0"])
def test_cuda_visible_devices_that_hide_every_gpu_count_none(hidden):
    """CUDA reads entries up to the first it cannot use: -1 and SLURM's NoDevFiles name no GPU."""
    r = read(job(SLURM_GPUS_ON_NODE=None, CUDA_VISIBLE_DEVICES=hidden))
    assert "nproc_per_node" not in r and "allocated_gpus" not in r
    r = read(job(SLURM_GPUS_ON_NODE=None, CUDA_VISIBLE_DEVICES="0,1,-1,2"))
    assert r["nproc_per_node"].value == 2 and "CUDA stops at '-1'" in r["nproc_per_node"].source


@pytest.mark.parametrize("raw, gpus", [("1gpu2,3", 2), ("0,1,1", None), ("GPU-a1,2", 1), ("GPU-a1,GPU-b2", 2),
                                       ("MIG-a1,GPU-b2", 1), (" 2, 3", 2)])
def test_cuda_visible_devices_is_counted_as_cuda_and_torch_read_it(raw, gpus):
    """torch.cuda._parse_visible_devices' rules: an entry is read as strtoul (``1gpu2`` is 1), a UUID
    list ends at the first entry of another kind, and a GPU named twice hides them all."""
    r = read(job(SLURM_GPUS_ON_NODE=None, CUDA_VISIBLE_DEVICES=raw))
    assert (r["nproc_per_node"].value if "nproc_per_node" in r else None) == gpus


def test_nnodes_falls_back_to_sbatch_nnodes_and_the_nodelist():
    r = read(job(SLURM_JOB_NUM_NODES=None))
    assert r["max_nodes"].source == "SLURM_NNODES=6"
    r = read(job(SLURM_JOB_NUM_NODES=None, SLURM_NNODES=None))
    assert r["max_nodes"].value == 6 and "6 hosts" in r["max_nodes"].source


def test_several_tasks_per_node_is_one_process_per_rank():
    r = read(per_process())
    assert (r["rank"].value, r["local_rank"].value, r["world_size"].value) == (6, 2, 8)
    assert r["rank"].source == "SLURM_PROCID=6" and r["world_size"].source == "SLURM_NTASKS=8"
    assert r["nproc_per_node"].value == 4 and "SLURM_TASKS_PER_NODE=4(x2)" in r["nproc_per_node"].source
    assert r["node_rank"].value == 1


def test_resolve_returns_rank_local_rank_world_size_for_per_process_launch():
    spec = resolve(LaunchConfig(), per_process(), NODE)
    assert (spec.environment, spec.rank, spec.local_rank, spec.world_size) == ("slurm", 6, 2, 8)
    assert (spec.node_rank, spec.rdzv_backend, spec.max_nodes, spec.nproc_per_node) == (1, "static", 2, 4)


def test_tasks_per_node_repetition_format_with_ntasks_per_node_absent():
    r = read(per_process(SLURM_NTASKS_PER_NODE=None, SLURM_TASKS_PER_NODE="2(x2)", SLURM_NTASKS="4",
                         SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_GPUS_ON_NODE="2"))
    assert (r["rank"].value, r["nproc_per_node"].value, r["world_size"].value) == (3, 2, 4)


def test_uneven_tasks_are_an_error_naming_the_counts():
    with pytest.raises(ClusterError) as e:
        read(per_process(SLURM_NTASKS_PER_NODE=None, SLURM_TASKS_PER_NODE="2,1", SLURM_NTASKS="3"))
    msg = str(e.value)
    assert "SLURM_TASKS_PER_NODE=2,1" in msg and "2, 1" in msg and "HINT" in msg and "--ntasks-per-node" in msg


def test_uneven_three_node_layout_is_an_error():
    with pytest.raises(ClusterError, match=r"4\(x3\),2"):
        read(per_process(SLURM_JOB_NODELIST="gpu[01-04]", SLURM_JOB_NUM_NODES="4", SLURM_NNODES="4",
                         SLURM_NTASKS_PER_NODE=None, SLURM_TASKS_PER_NODE="4(x3),2", SLURM_NTASKS="14"))


def test_tasks_per_node_differing_from_gpus_is_an_error_with_hint():
    with pytest.raises(ClusterError) as e:
        read(per_process(SLURM_GPUS_ON_NODE="8"))
    msg = str(e.value)
    assert "SLURM_GPUS_ON_NODE=8" in msg and "4 tasks" in msg and "HINT" in msg and "--ntasks-per-node=8" in msg


def test_malformed_nodelist_is_an_error_with_hint():
    with pytest.raises(ClusterError) as e:
        read(job(SLURM_JOB_NODELIST="gpu[01-05"))
    msg = str(e.value)
    assert "SLURM_JOB_NODELIST='gpu[01-05'" in msg and "HINT" in msg and "gpu[01-05,07]" in msg


def test_node_count_disagreeing_with_nodelist_is_an_error():
    with pytest.raises(ClusterError, match="SLURM_JOB_NUM_NODES=4.*6 hosts"):
        read(job(SLURM_JOB_NUM_NODES="4"))


def test_malformed_tasks_per_node_is_an_error():
    with pytest.raises(ClusterError, match="HINT"):
        read(job(SLURM_TASKS_PER_NODE="2(x"))


def test_cyclic_distribution_is_refused():
    # Under --distribution=cyclic, node 1's local rank 0 is rank 1, not 4.
    with pytest.raises(ClusterError) as e:
        read(per_process(SLURM_PROCID="1", SLURM_LOCALID="0"))
    assert "SLURM_PROCID=1" in str(e.value) and "--distribution=block" in str(e.value)


def test_ntasks_disagreeing_with_tasks_per_node_is_an_error():
    with pytest.raises(ClusterError, match="SLURM_NTASKS=6"):
        read(per_process(SLURM_NTASKS="6"))


def test_multi_node_without_node_id_says_use_srun():
    with pytest.raises(ClusterError) as e:
        read(job(SLURM_NODEID=None))
    assert "SLURM_NODEID=<unset>" in str(e.value) and "srun" in str(e.value)


def test_non_numeric_job_id_is_an_error():
    with pytest.raises(ClusterError, match="SLURM_JOB_ID='abc'"):
        read(job(SLURM_JOB_ID="abc"))


def test_slurm_gpus_torch_cannot_see_still_set_the_processes_and_the_device_stays_cpu():
    """A node whose GPUs SLURM allocated but torch does not see (no driver; a test bed's fake gres)."""
    cpu_node = NodeFacts(hostname="gpu03", cpus=8, cuda_devices=0)
    spec = resolve(LaunchConfig(), job(SLURM_GPUS_ON_NODE="2", CUDA_VISIBLE_DEVICES="0,1"), cpu_node, launcher=True)
    assert (spec.nproc_per_node, spec.device) == (2, "cpu")
    assert spec.sources["nproc_per_node"] == "SLURM_GPUS_ON_NODE=2"
    assert any("SLURM_GPUS_ON_NODE=2, but torch sees no CUDA device on gpu03: 2 process(es) per node run on cpu" in n
               for n in spec.notes), spec.notes
    # the GPUs are visible: no note
    assert not resolve(LaunchConfig(), job(), NODE, launcher=True).notes


def test_sbatch_template_is_the_five_by_four_job():
    from ddprun.cluster.slurm import sbatch_script

    text = sbatch_script("train.py", ["--lr", "1e-3", "--name", "a b"])
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH ")]
    assert directives == ["--job-name=ddprun", "--nodes=5", "--ntasks-per-node=1", "--gpus-per-node=4",
                          "--cpus-per-task=32", "--time=01:00:00", "--output=%x-%j.out",
                          # SIGUSR1 to the steps (no B:), 120 s ahead; a requeued job appends to its output
                          "--signal=USR1@120", "--requeue", "--open-mode=append"]
    # every directive comes before the first command, or sbatch ignores it
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in lines
    assert lines[-1] == "srun ddprun run --requeue --preempt-grace 90 train.py --lr 1e-3 --name 'a b'"
    assert all(len(line) <= 100 for line in lines), [line for line in lines if len(line) > 100]
    assert "5 nodes x 4 GPUs = 20 processes" in text


def test_sbatch_template_flags_and_errors(capsys):
    from ddprun.cli import main
    from ddprun.cluster.slurm import sbatch_script
    from ddprun.errors import ConfigError

    assert main(["slurm-template", "--nodes", "2", "--gpus-per-node", "2", "--cpus-per-task", "6", "--time", "0:30:00",
                 "--partition", "gpu", "--job-name", "exp1", "fit.py", "--epochs", "3"]) == 0
    out = capsys.readouterr().out
    for d in ("--job-name=exp1", "--nodes=2", "--gpus-per-node=2", "--cpus-per-task=6", "--time=0:30:00",
              "--partition=gpu"):
        assert f"#SBATCH {d}\n" in out
    assert out.endswith("srun ddprun run --requeue --preempt-grace 90 fit.py --epochs 3\n")
    with pytest.raises(ConfigError, match="--gpus-per-node must be at least 1") as e:
        sbatch_script(gpus_per_node=0)
    assert "HINT" in str(e.value)
    # the signal's lead sets the grace; no requeue, or neither
    assert main(["slurm-template", "--preempt-lead", "300", "--no-requeue"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --signal=USR1@300\n" in out and "--requeue" not in out and "--open-mode" not in out
    assert out.endswith("srun ddprun run --preempt-grace 225 train.py\n")
    assert main(["slurm-template", "--preempt-lead", "0"]) == 0
    out = capsys.readouterr().out
    assert "--signal" not in out and "--requeue" not in out and out.endswith("srun ddprun run train.py\n")
    assert main(["slurm-template", "--preempt-lead", "10"]) == 2
    assert "--preempt-lead takes 0 (none) or at least 30 seconds.\nSeen: --preempt-lead 10\nHINT: " in \
        capsys.readouterr().err


def test_requeue_needs_a_slurm_job_and_scontrol(tmp_path):
    from ddprun.cluster.slurm import requeue_command
    from ddprun.errors import ConfigError

    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\n")
    scontrol.chmod(0o755)
    assert requeue_command({"SLURM_JOB_ID": "4711", "PATH": str(tmp_path)}) == [str(scontrol), "requeue", "4711"]
    with pytest.raises(ConfigError, match=r"not a SLURM job\.\nSeen: SLURM_JOB_ID unset\nHINT: Drop --requeue"):
        requeue_command({"PATH": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"scontrol, which is not on PATH\.\nSeen: PATH='/nowhere'"):
        requeue_command({"SLURM_JOB_ID": "4711", "PATH": "/nowhere"})


def test_batch_script_of_a_multi_task_job_is_refused_not_left_waiting():
    """sbatch -N2: the batch script has SLURM_NODEID=0 and the job's counts, but no SLURM_STEP_ID."""
    for env in (job(SLURM_STEP_ID=None), per_process(SLURM_STEP_ID=None, SLURM_NODEID="0", SLURM_PROCID="0",
                                                    SLURM_LOCALID="0")):
        with pytest.raises(ClusterError) as e:
            read(env)
        msg = str(e.value)
        assert "not running in an srun step" in msg and "SLURM_STEP_ID=<unset>" in msg
        assert "HINT" in msg and "srun --ntasks-per-node=1 ddprun run train.py" in msg
    # the older spelling counts as a step; a one-task job needs no step
    assert read(job(SLURM_STEP_ID=None, SLURM_STEPID="3"))["node_rank"].value == 2
    one = dict(SLURM_JOB_NODELIST="gpu01", SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_NODEID="0",
               SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_TASKS_PER_NODE="1", SLURM_STEP_ID=None)
    assert read(job(**one))["nproc_per_node"].value == 4


def test_ddprun_run_in_the_batch_script_of_a_one_node_job_of_several_tasks_is_the_nodes_launcher():
    """sbatch -N1 --ntasks-per-node=4 --gres=gpu:4 with `ddprun run train.py` in the script (torchrun's
    usual place): ddprun starts the 4 workers itself. A script that is itself a rank (ddprun.init())
    started there is still refused: the other 3 tasks never start."""
    one = job(SLURM_JOB_NODELIST="gpu01", SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_NODEID="0",
              SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="4",
              SLURM_TASKS_PER_NODE="4", SLURM_STEP_ID=None, SLURMD_NODENAME="gpu01")
    r = SlurmEnvironment().read(one, NODE, launcher=True)
    assert r["nproc_per_node"].value == 4 and r["node_rank"].value == 0 and "rank" not in r
    spec = resolve(LaunchConfig(), one, NODE, launcher=True)
    assert (spec.environment, spec.max_nodes, spec.nproc_per_node, spec.node_rank, spec.rank) == ("slurm", 1, 4, 0, None)
    with pytest.raises(ClusterError, match="not running in an srun step"):
        read(one)
    salloc = {k: v for k, v in one.items() if k != "SLURMD_NODENAME"}  # an salloc shell, maybe on a login host
    with pytest.raises(ClusterError, match="not running in an srun step"):
        SlurmEnvironment().read(salloc, NODE, launcher=True)
    with pytest.raises(ClusterError, match="not running in an srun step"):  # several nodes: srun starts them
        SlurmEnvironment().read(job(SLURM_STEP_ID=None, SLURM_TASKS_PER_NODE="4(x6)", SLURM_NTASKS_PER_NODE="4",
                                    SLURM_NTASKS="24"), NODE, launcher=True)


def test_a_flag_that_changes_the_node_count_slurm_states_is_noted_at_once():
    # --nnodes 4 in a 3-node allocation: the static rendezvous would wait out its join timeout for a
    # fourth node without a word until then
    three = job(SLURM_JOB_NODELIST="gpu[01-03]", SLURM_JOB_NUM_NODES="3", SLURM_NNODES="3", SLURM_NODEID="1",
                SLURM_PROCID="1", SLURM_NTASKS="3", SLURM_TASKS_PER_NODE="1(x3)")
    spec = resolve(LaunchConfig(nnodes="4"), three, NODE, launcher=True)
    assert spec.max_nodes == 4  # the flag wins, as documented
    assert spec.notes == ("--nnodes 4 replaces the node count the slurm environment states (SLURM_JOB_NUM_NODES=3: "
                          "3); a node the job does not have is waited for until --join-timeout.",)
    assert resolve(LaunchConfig(nnodes="3"), three, NODE, launcher=True).notes == ()
    moved = resolve(LaunchConfig(node_rank=2), three, NODE, launcher=True)
    assert len(moved.notes) == 1 and moved.notes[0].startswith("--node-rank 2 replaces this node's rank")


def sweep_step(**extra):
    """`srun -N1 -n1 ddprun run cfg.yaml &` in a 2-node job (gpu[01-02]): the step's task on gpu02."""
    base = dict(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="1", SLURM_NODELIST="gpu02",
                SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE=None,
                SLURM_TASKS_PER_NODE="1", SLURM_STEP_ID="3", SLURM_STEP_NODELIST="gpu02",
                SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1")
    return job(**{**base, **extra})


def test_a_step_over_part_of_the_allocation_plans_the_steps_nodes_not_the_jobs():
    """The job's variables said 2 nodes with 1 task between them: refused over a count not the step's."""
    spec = resolve(LaunchConfig(), sweep_step(), NODE, launcher=True)
    assert (spec.max_nodes, spec.node_rank, spec.nproc_per_node, spec.master_addr) == (1, 0, 4, "gpu02")
    assert spec.sources["max_nodes"] == "SLURM_STEP_NUM_NODES=1"
    assert spec.sources["master_addr"] == "first host of SLURM_STEP_NODELIST=gpu02"
    # srun -E passes the job's SLURM_NNODES and SLURM_NTASKS on; the step's variables still win
    spec = resolve(LaunchConfig(), sweep_step(SLURM_NNODES="2", SLURM_NTASKS="2", SLURM_NODELIST="gpu[01-02]",
                                              SLURM_TASKS_PER_NODE="1(x2)"), NODE, launcher=True)
    assert (spec.max_nodes, spec.node_rank, spec.master_addr) == (1, 0, "gpu02")


def test_a_per_process_step_over_part_of_the_allocation_is_a_world_of_its_own_tasks():
    """`srun -E -N1 -n4 python train.py` in a 2-node job of 8 tasks: world 4 on gpu01, not 8 (a hang)."""
    env = sweep_step(SLURM_NNODES="2", SLURM_NODELIST="gpu[01-02]", SLURM_NTASKS="8", SLURM_TASKS_PER_NODE="4(x2)",
                     SLURM_PROCID="2", SLURM_LOCALID="2", SLURM_STEP_NODELIST="gpu01", SLURM_STEP_NUM_TASKS="4",
                     SLURM_STEP_TASKS_PER_NODE="4")
    spec = resolve(LaunchConfig(), env, NODE)
    assert (spec.rank, spec.local_rank, spec.world_size, spec.max_nodes, spec.master_addr) == (2, 2, 4, 1, "gpu01")
    assert spec.sources["world_size"] == "SLURM_STEP_NUM_TASKS=4"
    assert spec.sources["nproc_per_node"].startswith("SLURM_STEP_TASKS_PER_NODE=4")


def test_a_step_over_the_whole_allocation_reads_as_before_and_the_batch_script_keeps_the_jobs():
    whole = per_process(SLURM_STEP_NODELIST="gpu[01-02]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="8",
                        SLURM_STEP_TASKS_PER_NODE="4(x2)")
    r, before = read(whole), read(per_process())
    assert {k: f.value for k, f in r.items()} == {k: f.value for k, f in before.items()}
    with pytest.raises(ClusterError, match="SLURM_STEP_NUM_NODES and SLURM_STEP_NODELIST disagree"):
        read(sweep_step(SLURM_STEP_NUM_NODES="2"))
    # no SLURM_STEP_ID (the batch script): the job's variables, whatever else is set
    batch = sweep_step(SLURM_STEP_ID=None, SLURM_NNODES="2", SLURM_TASKS_PER_NODE="1(x2)", SLURM_NTASKS="2")
    with pytest.raises(ClusterError, match="not running in an srun step"):
        read(batch)


def test_steps_of_a_sweep_side_by_side_are_each_a_run_of_their_own_with_their_own_port():
    """`srun -N1 ddprun run cfg1 & srun -N1 ddprun run cfg2 &`: under the job's id alone both steps would
    write runs/slurm-<id>/ (one checkpoint directory, each resuming and pruning the other's) and, on
    one first node, take one port. A step over the whole allocation keeps the job's run id."""
    a = resolve(LaunchConfig(), sweep_step(), NODE, launcher=True)
    b = resolve(LaunchConfig(), sweep_step(SLURM_STEP_ID="4", SLURM_STEP_NODELIST="gpu01", SLURM_NODELIST="gpu01"),
                NODE, launcher=True)
    job_id = sweep_step()["SLURM_JOB_ID"]
    assert (a.run_id, b.run_id) == (f"slurm-{job_id}.3", f"slurm-{job_id}.4")
    assert a.master_port != b.master_port
    assert "a step on part of the allocation (gpu02 of gpu[01-02])" in a.sources["run_id"]
    whole = resolve(LaunchConfig(), sweep_step(SLURM_STEP_NODELIST="gpu01,gpu02", SLURM_STEP_NUM_NODES="2",
                                               SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_STEP_NUM_TASKS="2"),
                    NODE, launcher=True)
    assert whole.run_id == f"slurm-{job_id}"  # the same nodes, written otherwise
