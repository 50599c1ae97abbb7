"""ddprun.launch: a function on 2 CPU processes of this machine, started from this process (and from
``python -c``, whose ``__main__`` is a notebook's: no file to import). The functions here are
closures, or defined in a ``__main__`` namespace, so they can only reach the workers by value."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import ddprun
from ddprun.errors import LaunchTimeout, WorkerFailed
from tests.helpers import job_env

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def quiet_env(monkeypatch):
    """One OpenMP thread per rank (2 shared cores), no launcher variables of an outer job."""
    for key, value in job_env().items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.timeout(90)
def test_every_rank_trains_the_same_parameters_and_returns_them(tmp_path, quiet_env):
    scale = 0.5  # a local the closure captures: sent by value with it

    def work(steps):
        import os

        import torch
        from torch import nn

        torch.manual_seed(0)
        x = torch.randn(64, 4)
        data = torch.utils.data.TensorDataset(x, scale * x.sum(1, keepdim=True))
        result = ddprun.fit(nn.Linear(4, 1), data, loss_fn=nn.functional.mse_loss, batch_size=8, max_steps=steps,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.05), log_every=2)
        env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                                              "MASTER_ADDR", "TORCHELASTIC_RUN_ID")}
        return {"env": env, "steps": result.steps, "params": {k: v.cpu() for k, v in result.model.state_dict().items()}}

    handler = signal.getsignal(signal.SIGINT)
    t0 = time.monotonic()
    out = ddprun.launch(work, 6, nproc_per_node=2, return_all=True, run_dir=str(tmp_path / "run"), timeout=80)
    wall = time.monotonic() - t0
    assert signal.getsignal(signal.SIGINT) is handler, "torch's agent kept its signal handler"
    assert sorted(out) == [0, 1]
    for rank, value in out.items():
        env = value["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"]) == \
            (str(rank), str(rank), "2", "2", "0")
        assert env["MASTER_ADDR"] and env["TORCHELASTIC_RUN_ID"]
        assert value["steps"] == 6
    p0, p1 = out[0]["params"], out[1]["params"]
    assert all(p0[k].equal(p1[k]) for k in p0), "ranks ended with different parameters"
    assert (tmp_path / "run" / "logs" / "rank-1.log").exists() and (tmp_path / "run" / "plan.json").exists()
    print(f"launch of 2 ranks with fit: {wall:.1f} s")


@pytest.mark.timeout(60)
def test_a_failing_rank_is_named_with_its_own_error_and_the_launch_ends(tmp_path, quiet_env):
    # Defined in a namespace called __main__, as in a notebook: pickled by value or not at all.
    ns = {"__name__": "__main__"}
    exec(textwrap.dedent("""
        class Injected(ValueError):
            pass

        def train_step_that_fails():
            import torch.distributed as dist
            import ddprun

            info = ddprun.init()
            if info.rank == 1:
                raise Injected("injected on rank 1")
            dist.barrier()  # rank 0 waits here for a rank that is gone: the launcher must end it
            return "unreachable"
        """), ns)
    fn = ns["train_step_that_fails"]
    assert fn.__module__ == "__main__"
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as caught:
        ddprun.launch(fn, nproc_per_node=2, run_dir=str(tmp_path / "run"), timeout=50)
    wall = time.monotonic() - t0
    err = caught.value
    assert err.rank == 1
    assert err.message == "Injected: injected on rank 1"
    assert type(err.error).__name__ == "Injected" and isinstance(err.error, ValueError)
    assert err.__cause__ is err.error
    assert "train_step_that_fails" in err.traceback and "fnworker" not in err.traceback
    assert "Rank 1 failed: Injected: injected on rank 1" in str(err)
    assert err.log.endswith("rank-1.log")
    assert wall < 30, f"the failure took {wall:.1f} s to end the launch"


@pytest.mark.timeout(60)
def test_the_timeout_ends_a_hung_launch(tmp_path, quiet_env):
    entered = str(tmp_path / "entered")

    def hang():
        import os
        import time

        open(f"{entered}-{os.environ['RANK']}", "w").close()
        time.sleep(300)

    t0, called = time.monotonic(), time.time()
    with pytest.raises(LaunchTimeout, match="timeout of 6 s"):
        ddprun.launch(hang, nproc_per_node=2, run_dir=str(tmp_path / "run"), timeout=6)
    wall = time.monotonic() - t0
    assert wall < 25, f"the timeout of 6 s took {wall:.1f} s"
    for rank in (0, 1):  # every rank's stacks in its log, for the why
        log = (tmp_path / "run" / "logs" / f"rank-{rank}.log").read_text()
        assert "timeout of 6 s reached; this rank was still running (stacks in its log)" in log, log
        assert "Current thread" in log and "(most recent call first)" in log, log
        # the timeout counts from the call: a rank still starting when it struck is not in hang yet,
        # and one may enter hang between its dump and its exit; one in hang well before it is shown there
        mark = f"{entered}-{rank}"
        if os.path.exists(mark) and os.stat(mark).st_mtime < called + 6 - 0.5:
            assert "in hang" in log, log


REPL = """
import json, ddprun
from torch import nn

class Net(nn.Module):                      # a class of __main__, too
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 2)

def describe(tag):
    import os
    return {"tag": tag, "rank": int(os.environ["RANK"]), "params": sum(p.numel() for p in Net().parameters())}

print("RESULT", json.dumps(ddprun.launch(describe, "from-python-c", nproc_per_node=2, run_dir=RUN, timeout=60)))
"""


@pytest.mark.timeout(90)
def test_a_function_of_a_fileless_main_runs_without_a_main_guard(tmp_path):
    code = f"RUN = {str(tmp_path / 'run')!r}\n" + REPL
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=job_env(), capture_output=True, text=True,
                          timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    assert json.loads(line[len("RESULT "):]) == {"tag": "from-python-c", "rank": 0, "params": 8}
