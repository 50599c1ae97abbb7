"""ddprun.init()/rank_info(): who this process is, from an environment mapping; a process group only
when the launcher (or cluster) says there are ranks."""

import os
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ddprun import runtime
from ddprun.errors import ClusterError, ConfigError
from tests.helpers import REPO, free_port, gloo_threads


@pytest.fixture(autouse=True)
def clean_state():
    saved = dict(os.environ)
    runtime._reset()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    runtime._reset()
    os.environ.clear()
    os.environ.update(saved)


def torchrun_env(rank=0, local_rank=0, world=1, local_world=1, group_rank=0, port=29500):
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(group_rank),
            "GROUP_WORLD_SIZE": str(world // local_world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "t"}


def test_import_ddprun_is_cheap():
    code = ("import sys, ddprun; bad = [m for m in sys.modules if m.startswith(('torch', 'lightning'))]; "
            "assert not bad, bad; ddprun.fit; assert 'torch.distributed' in sys.modules; "
            "assert not any(m.startswith('lightning') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_plain_python_is_one_process_without_a_group():
    info = runtime.init(environ={})
    assert (info.rank, info.local_rank, info.node_rank, info.world_size, info.local_world_size) == (0, 0, 0, 1, 1)
    assert info.is_main and not info.distributed and info.device == torch.device("cpu")
    assert not dist.is_initialized()
    assert runtime.init(environ={}) is info  # idempotent
    assert runtime.rank_info() is info


def test_rank_info_reads_the_environment_without_initialising():
    info = runtime.rank_info(torchrun_env(rank=3, local_rank=1, world=4, local_world=2, group_rank=1))
    assert (info.rank, info.local_rank, info.node_rank, info.world_size, info.local_world_size) == (3, 1, 1, 4, 2)
    assert not info.is_main and not info.distributed
    assert not dist.is_initialized()


def test_rank_info_node_rank_follows_the_node_major_rule_under_c10d():
    # resolve() drops GROUP_RANK under c10d; the node rank is rank // processes per node
    info = runtime.rank_info(torchrun_env(rank=5, local_rank=1, world=6, local_world=2, group_rank=2))
    assert info.node_rank == 2


def test_rank_info_of_a_ray_train_worker_reads_its_node_rank():
    # Ray Train sets NODE_RANK but neither GROUP_RANK nor GROUP_WORLD_SIZE; its nodes may hold unequal
    # worker counts, so rank // local world size (5 // 6 = 0) would be wrong here
    ray = {"RANK": "5", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "6", "NODE_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    info = runtime.rank_info(ray)
    assert (info.rank, info.local_rank, info.node_rank, info.world_size, info.local_world_size) == (5, 3, 1, 8, 6)
    even = runtime.rank_info({**ray, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (even.rank, even.local_rank, even.node_rank, even.world_size) == (5, 1, 1, 8)


def test_a_broken_torchrun_environment_is_named():
    env = torchrun_env()
    del env["MASTER_PORT"]
    with pytest.raises(ClusterError, match="HINT"):
        runtime.rank_info(env)


def test_init_in_a_torchrun_worker_of_one_joins_a_gloo_group_and_is_idempotent():
    env = torchrun_env(port=free_port())
    os.environ.update(env)
    info = runtime.init(timeout=30, train_timeout=20)
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert info.distributed and info.backend == "gloo" and info.is_main
    assert runtime.init() is info
    runtime.use_training_timeout()  # barrier of one, then the shorter timeout
    assert runtime._state.tightened
    runtime.use_phase_timeout()
    assert not runtime._state.tightened


def test_the_group_init_made_is_destroyed_at_a_normal_exit(monkeypatch):
    """A gloo group left alive at exit can abort the process (SIGABRT) after its work was done."""
    registered = []
    monkeypatch.setattr(runtime.atexit, "register", registered.append)
    os.environ.update(torchrun_env(port=free_port()))
    runtime.init(timeout=30)
    assert registered == [runtime._destroy_at_exit]
    before = gloo_threads()
    runtime._destroy_at_exit()
    assert not dist.is_initialized() and gloo_threads() < before  # destroyed and freed, threads joined


def test_a_group_the_script_destroyed_while_its_objects_hold_it_ends_with_its_threads_before_the_finalization():
    """The script destroys its group while an object of its own (in a reference cycle: only the
    collector frees it) still holds it. The group stays until exit, then ends in the atexit handler,
    its threads joined: none is left to release a work in the interpreter's finalization, where that
    aborts the rank with SIGABRT (seen under srun; pgkeep.py)."""
    import torch.distributed.distributed_c10d as c10d

    from ddprun import pgkeep

    before = gloo_threads()
    os.environ.update(torchrun_env(port=free_port()))
    runtime.init(timeout=30)
    holder = {"group": c10d.GroupMember.WORLD}
    holder["self"] = holder
    dist.destroy_process_group()
    del holder
    assert not dist.is_initialized() and len(pgkeep.KEPT) == 1
    assert gloo_threads() > before  # kept: no destructor ran while the script did
    runtime._destroy_at_exit()
    assert pgkeep.KEPT == [] and gloo_threads() == before


DDP_AT_EXIT = """
import os
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from ddprun import runtime
from tests.helpers import gloo_threads

runtime.init(timeout=30)
model = DDP(nn.Linear(4, 4))
model(torch.randn(2, 4)).sum().backward()
dist.destroy_process_group()
del model
alive = gloo_threads()
runtime._destroy_at_exit()
print(alive, gloo_threads())
"""


def test_a_group_a_ddp_model_was_built_on_ends_with_its_threads_at_exit_too():
    """DDP's construction imports torch._dynamo, whose import keeps the default group (references the
    collector does not see) past destroy_process_group and the atexit handler, to the finalization:
    ddprun.init() imports it before the group. A fresh interpreter: this one imported it long ago."""
    env = {**os.environ, **torchrun_env(port=free_port()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", DDP_AT_EXIT], capture_output=True, text=True, timeout=90, env=env,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    alive, left = (int(v) for v in done.stdout.split())
    assert alive > 0 and left == 0, done.stdout


def test_the_group_is_kept_after_an_unhandled_exception_and_a_group_the_script_destroyed_is_freed(monkeypatch):
    """Peers may still be in a collective with this rank: destroying could block there. A group the
    script had destroyed is freed all the same (else the finalization frees it, and may abort)."""
    from ddprun import pgkeep

    os.environ.update(torchrun_env(port=free_port()))
    runtime.init(timeout=30)
    dist.destroy_process_group(dist.new_group([0]))
    assert len(pgkeep.KEPT) == 1
    monkeypatch.setattr(sys, "last_value", ValueError("the script failed"), raising=False)
    runtime._destroy_at_exit()
    assert dist.is_initialized() and pgkeep.KEPT == []


def test_a_destroy_that_hangs_at_exit_is_left_after_its_limit(monkeypatch, capsys):
    import threading
    import time

    os.environ.update(torchrun_env(port=free_port()))
    runtime.init(timeout=30)
    real_destroy, released = dist.destroy_process_group, threading.Event()
    # hangs until the test has seen the limit, then destroys the group: nothing outlives the test
    monkeypatch.setattr(dist, "destroy_process_group", lambda: released.wait(30) and real_destroy())
    t0 = time.monotonic()
    try:
        runtime._destroy_at_exit(limit_s=0.3)
        assert time.monotonic() - t0 < 2
    finally:
        released.set()
        for t in threading.enumerate():
            if t.name == "ddprun-end-groups":
                t.join(10)
    assert "ddprun: ending the process groups did not finish within 0.3 s; exiting without it." in capsys.readouterr().err
    assert not dist.is_initialized()


def test_under_ddprun_runs_hard_exit_init_leaves_the_teardown_to_it(monkeypatch):
    registered = []
    monkeypatch.setattr(runtime.atexit, "register", registered.append)
    os.environ.update(torchrun_env(port=free_port()), DDPRUN_RUN_DIR="/nonexistent/run")
    runtime.init(timeout=30)
    assert registered == []


def test_init_uses_an_existing_process_group_and_leaves_its_timeout(monkeypatch):
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(hours=2))
    info = runtime.init(environ={})
    assert info.distributed and info.world_size == 1 and info.rank == 0 and info.backend == "gloo"
    calls = []  # fit's first step and its checkpoints would set ddprun's timeouts on the user's group
    monkeypatch.setattr(runtime, "_set_timeout", lambda seconds: calls.append(seconds) or True)
    runtime.use_training_timeout()
    runtime.use_phase_timeout()
    assert calls == []


def test_init_exports_what_env_init_needs_for_per_process_clusters():
    spec = SimpleNamespace(environment="slurm", master_addr="node1", master_port=29500, rank=3, world_size=8,
                           local_rank=1)
    target = {"RANK": "3"}
    runtime._export(spec, target)
    assert target == {"MASTER_ADDR": "node1", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "8",
                      "LOCAL_RANK": "1"}
    with pytest.raises(ClusterError, match="RANK=2 \\(set\\) vs 3 \\(slurm\\)"):
        runtime._export(spec, {"RANK": "2"})
    blank = {"MASTER_ADDR": "", "MASTER_PORT": " "}  # mpirun -x MASTER_ADDR=$UNSET: detection read it as unset
    runtime._export(spec, blank)
    assert (blank["MASTER_ADDR"], blank["MASTER_PORT"]) == ("node1", "29500")


def test_bad_timeouts_are_config_errors():
    with pytest.raises(ConfigError, match="HINT"):
        runtime.init(timeout=0, environ={})


def slurm_task(**extra):
    """srun --ntasks-per-node=4 --gpus-per-task=1 on gpu[01-02]: the task with SLURM_PROCID=6 (node 1,
    local 2), which SLURM's per-task binding shows its own GPU only."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
           "SLURM_NODEID": "1", "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_GPUS_ON_NODE": "4",
           "SLURM_STEP_ID": "0", "CUDA_VISIBLE_DEVICES": "2"}
    return {**env, **extra}


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch sees n CUDA devices (no CUDA call is made)."""
    import torch

    def see(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return see


def test_a_task_a_per_process_launcher_gave_one_gpu_trains_on_it_whatever_its_local_rank(gpus):
    gpus(1)
    info = runtime.rank_info(slurm_task())
    assert (info.rank, info.local_rank, info.node_rank, info.world_size) == (6, 2, 1, 8)
    assert info.device == torch.device("cuda", 0)  # its one visible GPU (physical GPU 2)
    gpus(4)  # srun without per-task binding: every task sees the node's GPUs
    assert runtime.rank_info(slurm_task(CUDA_VISIBLE_DEVICES="0,1,2,3")).device == torch.device("cuda", 2)


def test_workers_of_torchs_agent_that_see_one_gpu_are_still_refused_a_local_rank_past_it(gpus):
    # torch's agent shows every worker the node's GPUs: one GPU for local rank 1 is a launch of too
    # many processes, not a per-process binding
    gpus(1)
    with pytest.raises(ConfigError, match="local rank has no GPU of its own"):
        runtime.rank_info({**torchrun_env(rank=1, local_rank=1, world=2, local_world=2), "CUDA_VISIBLE_DEVICES": "0"})


def test_an_mpirun_wrapper_that_exports_torchruns_variables_and_one_gpu_a_rank_binds_each_to_its_gpu(gpus):
    """``export RANK=$OMPI_COMM_WORLD_RANK LOCAL_RANK=... WORLD_SIZE=... CUDA_VISIBLE_DEVICES=$LOCAL_RANK``:
    the variables look like torchrun's, but no torch agent (TORCHELASTIC_RUN_ID) shows the node's GPUs."""
    gpus(1)
    env = {**torchrun_env(rank=3, local_rank=3, world=4, local_world=4), "CUDA_VISIBLE_DEVICES": "3"}
    del env["TORCHELASTIC_RUN_ID"]
    assert runtime.rank_info(env).device == torch.device("cuda", 0)
    env.update(RANK="0", LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="0")  # local rank 0: bound too (Lightning asks)
    assert runtime.rank_info(env).bound and not runtime.rank_info({**env, "TORCHELASTIC_RUN_ID": "t"}).bound


def test_a_task_with_the_batch_scripts_rank_is_refused_before_joining_but_a_group_made_already_is_used():
    """`export RANK=$SLURM_PROCID ...` in the batch script: every task had RANK=0, hosted the store and
    waited out the init timeout. A group that exists (Ray Train's, mp.spawn's) has its own ranks."""
    stale = slurm_task(RANK="0", LOCAL_RANK="0", WORLD_SIZE="8", MASTER_ADDR="gpu01", MASTER_PORT="29500",
                       CUDA_VISIBLE_DEVICES="0,1,2,3")
    with pytest.raises(ClusterError, match="RANK=0 but SLURM_PROCID=6"):
        runtime.rank_info(stale)
    with pytest.raises(ClusterError, match="not this srun task's own"):
        runtime.init(environ=stale)
    assert not dist.is_initialized()
    own = runtime.rank_info({**stale, "RANK": "6", "LOCAL_RANK": "2"})  # set in each task: as before
    assert (own.rank, own.local_rank, own.world_size) == (6, 2, 8)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert runtime.rank_info(stale).rank == 0


def test_a_process_group_the_user_made_under_a_per_task_launcher_uses_the_tasks_one_gpu(gpus):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    gpus(1)
    info = runtime.rank_info(slurm_task())  # local rank 2 of its node, its one GPU bound by srun
    assert (info.local_rank, info.device, info.distributed) == (2, torch.device("cuda", 0), True)


def test_the_others_wait_for_a_checkpoint_write_as_long_as_the_stall_watch_lets_it_run(monkeypatch, tmp_path):
    # they waited with init's timeout (600 s) while the stall watch lets a busy phase run
    # 4 x --stall-timeout (1200 s by default): a healthy 15-minute write failed the job
    from ddprun.train.resume import Checkpoints

    os.environ.update(torchrun_env(port=free_port()), DDPRUN_RUN_DIR=str(tmp_path), DDPRUN_STALL_TIMEOUT="300")
    info = runtime.init(timeout=30, train_timeout=20)
    runtime.use_training_timeout()
    set_to = []
    monkeypatch.setattr(runtime, "_set_timeout", lambda seconds: set_to.append(seconds) or True)
    Checkpoints(str(tmp_path / "ck"), info, keep=1).save(1, 0, lambda rngs: {"step": 1, "rng": rngs})
    assert set_to == [1200.0, 20]  # the write's wait, then the training timeout again
    os.environ["DDPRUN_STALL_TIMEOUT"] = "0"  # no stall watch: init's timeout
    assert runtime._phase_timeout(30, os.environ) == 30
