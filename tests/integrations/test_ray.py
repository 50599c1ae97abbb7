"""Real Ray Train (ray[train] 2.60, CPU, gloo): ddprun.ray.fit of an nn.Module and of a LightningModule
on 2 workers of a local Ray cluster, and a worker failure that Ray's FailureConfig retries, resuming
from the last checkpoint ddprun reported. One Ray instance for the module (ray.init takes seconds
on 2 cores); it is shut down by the fixture's finalizer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import extra

ray = extra("ray")
extra("ray.train.torch")

import ddprun.ray  # noqa: E402
from ddprun.errors import WorkerFailed  # noqa: E402

pytestmark = pytest.mark.integrations


@pytest.fixture(scope="module")
def ray_cluster():
    t0 = time.monotonic()
    # 4 logical CPUs on 2 cores: 2 workers of 1 CPU each, plus room for Ray Train's controller.
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    print(f"ray.init: {time.monotonic() - t0:.1f} s")
    try:
        yield
    finally:
        ray.shutdown()


def data(n: int = 128) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :2].sum(1, keepdim=True))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def saver(out: Path):
    """after_fit: each worker saves its final parameters as params-<rank>.pt."""

    def save(result):
        out.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in result.model.state_dict().items()},
                   out / f"params-{os.environ['RANK']}.pt")

    return save


def same_on_both(out: Path) -> dict[str, torch.Tensor]:
    p0, p1 = (torch.load(out / f"params-{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(p0[k], p1[k]) for k in p0), "the two workers ended with different parameters"
    return p0


@pytest.mark.timeout(150)
def test_a_lightning_module_trains_on_two_workers(ray_cluster, tmp_path):
    pl = extra("lightning.pytorch")

    class Regressor(pl.LightningModule):  # local: Ray sends it by value
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    t0 = time.monotonic()
    result = ddprun.ray.fit(Regressor(), data(), num_workers=2, use_gpu=False, storage_path=str(tmp_path / "ray"),
                            name="lightning", run_dir=str(tmp_path / "run"), batch_size=8, max_steps=6,
                            checkpoint_every=3, after_fit=saver(tmp_path / "out"),
                            trainer_kwargs={"enable_progress_bar": False, "enable_model_summary": False})
    print(f"ddprun.ray.fit, LightningModule, 2 workers: {time.monotonic() - t0:.1f} s")
    params = same_on_both(tmp_path / "out")
    assert result.metrics["step"] == 6 and "train_loss" in result.metrics
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["ddprun.json", "last.ckpt"]
    trained = result.model.state_dict()
    assert all(torch.equal(trained[k], params[k]) for k in params)


@pytest.mark.timeout(180)
def test_a_module_trains_on_two_workers_and_a_failed_worker_is_retried_from_the_last_checkpoint(ray_cluster,
                                                                                               tmp_path):
    """One Ray run (each costs ~20 s of Ray's own start-up here): an nn.Module trains on 2 workers to
    the same parameters, which the driver's model gets, with ddprun's checkpoint as Ray's; rank 1
    fails in its 5th step, Ray's FailureConfig retries, and the new attempt resumes at step 3."""
    marker = tmp_path / "failed-once"
    calls = [0]

    def training_step(model, batch):
        calls[0] += 1  # per process: a restarted worker counts from 0 again
        if os.environ["RANK"] == "1" and calls[0] == 5 and not marker.exists():
            marker.touch()
            raise RuntimeError("injected failure in step 5 of rank 1")
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    t0 = time.monotonic()
    result = ddprun.ray.fit(mlp(), data(), num_workers=2, use_gpu=False, storage_path=str(tmp_path / "ray"),
                            name="retry", run_dir=str(tmp_path / "run"), max_failures=1, training_step=training_step,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.05), batch_size=8, max_steps=8,
                            checkpoint_every=3, log_every=4, after_fit=saver(tmp_path / "out"))
    print(f"ddprun.ray.fit with one failure and a retry: {time.monotonic() - t0:.1f} s")
    assert marker.exists(), "the failure was not injected"
    assert result.metrics["step"] == 8
    assert result.metrics["resumed_from_step"] == 3  # the checkpoint of step 3, reported to Ray before the failure
    params = same_on_both(tmp_path / "out")
    assert result.metrics["train_loss"] > 0
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["ddprun.json", "step-00000008.meta.json", "step-00000008.pt"]  # the final one
    trained = result.model.state_dict()  # the driver's model got the final weights
    assert all(torch.equal(trained[k], params[k]) for k in params)
    assert (tmp_path / "run" / "metrics.csv").exists()


def test_a_worker_group_error_becomes_one_worker_failed():
    from ray.train.v2.api.exceptions import WorkerGroupError

    err = ddprun.ray._failure(WorkerGroupError("rank 1 failed", {1: ValueError("bad batch"), 3: ValueError("x")}))
    assert isinstance(err, WorkerFailed) and err.rank == 1 and err.message == "ValueError: bad batch"
    assert isinstance(err.error, ValueError) and "[3]" in str(err)


def rays_worker_group_error(raisers):
    """What Ray Train V2 raises on the driver when these workers raise (rank -> function): each worker's
    error wrapped with its traceback text (thread_runner), unwrapped again by the poll status
    (worker_failures hold the bare exceptions; only the message keeps the text), pickled to the driver."""
    import pickle

    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus
    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    statuses = {}
    for rank, raiser in raisers.items():
        try:
            raiser()
        except Exception as e:  # noqa: BLE001 - whatever the worker raised
            statuses[rank] = WorkerStatus(running=False, error=construct_user_exception_with_traceback(e))
    return pickle.loads(pickle.dumps(WorkerGroupPollStatus(statuses).get_worker_group_error()))


def peer_closed():
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                       "[127.0.0.1]:21345")


def load_batch():
    raise KeyError("y")


def test_the_cause_is_the_rank_that_failed_not_its_echo_with_rays_traceback_text():
    err = ddprun.ray._failure(rays_worker_group_error({0: peer_closed, 1: load_batch, 2: peer_closed}))
    assert err.rank == 1 and err.message == "KeyError: 'y'" and isinstance(err.error, KeyError)
    assert "Traceback" in err.traceback and "in load_batch" in err.traceback and "peer" not in err.traceback
    assert "ranks [0, 2] failed too" in str(err)


def test_fit_raises_from_rays_error_whose_text_has_every_traceback(monkeypatch):
    error = rays_worker_group_error({0: load_batch})

    class Trainer:
        def __init__(self, *args, **kwargs):
            pass

        def fit(self):
            raise error

    monkeypatch.setattr(ddprun.ray, "TorchTrainer", Trainer)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2})
    with pytest.raises(WorkerFailed) as caught:
        ddprun.ray.fit(mlp(), data(), num_workers=1, use_gpu=False)
    assert caught.value.__cause__ is error and "in load_batch" in str(error)
    assert isinstance(caught.value.error, KeyError) and "in load_batch" in caught.value.traceback


def test_resume_is_rays_to_decide():
    from ddprun.errors import ConfigError

    with pytest.raises(ConfigError, match="sets resume itself"):
        ddprun.ray.fit(mlp(), data(), resume=True)


def test_keep_checkpoints_is_checked_before_ray_starts(monkeypatch):
    from ddprun.errors import ConfigError

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init before the arguments were checked"))
    for bad in (0, "2", None):
        with pytest.raises(ConfigError, match="keep_checkpoints must be an integer >= 1") as e:
            ddprun.ray.fit(mlp(), data(), keep_checkpoints=bad)
        assert "HINT" in str(e.value)
