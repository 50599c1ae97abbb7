"""ddprun.fit in one process (no process group): it trains, logs, checkpoints, and refuses bad input."""

import csv
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ddprun
from ddprun import runtime
from ddprun.errors import ConfigError
from ddprun.train import checkpoint


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "DDPRUN_RUN_DIR"):
        monkeypatch.delenv(k, raising=False)
    runtime._reset()
    yield
    runtime._reset()


def regression(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :2].sum(dim=1, keepdim=True)
    return TensorDataset(x, y)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def sgd(lr=0.05):
    return lambda params: torch.optim.SGD(params, lr=lr)


def fit(tmp_path, model=None, data=None, **kw):
    kw.setdefault("loss_fn", nn.functional.mse_loss)
    kw.setdefault("run_dir", str(tmp_path / "run"))
    return ddprun.fit(model if model is not None else mlp(), data if data is not None else regression(), **kw)


def test_fit_trains_logs_and_checkpoints(tmp_path):
    data = regression(256)
    before = nn.functional.mse_loss(mlp()(data.tensors[0]), data.tensors[1]).item()
    res = fit(tmp_path, data=data, val_data=regression(40, seed=2), epochs=10, batch_size=32, log_every=20,
              optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
              val_metrics={"mae": lambda out, y: (out - y).abs().mean(dim=1)})
    assert res.steps == 80 and res.epochs == 10 and len(res.history) == 10
    assert res.train_loss < before / 3
    assert res.val_metrics["val_loss"] < before / 3 and res.val_metrics["val_mae"] > 0
    assert isinstance(res.model, nn.Sequential)

    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "epoch", "loss", "val_loss", "val_mae", "samples_per_s", "step_time_s"]
    train_rows = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in train_rows] == [20, 40, 60, 80]
    assert all(float(r["samples_per_s"]) > 0 and float(r["step_time_s"]) > 0 for r in train_rows)
    assert len([r for r in rows if r["val_loss"]]) == 10

    ckdir = tmp_path / "run" / "checkpoints"
    # no temp file and no shared-directory marker left behind
    assert sorted(os.listdir(ckdir)) == [".ddprun-writer.lock", "latest", "step-00000080.meta.json", "step-00000080.pt"]
    assert res.checkpoint == str(ckdir / "step-00000080.pt")
    state = torch.load(res.checkpoint, weights_only=True)
    assert state["format_version"] == checkpoint.FORMAT_VERSION
    assert state["step"] == 80 and state["epoch"] == 10
    assert state["sampler"] == {"epoch": 10, "batches_done": 0, "samples_done": 0, "seed": 0, "num_replicas": 1,
                                "batch_size": 32}
    assert len(state["rng"]) == 1 and set(state["rng"][0]) >= {"torch", "python"}
    assert len(state["history"]) == 10
    for k, v in res.model.state_dict().items():
        assert torch.equal(state["model"][k], v)
    assert checkpoint.load(str(ckdir))["step"] == 80


def test_run_dir_defaults_to_the_launcher_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPRUN_RUN_DIR", str(tmp_path / "from-env"))
    res = ddprun.fit(mlp(), regression(), loss_fn=nn.functional.mse_loss, max_steps=2)
    assert res.run_dir == str(tmp_path / "from-env")
    assert (tmp_path / "from-env" / "metrics.csv").exists()


def test_data_parallel_is_unwrapped_with_a_warning(tmp_path):
    inner = mlp()
    with pytest.warns(UserWarning, match="DataParallel"):
        res = fit(tmp_path, model=nn.DataParallel(inner), max_steps=2)
    assert res.model is inner


def params_after(tmp_path, name, **kw):
    res = fit(tmp_path / name, optimizer=sgd(), **kw)
    return [p.detach().clone() for p in res.model.parameters()]


@pytest.mark.parametrize("n", [64, 72])  # 72: the last group of micro-batches is short (1 of 4)
def test_grad_accumulation_equals_the_big_batch(tmp_path, n):
    data = regression(n)
    big = params_after(tmp_path, "big", data=data, batch_size=32, epochs=2)
    small = params_after(tmp_path, "small", data=data, batch_size=8, grad_accum=4, epochs=2)
    for a, b in zip(big, small):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class Stream(IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(zip(*self.data.tensors))


def test_grad_accumulation_without_a_length_rescales_the_short_last_group(tmp_path):
    data = regression(40)  # 5 micro-batches of 8: groups of 4 and 1
    sized = params_after(tmp_path, "sized", data=DataLoader(data, batch_size=8), grad_accum=4, epochs=2)
    stream = params_after(tmp_path, "stream", data=DataLoader(Stream(data), batch_size=8), grad_accum=4, epochs=2)
    for a, b in zip(sized, stream):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class EpochStream(Stream):
    """A stream that reshuffles by the epoch it is told (as streaming datasets do)."""

    def __init__(self, data):
        super().__init__(data)
        self.told = []

    def set_epoch(self, epoch):
        self.told.append(epoch)


class TellingSampler(torch.utils.data.DistributedSampler):
    def __init__(self, data):
        super().__init__(data, num_replicas=1, rank=0, shuffle=True)
        self.told = []

    def set_epoch(self, epoch):
        self.told.append(epoch)
        super().set_epoch(epoch)


def test_a_sampler_or_iterable_dataset_of_the_users_is_told_each_epoch_in_one_process(tmp_path):
    data = regression(16)
    sampler, stream = TellingSampler(data), EpochStream(data)
    fit(tmp_path, data=DataLoader(data, batch_size=8, sampler=sampler), epochs=3, run_dir=str(tmp_path / "a"))
    fit(tmp_path, data=DataLoader(stream, batch_size=8), epochs=3, run_dir=str(tmp_path / "b"))
    assert sampler.told == [0, 1, 2] and stream.told == [0, 1, 2]


def test_max_steps_runs_past_one_epoch_and_the_scheduler_steps_per_step(tmp_path):
    seen = {}

    def make_sched(opt):
        seen["opt"] = opt
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    res = fit(tmp_path, data=regression(64), batch_size=32, max_steps=5, optimizer=sgd(0.1), scheduler=make_sched)
    assert res.steps == 5 and res.epochs == 2  # 2 steps per epoch: epochs 0, 1 done, 2 started
    assert seen["opt"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 5)
    state = checkpoint.load(res.checkpoint)
    assert state["scheduler"]["last_epoch"] == 5
    assert state["sampler"]["epoch"] == 2 and state["sampler"]["batches_done"] == 1


def test_training_step_runs_under_bf16_autocast_and_the_gradients_are_clipped(tmp_path):
    dtypes, norms = [], []

    def step(model, batch):
        x, y = batch
        out = model(x)
        dtypes.append(out.dtype)
        return 100 * nn.functional.mse_loss(out.float(), y)  # gradients far above the clip norm

    def optimizer(params):
        opt = torch.optim.SGD(params, lr=1e-3)
        opt.register_step_pre_hook(lambda o, *_: norms.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for g in o.param_groups for p in g["params"]])).item()))
        return opt

    res = fit(tmp_path, loss_fn=None, training_step=step, precision="bf16-mixed", grad_clip=0.5, max_steps=3,
              val_data=regression(16), optimizer=optimizer)
    assert res.steps == 3 and "val_loss" in res.val_metrics
    assert dtypes[:3] == [torch.bfloat16] * 3, dtypes  # the forward ran under autocast
    assert norms == pytest.approx([0.5] * 3, rel=1e-3), norms  # clipped to grad_clip at every step


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"grad_accum": 1.5}, "grad_accum"),
    ({"max_steps": -1}, "max_steps"),
    ({"precision": "fp8"}, "Unknown precision"),
    ({"precision": "16"}, "needs CUDA"),
    ({"loss_fn": None}, "needs a way to compute the loss"),
    ({"training_step": lambda m, b: 0}, "both loss_fn and training_step"),
    ({"optimizer": 0.1}, "optimizer must be a callable"),
    ({"grad_clip": 0}, "grad_clip"),
    ({"num_workers": "2"}, "num_workers must be an integer >= 0 or None"),
    ({"num_workers": 2.5}, "num_workers must be an integer"),
    ({"seed": 2**64}, "seed must be an integer >= 0 and < 2"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"val_metrics": ["acc"]}, "val_metrics"),
    ({"loss_fn": lambda out, y: (out - y) ** 2}, "loss_fn must return a scalar loss"),
    ({"loss_fn": None, "training_step": lambda net, batch: net(batch[0])}, "training_step must return a scalar"),
    ({"optimizer": lambda params: "adam"}, "did not return a torch.optim.Optimizer"),
    ({"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau}, "ReduceLROnPlateau"),
])
def test_bad_arguments_are_config_errors_with_a_hint(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        fit(tmp_path, **{"max_steps": 1, **kwargs})
    assert "HINT:" in str(err.value)


def test_bad_model_and_data_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="nn.Module"):
        fit(tmp_path, model=lambda x: x)
    with pytest.raises(ConfigError, match="neither a torch Dataset nor a DataLoader"):
        fit(tmp_path, data=[(torch.zeros(8), torch.zeros(1))])
    with pytest.raises(ConfigError, match="pair"):
        fit(tmp_path, data=TensorDataset(torch.zeros(4, 8)), max_steps=1)


def test_at_the_stop_step_the_checkpoint_is_published_before_on_checkpoint_runs(tmp_path, monkeypatch):
    """A preemption's stop step in fit: rank 0 says the checkpoint is written before the on_checkpoint
    hooks run, so a hook that outlasts the grace cannot hide it from the agents (agent/preemption.py)."""
    from ddprun import preempt
    from ddprun.telemetry import PROGRESS
    from ddprun.train import loop
    from ddprun.worker import progress

    progress.install()  # counts optimizer steps (PROGRESS.steps), as in a ddprun run worker
    published, seen_by_hook = [], []
    state = preempt.PreemptState(stop_step=PROGRESS.steps + 3, signame="SIGTERM", requested=True,
                                 publish=published.append)
    monkeypatch.setattr(loop, "PREEMPT", state)
    with pytest.raises(preempt.Preempted) as e:
        fit(tmp_path, batch_size=8, epochs=5, on_checkpoint=lambda saved: seen_by_hook.append(list(published)))
    assert e.value.step == 3 and e.value.saved.endswith(".pt")
    (steps, fit_step, path, seconds, by), = published
    assert (steps, fit_step, path, by) == (state.stop_step, 3, e.value.saved, "fit") and seconds >= 0
    assert seen_by_hook == [published]  # already said when the hook ran


def test_the_stop_steps_checkpoint_is_published_before_the_barrier_a_stopped_peer_fails(tmp_path, monkeypatch):
    """Every rank waits in a barrier after rank 0 wrote the stop step's checkpoint. A peer stopped
    meanwhile (its node's grace ended) fails that barrier; the file exists, and the next start resumes
    from it, so the agents must have been told (before: they said "the last checkpoint is the one
    before", seen on the SLURM test bed)."""
    from ddprun import preempt, runtime
    from ddprun.telemetry import PROGRESS
    from ddprun.train import loop, resume
    from ddprun.worker import progress

    class PeerGone:
        def __getattr__(self, name):
            return getattr(runtime, name)

        def barrier(self):
            raise RuntimeError("[gloo] Connection closed by peer")

    progress.install()
    published = []
    state = preempt.PreemptState(stop_step=PROGRESS.steps + 3, signame="SIGUSR1", requested=True,
                                 publish=published.append)
    monkeypatch.setattr(loop, "PREEMPT", state)
    monkeypatch.setattr(resume, "runtime", PeerGone())
    with pytest.raises(RuntimeError, match="closed by peer"):
        fit(tmp_path, batch_size=8, epochs=5)
    (steps, fit_step, path, _, by), = published
    assert (steps, fit_step, by) == (state.stop_step, 3, "fit") and path.endswith("step-00000003.pt")
    assert os.path.exists(path)


class Texts(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"text": f"sample {i}"}


def test_validation_of_text_batches_is_a_mean_over_samples_not_over_batches():
    # a batch whose first leaf is a list of strings counted as 1 sample: val_loss was a mean of batch means
    from ddprun.train.loop import _no_amp, _validate

    def value(net, batch):  # each sample's loss is its number: the mean over the 4 samples is 1.5
        return torch.tensor([float(t.split()[1]) for t in batch["text"]]).mean()

    info = runtime.rank_info({})
    loader = DataLoader(Texts(), batch_size=3)  # batches of 3 and 1: a mean of batch means is 2.0
    assert _validate(mlp(), loader, info, loss_fn=None, training_step=value, metrics={}, amp=_no_amp) == {
        "val_loss": 1.5}
    pairs = DataLoader([(f"sample {i}", float(i)) for i in range(4)], batch_size=3)  # (texts, targets)
    assert _validate(mlp(), pairs, info, loss_fn=None, training_step=lambda net, b: b[1].mean(), metrics={},
                     amp=_no_amp) == {"val_loss": 1.5}
