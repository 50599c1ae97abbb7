"""Pure helpers of the launcher: OMP threads, --tee parsing, resolution of local launches; and what node 0
publishes at the endpoint when its agent ends."""

from types import SimpleNamespace

import pytest

from ddprun.agent.run import _AgentRun, check_run_root, in_run_dir, omp_threads, parse_local_ranks, prepare, worker_extras
from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import resolve
from ddprun.config import LaunchConfig
from ddprun.cpus import cpu_count
from ddprun.errors import ConfigError

CPU_NODE = NodeFacts(hostname="h", cpus=8)
GPU_NODE = NodeFacts(hostname="g", cpus=32, cuda_devices=4)


def test_omp_threads_is_cores_per_process_unless_the_user_set_it():
    assert omp_threads({}, 4, 16) == "4"
    assert omp_threads({}, 4, 2) == "1"
    assert omp_threads({"OMP_NUM_THREADS": "7"}, 4, 16) is None


def test_the_workers_extras_follow_the_run_id_the_nodes_agreed_on(tmp_path):
    """A node without --rdzv-id proposes a run id, then takes the one agreed: every path in its
    workers' environment must name the agreed run's directory (NCCL's Flight Recorder dump)."""
    spec = resolve(LaunchConfig(nnodes="2", rdzv_endpoint="127.0.0.1:29500"), {}, CPU_NODE)
    cfg = LaunchConfig(log_dir=str(tmp_path))
    run = in_run_dir(prepare(cfg, spec, {}, "h", {"GLOO_SOCKET_IFNAME": "lo"}), "agreed-7")
    assert run.extra_env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "agreed-7" / "logs" / "nccl-trace-rank-")
    assert run.wenv.run_dir == run.rundir.path == str(tmp_path / "agreed-7")
    assert run.extra_env["GLOO_SOCKET_IFNAME"] == "lo" and run.extra_env["TORCH_FR_BUFFER_SIZE"] == "2000"
    mine = {"TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr-"}  # the user's own path is theirs
    assert "TORCH_FR_DUMP_TEMP_FILE" not in in_run_dir(prepare(cfg, spec, mine, "h", {}), "x").extra_env


def test_a_standby_starts_with_the_workers_extras_but_the_run_directory():
    assert worker_extras({}, 4, None) == {"OMP_NUM_THREADS": str(max(1, cpu_count() // 4)), "TORCH_FR_BUFFER_SIZE": "2000",
                                          "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert worker_extras({"OMP_NUM_THREADS": "3"}, 4, "/r/logs")["TORCH_FR_DUMP_TEMP_FILE"] == "/r/logs/nccl-trace-rank-"


def test_tee_values():
    assert parse_local_ranks("0", 4) == set()
    assert parse_local_ranks("3", 3) == {0, 1, 2}
    assert parse_local_ranks("0:3,1:0,2:1", 3) == {0, 2}


def test_gpu_node_defaults_to_every_visible_gpu():
    spec = resolve(LaunchConfig(), {}, GPU_NODE)
    assert spec.nproc_per_node == 4 and spec.device == "cuda"
    assert "every visible GPU" in spec.sources["nproc_per_node"]


def test_cpu_node_defaults_to_one_process_on_a_free_port():
    spec = resolve(LaunchConfig(), {}, CPU_NODE)
    assert (spec.nproc_per_node, spec.device, spec.master_port, spec.rdzv_backend) == (1, "cpu", 0, "c10d")


def test_multi_node_without_endpoint_is_an_error_naming_the_fix():
    with pytest.raises(ConfigError) as e:
        resolve(LaunchConfig(nnodes="2"), {}, CPU_NODE)
    assert "nnodes=2" in str(e.value) and "--rdzv-endpoint" in str(e.value)


def test_endpoint_and_nnodes_range():
    spec = resolve(LaunchConfig(nnodes="2:4", rdzv_endpoint="[fe80::1]:29401", rdzv_id="j"), {}, CPU_NODE)
    assert (spec.min_nodes, spec.max_nodes, spec.master_addr, spec.master_port) == (2, 4, "fe80::1", 29401)
    assert spec.rdzv_endpoint == "[fe80::1]:29401" and spec.run_id == "j"


def test_what_the_defaults_become_on_a_multi_node_launch(tmp_path, monkeypatch):
    """README's flags table: the port is torchrun's 29500, the run goes to runs/<run id>, the stall
    ends the job after as long again, and torch's rendezvous waits --join-timeout for the nodes."""
    monkeypatch.chdir(tmp_path)
    spec = resolve(LaunchConfig(nnodes="2", master_addr="h"), {}, CPU_NODE)
    assert (spec.master_addr, spec.master_port, spec.rdzv_backend) == ("h", 29500, "c10d")
    run = in_run_dir(prepare(LaunchConfig(stall_timeout=40.0, join_timeout=90.0), spec, {}, "h", {}), "r1")
    assert run.rundir.path == str(tmp_path / "runs" / "r1") and run.wenv.stall_end == 40.0
    torch_cfg = _AgentRun.torch_config(SimpleNamespace(run_=run, logs_specs=None))
    assert (torch_cfg.rdzv_configs["join_timeout"], torch_cfg.rdzv_configs["timeout"]) == (90, 90)
    assert (torch_cfg.max_restarts, torch_cfg.monitor_interval, torch_cfg.start_method) == (0, 0.1, "spawn")
    # torch counts whole seconds: a fraction of --join-timeout rounds up, never down to less wait
    run = in_run_dir(prepare(LaunchConfig(join_timeout=1.5), spec, {}, "h", {}), "r2")
    torch_cfg = _AgentRun.torch_config(SimpleNamespace(run_=run, logs_specs=None))
    assert (torch_cfg.rdzv_configs["join_timeout"], torch_cfg.rdzv_configs["timeout"]) == (2, 2)


def test_the_role_given_is_the_workers_role(tmp_path, monkeypatch):
    """torchrun's --role: torch sets each worker's ROLE_NAME from the spec's role."""
    monkeypatch.chdir(tmp_path)
    spec = resolve(LaunchConfig(nnodes="2", master_addr="h"), {}, CPU_NODE)
    for cfg, role in ((LaunchConfig(role="rank"), "rank"), (LaunchConfig(), "trainer")):
        run = in_run_dir(prepare(cfg, spec, {}, "h", {}), "r1")
        assert _AgentRun.torch_config(SimpleNamespace(run_=run, logs_specs=None)).role == role


@pytest.mark.parametrize("nnodes", ["0", "3:2", "x", "1:2:3"])
def test_bad_nnodes(nnodes):
    with pytest.raises(ConfigError, match="HINT"):
        resolve(LaunchConfig(nnodes=nnodes, rdzv_endpoint="h:1"), {}, CPU_NODE)


def test_node_rank_is_honoured_by_static_and_noted_under_c10d():
    static = resolve(LaunchConfig(nnodes="2", node_rank=1, rdzv_backend="static", master_addr="h"), {}, CPU_NODE)
    assert static.node_rank == 1 and static.master_port == 29500
    c10d = resolve(LaunchConfig(nnodes="2", node_rank=1, master_addr="h"), {}, CPU_NODE)
    assert c10d.node_rank is None and any("ignored under c10d" in n for n in c10d.notes)


def test_static_without_node_rank_and_out_of_range_rank_are_errors():
    with pytest.raises(ConfigError, match="--node-rank"):
        resolve(LaunchConfig(nnodes="2", rdzv_backend="static", master_addr="h"), {}, CPU_NODE)
    with pytest.raises(ConfigError, match="outside"):
        resolve(LaunchConfig(nnodes="2", node_rank=2, rdzv_backend="static", master_addr="h"), {}, CPU_NODE)


def test_nproc_gpu_on_a_cpu_node_is_an_error():
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve(LaunchConfig(nproc_per_node="gpu"), {}, CPU_NODE)


def test_the_run_root_is_checked_without_creating_anything(tmp_path):
    check_run_root(LaunchConfig(log_dir=str(tmp_path / "a" / "b")))
    check_run_root(LaunchConfig(run_dir=str(tmp_path / "c" / "run-1")))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()  # made for the user (its parent may be one they cannot write): it is checked
    check_run_root(LaunchConfig(run_dir=str(tmp_path / "mine")))
    (tmp_path / "file").write_text("")
    for cfg, flag in ((LaunchConfig(log_dir=str(tmp_path / "file" / "runs")), "--log-dir"),
                      (LaunchConfig(run_dir=str(tmp_path / "file" / "r" / "run-1")), "--run-dir")):
        with pytest.raises(ConfigError, match=f"{tmp_path / 'file'} is not a directory") as e:
            check_run_root(cfg)
        assert f"Seen: {flag} {tmp_path / 'file'}" in str(e.value) and "HINT" in str(e.value)


def test_standalone_is_one_node_on_loopback_on_a_free_port_over_what_the_environment_says():
    slurm_batch_script = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "a[1-2]", "SLURM_NODEID": "0"}
    for environ in ({}, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}, slurm_batch_script):
        spec = resolve(LaunchConfig(standalone=True, nproc_per_node=2), environ, CPU_NODE, launcher=True)
        assert (spec.min_nodes, spec.max_nodes, spec.master_addr, spec.master_port, spec.rdzv_backend) == \
            (1, 1, "127.0.0.1", 0, "c10d"), environ
        assert spec.sources["master_port"] == "--standalone (a free port)"
        assert spec.environment == "local" and ("SLURM_JOB_ID" not in environ or "the slurm job" in spec.notes[0])


def test_the_job_token_comes_from_the_user_then_the_scheduler_then_is_random_on_one_node_only():
    import re

    from ddprun.agent.run import job_token
    from ddprun.protocol.rundir import new_run_id

    one, two = resolve(LaunchConfig(), {}, CPU_NODE), resolve(LaunchConfig(nnodes="2", rdzv_endpoint="h:1"), {}, CPU_NODE)
    assert job_token({"DDPRUN_JOB_TOKEN": "t0k", "SLURM_JOB_ID": "9"}, two) == "t0k"
    assert job_token({"SLURM_JOB_ID": "9"}, two) == "SLURM_JOB_ID=9"
    assert job_token({"TRAINING_JOB_NAME": "sm-1"}, two) == "TRAINING_JOB_NAME=sm-1"
    assert job_token({}, two) == ""  # multi-node: every node must agree, so nothing random
    assert re.fullmatch(r"[0-9a-f]{32}", job_token({}, one)) and job_token({}, one) != job_token({}, one)
    run_id = new_run_id()
    later = new_run_id()
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", run_id) and later != run_id
    assert later[:15] >= run_id[:15]  # date-time first: run directories sort by when they were made


def test_the_agent_log_takes_fd_2_and_is_appended_to_and_a_launcher_error_reaches_the_console(tmp_path, capfd,
                                                                                              monkeypatch):
    import logging
    import os

    from ddprun.agent.run import AgentLog

    for name in ("torch.distributed", "torch.distributed.elastic", "ddprun.agent"):  # AgentLog reroutes them
        lg = logging.getLogger(name)
        monkeypatch.setattr(lg, "handlers", list(lg.handlers))
        monkeypatch.setattr(lg, "propagate", lg.propagate)
        monkeypatch.setattr(lg, "level", lg.level)
    before = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level, logging.getLogger(n).propagate)
              for n in ("torch.distributed", "torch.distributed.elastic", "ddprun.agent")}
    path = str(tmp_path / "agent-h.log")
    with AgentLog(path):
        os.write(2, b"C++ warning of launch 1\n")
    with pytest.raises(RuntimeError), AgentLog(path) as log:
        os.write(2, b"C++ warning of launch 2\n")
        print("to the console", file=log.console, flush=True)
        raise RuntimeError("boom")
    os.write(2, b"fd 2 is the console again\n")
    with open(path) as f:
        assert f.read() == "C++ warning of launch 1\nC++ warning of launch 2\n"
    for name in ("torch.distributed", "torch.distributed.elastic", "ddprun.agent"):  # as they were, file closed
        lg = logging.getLogger(name)
        assert (lg.handlers, lg.level, lg.propagate) == (before[name][0], before[name][1], before[name][2]), name
    err = capfd.readouterr().err
    assert err == f"to the console\nddprun: the launcher failed: RuntimeError: boom\nSee {path}\nfd 2 is the console again\n"


@pytest.mark.parametrize("how,published", [("signal", False), ("interrupt", False), ("failed", True), ("done", True)])
def test_node_0_publishes_the_jobs_end_only_when_its_end_ends_the_job(tmp_path, monkeypatch, how, published):
    """A signal that stopped node 0's agent alone (SIGQUIT, a SIGTERM --preempt-signals does not name)
    leaves the others to re-form with --max-restarts: an end published then would refuse its relaunch."""
    import io
    from dataclasses import replace

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ddprun.agent import run as run_mod
    from ddprun.agent import torch_agent
    from ddprun.cluster.base import ClusterSpec
    from ddprun.protocol import store as keys
    from ddprun.protocol.store import JobRecord

    class Recording:
        def __init__(self):
            self.sets = {}

        def set(self, key, value):
            self.sets[key] = value

        def close(self):
            pass

    def agent_ends(config, entrypoint, args, hooks):
        hooks.on_workers_started.__self__.job = JobRecord("run-a", 1, 2, 2, 2, 1.0)  # node 0's workers ran
        if how == "signal":
            raise SignalException("Process 1 got signal: 3", 3)
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "failed":
            raise RuntimeError("the rendezvous closed")
        return {}

    monkeypatch.setattr(torch_agent, "run_agent", agent_ends)
    spec = ClusterSpec(environment="test", min_nodes=2, max_nodes=2, nproc_per_node=1, node_rank=0,
                       master_addr="127.0.0.1", master_port=29999, rdzv_backend="static", run_id="run-a", device="cpu")
    store = Recording()
    run = replace(run_mod.prepare(LaunchConfig(run_dir=str(tmp_path)), spec, {}, "node-a", {}),
                  endpoint_store=store)
    run_mod.supervise(run, set(), io.StringIO(), io.StringIO())
    ended = JobRecord.parse(store.sets.get(keys.JOB_KEY))
    assert (ended is not None and ended.ended) is published, store.sets
