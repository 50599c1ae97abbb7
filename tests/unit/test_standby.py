"""Which environment a standby may become a worker with (agent/standby.py env_mismatch), and when it starts."""

import os

import pytest

from ddprun.agent.run import _flag_topology, processes_here, warm_start
from ddprun.agent.standby import env_mismatch
from ddprun.config import Entry, LaunchConfig


def test_auto_warm_start_wants_a_cpu_for_every_worker_process_on_the_machine():
    assert warm_start("auto", 8, 96) and warm_start("auto", 1, 2) and warm_start("auto", 2, 2)
    assert not warm_start("auto", 4, 2) and not warm_start("auto", 9, 8)
    assert warm_start("on", 4, 2) and not warm_start("off", 1, 96)


def test_every_nodes_processes_count_where_the_rendezvous_is_on_loopback():
    assert processes_here(2, 1, None) == 2  # one node: its own
    assert processes_here(2, 2, "127.0.0.1") == 4 and processes_here(2, 3, "localhost") == 6
    assert processes_here(8, 128, "node1") == 8 and processes_here(8, 128, "10.0.0.1") == 8
    assert processes_here(2, 2, None) is None  # not known before the cluster's environment is read


@pytest.mark.parametrize("flags, topology", [
    ({}, (1, None)),
    ({"standalone": True, "nnodes": "1"}, (1, "localhost")),
    ({"nnodes": "2", "rdzv_endpoint": "127.0.0.1:29500"}, (2, "127.0.0.1")),
    ({"nnodes": "1:4", "rdzv_endpoint": "[::1]:29500"}, (4, "::1")),
    ({"nnodes": "2", "master_addr": "node1"}, (2, "node1")),
    ({"nnodes": "2"}, (2, None)),
    ({"nnodes": "two", "rdzv_endpoint": "127.0.0.1:1"}, (2, None)),  # refused later, by the launch
])
def test_the_flags_topology_for_the_early_standbys(flags, topology):
    assert _flag_topology(LaunchConfig(entry=Entry("train.py"), **flags)) == topology


def test_what_the_launch_sets_per_worker_may_differ():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    worker = {**base, "RANK": "3", "LOCAL_RANK": "1", "MASTER_PORT": "29500", "DDPRUN_RUN_ID": "x",
              "TORCHELASTIC_RUN_ID": "y", "NODE_RANK": "0", "CUDA_VISIBLE_DEVICES": "1"}
    assert env_mismatch({**base, "DDPRUN_STANDBY_FD": "5"}, worker) == []


def test_anything_else_that_differs_is_named():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/a"}
    changed = {**base, "OMP_NUM_THREADS": "4", "LD_PRELOAD": "x.so"}
    del changed["PYTHONPATH"]
    assert env_mismatch(base, changed) == ["LD_PRELOAD", "OMP_NUM_THREADS", "PYTHONPATH"]


@pytest.mark.parametrize("nproc", [["--nproc-per-node", "2"], []], ids=["given", "from-the-node"])
def test_the_agent_starts_its_standbys_before_it_imports_torch(tmp_path, nproc):
    """The standbys' imports overlap the agent's own torch import (~3 s of CPU), not follow it: at
    once when the flags give the count; after the node probe, torch-free on a node without GPUs, else."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    code = textwrap.dedent("""
        import sys
        from ddprun.agent import standby

        def start(self, count, env, argv):
            print(f"standbys: {count}, argv {argv}, torch imported: {'torch' in sys.modules}", flush=True)
            raise SystemExit(7)

        standby.StandbyPool.start = start
        from ddprun.cli import main
        sys.exit(main(["run", "--warm-start", "on", *sys.argv[3:], "--log-dir", sys.argv[1], sys.argv[2]]))
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "runs"), str(script), *nproc], capture_output=True,
                         text=True, timeout=60, env=env)
    assert got.returncode == 7, got.stdout + got.stderr
    count = 2 if nproc else 1  # one CPU process on a node without GPUs
    assert f"standbys: {count}, argv ['{script}'], torch imported: False" in got.stdout, got.stdout + got.stderr


def _busy_pool(n, monkeypatch):
    """A pool of ``n`` standbys still importing: sleeping processes that never read their pipe."""
    import subprocess
    import sys

    from ddprun.agent import standby

    pool = standby.StandbyPool()
    pool.args, pool.env = (sys.executable, "-m", "ddprun.worker"), {"A": "1"}
    for _ in range(n):
        r, w = os.pipe()
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(r,),
                                start_new_session=True)
        os.close(r)  # the child holds the read end
        pool._ready.append(standby._Standby(proc, w))
    return pool


def test_a_go_message_over_64_kib_reaches_a_standby_still_importing_at_once(monkeypatch):
    # HPC module environments pass 64 KiB: the write waited GO_WRITE_S per standby, one after another
    import time

    pool, proc = _busy_pool(2, monkeypatch), None
    try:
        env = {"A": "1", "RANK": "0", "DDPRUN_X": "y" * 200_000}  # a launch variable: it may differ
        t0 = time.monotonic()
        proc = pool.take(pool.args, env, "/", "/dev/null", "/dev/null")
        assert proc is not None and time.monotonic() - t0 < 2 and pool.size == 1
    finally:
        pool.close()
        if proc is not None:
            proc.kill()
            proc.wait()


def test_a_go_message_no_pipe_holds_gives_up_the_standbys_after_one_wait(monkeypatch):
    import time

    from ddprun.agent import standby

    monkeypatch.setattr(standby, "GO_WRITE_S", 0.2)
    monkeypatch.setattr(standby, "_fit_pipe", lambda fd, size: None)  # over /proc/sys/fs/pipe-max-size
    pool = _busy_pool(3, monkeypatch)
    t0 = time.monotonic()
    assert pool.take(pool.args, {"A": "1", "DDPRUN_X": "y" * 200_000}, "/", "/dev/null", "/dev/null") is None
    assert time.monotonic() - t0 < 2 and pool.size == 0  # one wait, then a fresh process for every rank
