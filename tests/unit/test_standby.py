"""Which environment a standby may become a worker with (agent/standby.py env_mismatch)."""

from ddprun.agent.run import warm_start
from ddprun.agent.standby import env_mismatch


def test_auto_warm_start_wants_a_core_for_the_agent_beside_one_per_standby():
    assert warm_start("auto", 8, 96) and warm_start("auto", 1, 2)
    assert not warm_start("auto", 2, 2) and not warm_start("auto", 8, 8)
    assert warm_start("on", 2, 2) and not warm_start("off", 1, 96)


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
