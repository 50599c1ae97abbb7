"""Real Lightning (2.x, CPU, gloo): ddprun.fit with a LightningModule, trainer_kwargs(), an unmodified
Lightning script under `ddprun run`, and a Trainer that disagrees with the launch.

Two `ddprun run` agents on 127.0.0.1 are two nodes. Every Lightning process imports lightning
(seconds on 2 shared cores): the multi-process tests are few and small.
"""

from __future__ import annotations

import argparse
import enum
import json
import re
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from tests.faults.conftest import assert_nothing_left
from tests.helpers import DDPRUN, ddprun_nodes, describe, extra, run_agents

pl = extra("lightning.pytorch")

from ddprun.errors import CheckpointError, ConfigError  # noqa: E402

pytestmark = pytest.mark.integrations

SCRIPTS = Path(__file__).parent / "scripts"
FIT = str(SCRIPTS / "lightning_fit.py")
BORING = str(SCRIPTS / "boring_unmodified.py")
QUIET = {"enable_progress_bar": False, "enable_model_summary": False}


def facts(out: Path, pattern: str = "rank-*.json") -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]


# -- in this process ------------------------------------------------------------------------------

def test_trainer_kwargs_follow_the_launch(clean_runtime):
    from lightning.pytorch.strategies import DDPStrategy

    from ddprun.lightning import DdprunEnvironment, trainer_kwargs
    from ddprun.mismatch import TrainerMismatch

    assert trainer_kwargs() == {"accelerator": "cpu", "devices": 1, "num_nodes": 1, "strategy": "auto"}
    for key, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                       "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511",
                       "TORCHELASTIC_RUN_ID": "t"}.items():
        clean_runtime.setenv(key, value)
    kw = trainer_kwargs()
    assert (kw["accelerator"], kw["devices"], kw["num_nodes"]) == ("cpu", 2, 2)
    strategy = kw["strategy"]
    assert isinstance(strategy, DDPStrategy) and strategy.process_group_backend == "gloo"
    env = strategy.cluster_environment
    assert isinstance(env, DdprunEnvironment) and env.creates_processes_externally
    assert (env.global_rank(), env.local_rank(), env.node_rank(), env.world_size()) == (3, 1, 1, 4)
    assert (env.main_address, env.main_port) == ("127.0.0.1", 29511)
    env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(TrainerMismatch, match=r"devices=2 x num_nodes=1 = 2; launch LOCAL_WORLD_SIZE=2 x 2"):
        env.validate_settings(num_devices=2, num_nodes=1)
    with pytest.raises(TrainerMismatch):  # the product agrees, but local rank 1 would have no device
        env.validate_settings(num_devices=1, num_nodes=4)


def test_fit_takes_every_spelling_of_this_launchs_accelerator_and_devices(clean_runtime):
    """Before: accelerator="cuda" on a CUDA rank was "differs from the device", and devices="auto",
    -1 or [0, 1] on a node of 2 were a mismatch ("= autoauto"). The launch's own values replace them."""
    import dataclasses

    from ddprun.lightning import _launch_args
    from ddprun.mismatch import TrainerMismatch
    from ddprun.runtime import RankInfo

    gpu = RankInfo(rank=3, local_rank=1, node_rank=1, world_size=4, local_world_size=2,
                   device=torch.device("cuda", 1), is_main=False)
    for given in ({"accelerator": "cuda"}, {"accelerator": "GPU"}, {"accelerator": "auto"}, {"devices": "auto"},
                  {"devices": -1}, {"devices": "-1"}, {"devices": [0, 1]}, {"devices": (1, 0)}, {"devices": "0,1"},
                  {"devices": "2"}, {"devices": 2, "num_nodes": 2, "accelerator": "cuda"}):
        kw = dict(given)
        launch = _launch_args(gpu, kw)
        assert (launch["accelerator"], launch["devices"], launch["num_nodes"], kw) == ("gpu", 2, 2, {}), given
    cpu = dataclasses.replace(gpu, device=torch.device("cpu"))
    kw = {"accelerator": "cpu", "devices": "auto", "max_time": "00:01:00"}
    assert _launch_args(cpu, kw)["devices"] == 2 and kw == {"max_time": "00:01:00"}  # Lightning's "auto": 1 CPU
    with pytest.raises(ConfigError, match="accelerator differs"):
        _launch_args(gpu, {"accelerator": "cpu"})
    with pytest.raises(ConfigError, match="accelerator differs"):
        _launch_args(cpu, {"accelerator": "cuda"})
    with pytest.raises(TrainerMismatch, match="devices=1 x num_nodes=2 = 2"):
        _launch_args(gpu, {"devices": 1})
    with pytest.raises(ConfigError, match=r"(?s)devices=\[1, 2\]; this node runs 2 process\(es\).*HINT: .*devices=2"):
        _launch_args(gpu, {"devices": [1, 2]})


def test_a_rank_bound_to_a_gpu_of_its_own_trains_on_it(clean_runtime, monkeypatch):
    """srun --gpus-per-task=1: local rank 2 sees one GPU, cuda:0. Before: devices=LOCAL_WORLD_SIZE and
    Lightning's root device cuda:<local rank>, a GPU this process does not have. (CUDA mocked: one GPU.)"""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    from ddprun.lightning import trainer_kwargs
    from ddprun.runtime import RankInfo

    for fn in (rank_zero_only, utils_rank_zero_only):  # the strategy sets them to its rank, 6: back after the test
        monkeypatch.setattr(fn, "rank", fn.rank)
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for rank, local_rank in ((6, 2), (4, 0)):  # local rank 0 too, whose cuda:0 is also its local rank's index
        info = RankInfo(rank=rank, local_rank=local_rank, node_rank=1, world_size=8, local_world_size=4,
                        device=torch.device("cuda", 0), is_main=False, bound=True)
        trainer = pl.Trainer(**trainer_kwargs(info), logger=False, enable_checkpointing=False, **QUIET)
        strategy = trainer.strategy
        assert (strategy.root_device, strategy.local_rank, strategy.world_size) == \
            (torch.device("cuda", 0), local_rank, 8)
        assert (trainer.num_devices, trainer.num_nodes, strategy.distributed_sampler_kwargs) == \
            (4, 2, {"num_replicas": 8, "rank": rank})
        strategy.cluster_environment.validate_settings(num_devices=strategy.num_processes,
                                                       num_nodes=strategy.num_nodes)


def test_the_entry_point_checks_every_trainer_in_a_multi_rank_ddprun_worker(clean_runtime):
    from importlib.metadata import entry_points

    from ddprun.lightning import LaunchCheck, LoopStart

    clean_runtime.setenv("DDPRUN_RUN_DIR", "/tmp/run")
    clean_runtime.setenv("WORLD_SIZE", "4")
    clean_runtime.setenv("LOCAL_WORLD_SIZE", "2")
    (ep,) = [e for e in entry_points(group="lightning.pytorch.callbacks_factory") if e.name == "ddprun"]
    callbacks = ep.load()()
    assert [type(c) for c in callbacks] == [LaunchCheck, LoopStart]


def test_loop_start_holds_a_setup_phase_from_the_trainers_build_to_its_first_batch_and_restarts_at_each_fit(
        monkeypatch):
    """The hooks' order in a Trainer's life: built, validate (its setup ends the phase: validation's
    collectives begin a loop), fit (its setup hook starts the loop over, in a new phase), the first
    training batch (the phase ends), teardown. A Trainer only built and dropped leaves no phase open."""
    import gc

    from ddprun import telemetry
    from ddprun.lightning import LoopStart

    p = telemetry.Progress()
    monkeypatch.setattr(telemetry, "PROGRESS", p)
    cb = LoopStart()
    p.collected()  # Lightning's log_dir broadcast and pre_setup barrier, before any hook
    assert (p.in_setup, p.began) == (1, False)
    cb.setup(None, None, "validate")
    p.collected()
    assert (p.in_setup, p.began) == (0, True)
    cb.setup(None, None, "fit")
    p.collected()  # post_setup barrier, the sanity check's all-reduces
    p.forwarded()
    p.forwarded()
    assert (p.in_setup, p.began) == (1, False)
    cb.on_train_batch_start(None)
    cb.teardown(None, None, "fit")
    assert p.in_setup == 0
    p.forwarded()
    p.forwarded()
    assert p.began
    LoopStart()
    gc.collect()
    assert p.in_setup == 0


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tiny_data(n: int = 32) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 4)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def test_fit_with_a_lightning_module_in_one_process_writes_into_the_run_dir(clean_runtime, tmp_path, monkeypatch):
    import ddprun
    from ddprun.lightning import LightningFitResult

    quiet = {"enable_progress_bar": False, "enable_model_summary": False}
    result = ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=5, run_dir=str(tmp_path / "run"),
                        log_every=1, trainer_kwargs=quiet)
    assert isinstance(result, LightningFitResult)
    assert result.steps == 5 and result.epochs == 1 and result.train_loss is not None
    assert result.trainer.max_steps == 5 and result.trainer.world_size == 1
    assert Path(result.checkpoint) == tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert Path(result.checkpoint).exists()
    assert (tmp_path / "run" / "lightning_logs" / "version_0" / "metrics.csv").exists()
    # a second fit of this process (pretrain, then fine-tune) starts anew, as for an nn.Module
    with pytest.warns(UserWarning, match=r"fit\(\) already ran in this process .* starts anew") as said:
        second = ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=2, run_dir=str(tmp_path / "run"),
                            trainer_kwargs=quiet)
    assert second.steps == 2 and second.trainer.ckpt_path is None
    assert [w.filename for w in said if "already ran" in str(w.message)] == [__file__]  # the fit() line
    # the same run dir in a new process (a restarted worker group): resume="auto" continues from last.ckpt
    fresh_process(monkeypatch)
    again = ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=7, run_dir=str(tmp_path / "run"),
                       trainer_kwargs=quiet)
    assert again.steps == 7 and again.trainer.ckpt_path == result.checkpoint


def test_a_preemption_before_the_first_save_and_the_saves_after_its_resume_keep_one_last_ckpt(clean_runtime,
                                                                                             tmp_path, monkeypatch):
    """Before: the preemption's last.ckpt held a ModelCheckpoint state without last_model_path, so after
    the resume Lightning's version counter put every later save into last-v1.ckpt, and last.ckpt (what
    a restart resumes from) stayed at the preemption's step for good."""
    import ddprun
    from ddprun import preempt
    from ddprun.telemetry import PROGRESS

    run, ckpts = str(tmp_path / "run"), tmp_path / "run" / "checkpoints"
    # due at the first optimizer step: before ModelCheckpoint's first save (the epoch's end, step 4)
    monkeypatch.setattr(preempt, "PREEMPT", preempt.PreemptState(stop_step=PROGRESS.steps, signame="SIGTERM",
                                                                 requested=True))
    with pytest.raises(preempt.Preempted):
        ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=7, run_dir=run, trainer_kwargs=QUIET)
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 1
    monkeypatch.setattr(preempt, "PREEMPT", preempt.PreemptState())
    again = ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=7, run_dir=run, trainer_kwargs=QUIET)
    assert again.trainer.ckpt_path == str(ckpts / "last.ckpt") and again.steps == 7
    assert sorted(p.name for p in ckpts.glob("last*.ckpt")) == ["last.ckpt"]
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 7
    assert again.checkpoint == str(ckpts / "last.ckpt")


def fresh_process(monkeypatch) -> None:
    """What a restart in a new process remembers of this one's fits: nothing (ddprun.train.resume)."""
    from ddprun.train import resume

    monkeypatch.setattr(resume, "_FINISHED_IN_THIS_PROCESS", set())


class WithPaths(Tiny):
    def __init__(self, data_dir=Path("/data/set"), args=argparse.Namespace(lr=0.1, name="x")):
        super().__init__()
        self.save_hyperparameters()


class Kind(enum.Enum):
    SMALL = 1


class WithEnum(Tiny):
    def __init__(self, kind=Kind.SMALL):
        super().__init__()
        self.save_hyperparameters()


def test_a_module_whose_hyperparameters_hold_a_path_and_a_namespace_resumes(clean_runtime, tmp_path, monkeypatch):
    """Before: resume loaded with weights_only=True, which refuses pathlib.PosixPath and argparse.Namespace
    in save_hyperparameters(): every restart crashed with UnpicklingError (a crash loop)."""
    import ddprun

    run = str(tmp_path / "run")
    first = ddprun.fit(WithPaths(), tiny_data(), batch_size=8, max_steps=2, run_dir=run, trainer_kwargs=QUIET)
    fresh_process(monkeypatch)
    again = ddprun.fit(WithPaths(), tiny_data(), batch_size=8, max_steps=4, run_dir=run, trainer_kwargs=QUIET)
    assert again.trainer.ckpt_path == first.checkpoint and again.steps == 4
    assert again.model.hparams.data_dir == Path("/data/set") and again.model.hparams.args.lr == 0.1


class KeepsKind(pl.Callback):
    """A callback whose checkpointed state holds a class weights_only refuses."""

    def state_dict(self):
        return {"kind": Kind.SMALL}


def test_a_class_the_resume_would_refuse_fails_the_first_save_and_a_resume_names_it(clean_runtime, tmp_path):
    """As ddprun.fit of an nn.Module: the class is named when the checkpoint is written, not at the
    restart that needs it; one in the hyperparameters, which every checkpoint holds, before training
    (not at the first save, an epoch or hours in); a checkpoint from elsewhere that holds one is a
    ConfigError at the resume."""
    import ddprun

    run, ckpts = str(tmp_path / "run"), tmp_path / "run" / "checkpoints"
    with pytest.raises(ConfigError, match=r"(?s)save_hyperparameters\(\) holds .*test_lightning\.Kind, which "
                                          r"torch.load\(weights_only=True\) refuses.*add_safe_globals"):
        ddprun.fit(WithEnum(), tiny_data(), batch_size=8, max_steps=2, run_dir=run, trainer_kwargs=QUIET)
    assert not ckpts.exists() or not list(ckpts.glob("*.ckpt"))
    with pytest.raises(CheckpointError, match=r"(?s)holds .*test_lightning\.Kind, which torch.load\(weights_only=True\) "
                                              r"refuses.*add_safe_globals"):
        ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=2, run_dir=run,
                   trainer_kwargs={**QUIET, "callbacks": [KeepsKind()]})
    assert not list(ckpts.glob("*.ckpt"))
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, **QUIET)
    trainer.fit(WithEnum(), torch.utils.data.DataLoader(tiny_data(), batch_size=8))
    trainer.save_checkpoint(tmp_path / "elsewhere.ckpt")
    with pytest.raises(ConfigError, match=r"(?s)elsewhere.ckpt holds .*Kind.*add_safe_globals"):
        ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=2, run_dir=str(tmp_path / "run2"),
                   resume=str(tmp_path / "elsewhere.ckpt"), trainer_kwargs=QUIET)


def test_a_model_checkpoint_of_the_users_without_a_dirpath_saves_where_a_restart_resumes(clean_runtime, tmp_path,
                                                                                         monkeypatch):
    """Before: its files went to lightning_logs/version_N/checkpoints while a restart looked only in
    the checkpoint directory: resume was silently off. And one that writes no last.ckpt there is said."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import ddprun

    run, ckpts = str(tmp_path / "run"), tmp_path / "run" / "checkpoints"
    first = ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=2, run_dir=run,
                       trainer_kwargs={**QUIET, "callbacks": [ModelCheckpoint(save_last=True)]})
    assert first.checkpoint == str(ckpts / "last.ckpt") and (ckpts / "last.ckpt").exists()
    fresh_process(monkeypatch)
    again = ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=3, run_dir=run,
                       trainer_kwargs={**QUIET, "callbacks": [ModelCheckpoint(save_last=True)]})
    assert again.trainer.ckpt_path == str(ckpts / "last.ckpt") and again.steps == 3
    with pytest.warns(UserWarning, match=r"no ModelCheckpoint in trainer_kwargs' callbacks writes .*last.ckpt"):
        ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=1, run_dir=str(tmp_path / "run2"),
                   trainer_kwargs={**QUIET, "callbacks": ModelCheckpoint(monitor="train_loss")})


class Evaluated(Tiny):
    def validation_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_each_evaluation_batch_outside_fit_is_progress_for_the_stall_watch(monkeypatch, stage):
    """Before: trainer.validate/test/predict make no collective per batch (no sync_dist), so nothing
    counted as progress and the stall watch named a healthy pass a hang after --stall-timeout."""
    from ddprun import telemetry
    from ddprun.lightning import LoopStart

    p = telemetry.Progress()
    monkeypatch.setattr(telemetry, "PROGRESS", p)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[LoopStart()], **QUIET)
    getattr(trainer, stage)(Evaluated(), torch.utils.data.DataLoader(tiny_data(), batch_size=8))
    assert (p.beats, p.began, p.in_setup) == (4, True, 0)


def test_a_checkpoint_save_waits_with_the_long_timeout_in_a_checkpoint_phase(clean_runtime, tmp_path, monkeypatch):
    """As ddprun.fit of an nn.Module: rank 0 writes while the others wait in Lightning's barrier, with
    the init timeout and a declared phase, and the step after it goes back to the training timeout.
    Before: after the first step the 300 s training timeout stayed for every save."""
    import ddprun
    from ddprun import runtime, telemetry

    seen = []
    monkeypatch.setattr(runtime, "use_training_timeout", lambda: seen.append("training timeout"))
    monkeypatch.setattr(runtime, "use_phase_timeout", lambda: seen.append("init timeout"))

    class Saw(pl.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            seen.append(f"save at step {trainer.global_step} in phase {telemetry.PROGRESS.phase!r}")

    ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=6, run_dir=str(tmp_path / "run"),
               trainer_kwargs={**QUIET, "callbacks": [Saw()]})
    saves = ["init timeout", "save at step {} in phase 'checkpoint'"] * 2  # epoch=0-step=N.ckpt, last.ckpt
    assert seen == ["training timeout", *(x.format(4) for x in saves), "training timeout",
                    *(x.format(6) for x in saves)]


@pytest.mark.parametrize("own_trainer", [False, True], ids=["fit", "own-trainer"])
def test_the_readmes_lightning_example_trains_both_ways(clean_runtime, tmp_path, monkeypatch, capsys, caplog,
                                                        own_trainer):
    """examples/lightning_script.py, the README's complete example, runs as written (one process here;
    its __main__ as `python examples/lightning_script.py` runs it): ddprun.fit, or its own Trainer
    built from ddprun.lightning.trainer_kwargs()."""
    import runpy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning_script.py", "--max-steps", "3", *(["--own-trainer"] if own_trainer
                                                                                   else [])])
    runpy.run_path(str(Path(__file__).parents[2] / "examples" / "lightning_script.py"), run_name="__main__")
    out = capsys.readouterr().out
    if own_trainer:  # Lightning's own logger in the working directory; no epoch ended, so no checkpoint
        assert "`Trainer.fit` stopped: `max_steps=3` reached." in caplog.text
        assert (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").exists()
    else:
        (run,) = (tmp_path / "runs").iterdir()
        assert f"steps 3, val {{}}, checkpoint {run / 'checkpoints' / 'last.ckpt'}" in out, out[-2000:]
        assert (run / "checkpoints" / "last.ckpt").exists()


def test_fit_with_a_lightning_module_refuses_what_does_not_apply(clean_runtime):
    import ddprun
    from ddprun.mismatch import TrainerMismatch

    with pytest.raises(ConfigError, match="loss_fn"):
        ddprun.fit(Tiny(), tiny_data(), loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(ConfigError, match="either train_data"):
        ddprun.fit(Tiny())
    with pytest.raises(ConfigError, match=r"max_steps -> max_steps="):
        ddprun.fit(Tiny(), tiny_data(), trainer_kwargs={"max_steps": 3})
    with pytest.raises(TrainerMismatch, match="devices=2 x num_nodes=1"):
        ddprun.fit(Tiny(), tiny_data(), trainer_kwargs={"devices": 2})
    with pytest.raises(ConfigError, match="datamodule"):
        ddprun.fit(torch.nn.Linear(4, 1), tiny_data(), datamodule=object())


# -- two nodes ------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_fit_lightning_module_on_two_nodes_of_two(tmp_path):
    out = tmp_path / "out"
    results = run_agents(ddprun_nodes(2, 2, [FIT, "--out", str(out), "--steps", "6"], rdzv_id="lit2x2"),
                         timeout=130, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    ranks = facts(out)
    assert sorted((f["global_rank"], f["node_rank"], f["local_rank"]) for f in ranks) == \
        [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert {(f["world_size"], f["train_steps"], f["steps"]) for f in ranks} == {(4, 6, 6)}
    assert {(f["strategy"], f["environment"]) for f in ranks} == {("DDPStrategy", "DdprunEnvironment")}
    run_dir = tmp_path / "runs" / "lit2x2"
    assert {f["run_dir"] for f in ranks} == {str(run_dir)}
    assert [f["checkpoint"] for f in ranks] == [str(run_dir / "checkpoints" / "last.ckpt"), None, None, None]
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert (run_dir / "lightning_logs" / "version_0" / "metrics.csv").exists()
    ref = torch.load(out / "params-0.pt", weights_only=True)
    for rank in (1, 2, 3):
        other = torch.load(out / f"params-{rank}.pt", weights_only=True)
        assert all(torch.equal(ref[k], other[k]) for k in ref), f"rank {rank} weights differ from rank 0"
    for r in results:
        assert "Traceback" not in r.output, describe(results)


@pytest.mark.timeout(150)
def test_datamodule_setup_runs_on_every_rank(tmp_path):
    out = tmp_path / "out"
    results = run_agents(ddprun_nodes(2, 1, [FIT, "--out", str(out), "--datamodule", "--steps", "20"],
                                      rdzv_id="litdm"), timeout=130, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert sorted((s["rank"], s["stage"]) for s in facts(out, "setup-*.json")) == [(0, "fit"), (1, "fit")]
    ranks = facts(out)
    assert sorted((f["global_rank"], f["node_rank"]) for f in ranks) == [(0, 0), (1, 1)]
    # 16 batches per rank and epoch (Lightning's DistributedSampler): 20 steps went into epoch 2 and
    # validated once, the same value on both ranks (sync_dist)
    assert {f["steps"] for f in ranks} == {20} and len({f["val_metrics"]["val_loss"] for f in ranks}) == 1


@pytest.mark.timeout(150)
def test_unmodified_lightning_script_uses_every_rank(tmp_path):
    out = tmp_path / "out"
    cmd = [BORING, "--devices", "2", "--num-nodes", "2", "--strategy", "ddp", "--max-steps", "5", "--out", str(out)]
    results = run_agents(ddprun_nodes(2, 2, cmd, rdzv_id="boring"), timeout=130, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    ranks = facts(out)
    assert sorted((f["global_rank"], f["node_rank"], f["local_rank"]) for f in ranks) == \
        [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert {(f["world_size"], f["steps"], f["strategy"]) for f in ranks} == {(4, 5, "DDPStrategy")}


@pytest.mark.timeout(150)
def test_a_trainer_the_script_builds_keeps_lightnings_sigterm_handler_and_the_rank_then_ends_by_it(tmp_path):
    """docs/preemption.md: under `ddprun run`, a Trainer the script builds itself keeps Lightning's own
    SIGTERM handler (ddprun chains it, and suppresses it only under ddprun.fit). Nothing in that
    script stops at an agreed step, so the signalled rank then ends by the signal, as a script with
    nothing to save does, and the job fails naming it: no hang in Lightning's broadcast from the
    handler, which the other rank never joins (lightning#21406)."""
    out = tmp_path / "out"
    cmd = [BORING, "--devices", "2", "--num-nodes", "1", "--max-steps", "400", "--out", str(out),
           "--sigterm-rank", "1", "--sigterm-batch", "5"]
    (r,) = run_agents([[DDPRUN, "run", "--nproc-per-node", "2", "--log-dir", "runs", "--rdzv-id", "own", *cmd]],
                      timeout=130, cwd=tmp_path)
    assert r.returncode == 1, describe([r])
    assert re.search(r"^ddprun: the job failed: rank 1 \(node 0, \S+\) was killed by SIGTERM$", r.output, re.M), \
        describe([r])
    log = (tmp_path / "runs" / "own" / "logs" / "rank-1.log").read_text()
    handled, said = log.find("[rank: 1] Received SIGTERM: 15"), log.find("rank 1: SIGTERM to itself at batch 5")
    assert said >= 0 and handled > said, log  # Lightning's own handler ran on the signalled rank
    assert not list(out.glob("rank-*.json")), "a rank trained to its end"
    assert "Traceback" not in r.output, describe([r])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["first-batch", "hang"])
def test_lightnings_setup_keeps_the_first_step_bound_and_a_hang_in_training_is_named_at_the_short_one(
        tmp_path, fault):
    """Before: Lightning's setup barriers, broadcasts and sanity check counted as the training loop's
    start, so a first batch slower than --stall-timeout (a lazily opened dataset) was reported as a
    stall and --stall-end-after 0 ended a healthy job ("every rank is in data loading"). Now the bound
    stays max(2 x, 30 s) until the first training batch (ddprun.lightning.LoopStart); a rank that hangs
    after it is still named within the short bound."""
    out = tmp_path / "out"
    cmd = [BORING, "--devices", "2", "--num-nodes", "1", "--max-steps", "150", "--out", str(out),
           *(["--first-batch-s", "6"] if fault == "first-batch" else ["--hang-rank", "1", "--hang-batch", "3"])]
    (r,) = run_agents([[DDPRUN, "run", "--nproc-per-node", "2", "--log-dir", "runs", "--rdzv-id", "slow",
                        "--stall-timeout", "2", "--stall-end-after", "0", "--tee", "3", *cmd]], timeout=100, cwd=tmp_path)
    if fault == "first-batch":
        assert r.returncode == 0, describe([r])
        assert r.output.count("first training item: 6.0 s") == 2, describe([r])
        assert "hang report" not in r.output and "no rank advanced" not in r.output, describe([r])
        assert sorted((f["global_rank"], f["steps"]) for f in facts(out)) == [(0, 150), (1, 150)]
        assert not (tmp_path / "runs" / "slow" / "stacks").exists(), describe([r])
    else:
        assert r.returncode == 1, describe([r])
        assert "[rank1] rank 1: hangs at batch 3" in r.output, describe([r])
        said = re.search(r"^ddprun: hang report: no rank advanced for (\d+) s: (.*)$", r.output, re.M)
        assert said and int(said[1]) < 5 and "rank 1 is at boring_unmodified.py" in said[2], describe([r])
        assert not list(out.glob("rank-*.json")), "a rank trained to its end"
        assert r.wall_s < 60, describe([r])
    assert_nothing_left(tmp_path)


def rendezvous_time(run_dir: Path) -> float:
    """When the last node joined the c10d rendezvous (epoch seconds), from the agents' log."""
    log = next((run_dir / "logs").glob("agent-*.log")).read_text(errors="replace")
    stamps = re.findall(r"^(\S+ \S+) INFO \S+: The node \S+ has joined round", log, re.M)
    return max(datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f").timestamp() for s in stamps)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainer, seen", [
    # devices too small, default strategy: Lightning picks one device and no process group
    (["--devices", "1", "--num-nodes", "1", "--strategy", "auto"], "Trainer devices=1 x num_nodes=1 = 1"),
    # num_nodes wrong: Lightning's own check under torchelastic (a ValueError on every rank)
    (["--devices", "2", "--num-nodes", "1", "--strategy", "ddp"], "Trainer devices=2 x num_nodes=1 = 2"),
], ids=["devices-1-auto", "num-nodes-1-ddp"])
def test_a_trainer_that_disagrees_with_the_launch_fails_every_node_with_one_message(tmp_path, trainer, seen):
    start = time.time()
    results = run_agents(ddprun_nodes(2, 2, [BORING, *trainer], rdzv_id="mismatch"), timeout=100, cwd=tmp_path)
    end = start + max(r.wall_s for r in results)
    assert all(r.returncode not in (0, None) for r in results), describe(results)
    launch = "launch LOCAL_WORLD_SIZE=2 x 2 node(s) = WORLD_SIZE=4"
    for r in results:
        assert seen in r.output and launch in r.output, describe(results)
        assert "HINT: build the Trainer with Trainer(**ddprun.lightning.trainer_kwargs(), ...), or pass " \
               "devices=2, num_nodes=2." in r.output
        assert r.output.count("Traceback") == 0, describe(results)
    # every node, also the one whose agent outlives the store's host: it names the cause from the
    # records it copied, never a bare rendezvous error
    assert all("ddprun: the job failed." in r.output for r in results), describe(results)
    assert not any(re.search(r"^ddprun: rendezvous at \S+ failed:", r.output, re.M) for r in results), describe(results)
    # the bound is Lightning's import on every rank (2 shared cores, 4 processes), not a wait
    after_rendezvous = end - rendezvous_time(tmp_path / "runs" / "mismatch")
    print(f"rendezvous -> both agents exited: {after_rendezvous:.1f} s")
    assert after_rendezvous < 30, describe(results)
