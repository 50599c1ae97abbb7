"""The standalone pytorch_lightning package (2.x) works wherever lightning.pytorch does: ddprun.fit,
trainer_kwargs(), the Trainer/launch mismatch check under `ddprun run`, the Ray reporter; with the
unified `lightning` package installed beside it, and without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, ddprun_nodes, describe, extra, job_env, run_agents

PL = extra("pytorch_lightning")

pytestmark = pytest.mark.integrations
BORING = str(Path(__file__).parent / "scripts" / "pl_boring_unmodified.py")
QUIET = {"enable_progress_bar": False, "enable_model_summary": False}


class Tiny(PL.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tiny_data(n: int = 32):
    x = torch.randn(n, 4)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def test_trainer_kwargs_build_pytorch_lightning_objects(clean_runtime):
    from pytorch_lightning.plugins.environments import ClusterEnvironment
    from pytorch_lightning.strategies import DDPStrategy

    from ddprun.pytorch_lightning import DdprunEnvironment, trainer_kwargs

    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                       "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512",
                       "TORCHELASTIC_RUN_ID": "t"}.items():
        clean_runtime.setenv(key, value)
    kw = trainer_kwargs()
    assert (kw["devices"], kw["num_nodes"]) == (2, 2) and isinstance(kw["strategy"], DDPStrategy)
    env = kw["strategy"].cluster_environment
    assert isinstance(env, DdprunEnvironment) and isinstance(env, ClusterEnvironment)
    assert DdprunEnvironment.__module__ == "ddprun.pytorch_lightning"


def test_fit_trains_a_pytorch_lightning_module_beside_a_lightning_one(clean_runtime, tmp_path):
    import ddprun

    result = ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=4, run_dir=str(tmp_path / "pl"),
                        trainer_kwargs=QUIET)
    assert type(result.trainer) is PL.Trainer and result.steps == 4
    assert Path(result.checkpoint) == tmp_path / "pl" / "checkpoints" / "last.ckpt" and Path(result.checkpoint).exists()
    lp = extra("lightning.pytorch")

    class Unified(lp.LightningModule):
        training_step, configure_optimizers = Tiny.training_step, Tiny.configure_optimizers

        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

    other = ddprun.fit(Unified(), tiny_data(), batch_size=8, max_steps=2, run_dir=str(tmp_path / "l"),
                       trainer_kwargs=QUIET)
    assert type(other.trainer) is lp.Trainer and other.steps == 2


def ensure_entry_point(tmp_path: Path) -> str | None:
    """A directory to put on sys.path that declares pyproject's pytorch_lightning entry point, when
    the installed ddprun predates it (an editable install's metadata is written at install time)."""
    if any(e.name == "ddprun" for e in entry_points(group="pytorch_lightning.callbacks_factory")):
        return None
    dist = tmp_path / "ep" / "ddprun_pl_entry_point-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ddprun-pl-entry-point\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[pytorch_lightning.callbacks_factory]\nddprun = ddprun.pytorch_lightning:callbacks_factory\n")
    return str(tmp_path / "ep")


def test_pyproject_declares_the_entry_point_the_tests_use():
    text = (REPO / "pyproject.toml").read_text()
    assert '[project.entry-points."pytorch_lightning.callbacks_factory"]\n' \
           'ddprun = "ddprun.pytorch_lightning:callbacks_factory"' in text


def test_every_pytorch_lightning_trainer_in_a_ddprun_worker_gets_the_launch_check(clean_runtime, tmp_path):
    from ddprun.pytorch_lightning import LaunchCheck

    extra = ensure_entry_point(tmp_path)
    if extra:
        clean_runtime.syspath_prepend(extra)
    clean_runtime.setenv("DDPRUN_RUN_DIR", str(tmp_path))
    clean_runtime.setenv("WORLD_SIZE", "2")
    clean_runtime.setenv("LOCAL_WORLD_SIZE", "2")
    trainer = PL.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET)
    assert [type(c) for c in trainer.callbacks if isinstance(c, LaunchCheck)] == [LaunchCheck]


def test_ray_reporter_is_a_callback_of_the_models_package():
    extra("ray")
    from ddprun.ray import _lightning_package, _lightning_reporter

    assert _lightning_package(Tiny()) == "pytorch_lightning"
    assert isinstance(_lightning_reporter(5, 0, "pytorch_lightning"), PL.Callback)


@pytest.mark.timeout(150)
def test_a_pytorch_lightning_trainer_that_disagrees_with_the_launch_fails_with_one_message(tmp_path):
    env = job_env()
    extra = ensure_entry_point(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra, str(REPO / "src"), env.get("PYTHONPATH")]))
    cmd = [BORING, "--devices", "1", "--strategy", "auto"]
    results = run_agents(ddprun_nodes(1, 2, cmd, rdzv_id="plmismatch"), timeout=130, cwd=tmp_path, env=env)
    (r,) = results
    assert r.returncode not in (0, None), describe(results)
    assert "Trainer devices=1 x num_nodes=1 = 1; launch LOCAL_WORLD_SIZE=2 x 1 node(s) = WORLD_SIZE=2" in r.output
    assert "HINT: build the Trainer with Trainer(**ddprun.pytorch_lightning.trainer_kwargs(), ...)" in r.output
    assert "Traceback" not in r.output, describe(results)


@pytest.mark.timeout(150)
def test_fit_works_with_pytorch_lightning_installed_instead_of_lightning(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["lightning"] = None  # as if only pytorch-lightning were installed
        import torch, ddprun, pytorch_lightning as pl
        sys.path.insert(0, {str(REPO)!r})
        from tests.integrations.test_pytorch_lightning import Tiny, tiny_data
        result = ddprun.fit(Tiny(), tiny_data(), batch_size=8, max_steps=3, run_dir={str(tmp_path / 'run')!r},
                            trainer_kwargs={{"enable_progress_bar": False, "enable_model_summary": False}})
        assert type(result.trainer) is pl.Trainer and result.steps == 3, result
        assert not any(m == "lightning" or m.startswith("lightning.") for m in sys.modules if sys.modules[m])
        print("ok", result.steps)
    """)
    env = job_env(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
                  DDPRUN_DEVICE_KIND="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=140, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0 and "ok 3" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("module", ["ddprun.lightning", "ddprun.pytorch_lightning"])
def test_uneven_nodes_are_refused_by_trainer_kwargs_on_every_node(module):
    import importlib

    from ddprun.errors import ConfigError
    from ddprun.runtime import RankInfo

    extra("lightning.pytorch" if module == "ddprun.lightning" else "pytorch_lightning")
    nodes = importlib.import_module(module)._nodes
    for local in (2, 1):  # 2 + 1 processes: the node with one would otherwise count 3 "nodes"
        info = RankInfo(rank=0, local_rank=0, node_rank=0, world_size=3, local_world_size=local,
                        device=torch.device("cpu"), is_main=True)
        with pytest.raises(ConfigError, match="(?s)same number of processes.*GROUP_WORLD_SIZE=2.*HINT"):
            nodes(info, {"GROUP_WORLD_SIZE": "2"})
    even = RankInfo(rank=0, local_rank=0, node_rank=0, world_size=4, local_world_size=2,
                    device=torch.device("cpu"), is_main=True)
    assert nodes(even, {"GROUP_WORLD_SIZE": "2"}) == 2


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_ddprun_fit_refuses_a_lightning_module_on_uneven_nodes_before_it_builds_a_trainer(package, monkeypatch):
    """ddprun.fit(LightningModule) on node 1 of a 2 + 1 job: the ConfigError, not a Trainer that
    would count 3 nodes (runtime.init replaced by this node's RankInfo: no process group needed)."""
    import importlib

    import ddprun
    from ddprun.errors import ConfigError
    from ddprun.runtime import RankInfo

    pl = extra(package)
    from torch.utils.data import TensorDataset

    glue = importlib.import_module("ddprun.lightning" if package == "lightning.pytorch" else "ddprun.pytorch_lightning")
    node1 = RankInfo(rank=2, local_rank=0, node_rank=1, world_size=3, local_world_size=1,
                     device=torch.device("cpu"), is_main=False)
    monkeypatch.setattr(glue.runtime, "init", lambda: node1)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    built = []
    monkeypatch.setattr(pl, "Trainer", lambda *a, **k: built.append(k))
    model = importlib.import_module(f"{package}.demos.boring_classes").BoringModel()
    with pytest.raises(ConfigError, match="(?s)same number of processes.*WORLD_SIZE=3.*LOCAL_WORLD_SIZE=1"):
        ddprun.fit(model, TensorDataset(torch.randn(8, 32)), batch_size=2, max_steps=1)
    assert built == []
