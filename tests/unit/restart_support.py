"""Shared by the tests that simulate a restarted worker inside one test process."""

import pytest
import torch
from torch.utils.data import TensorDataset

from ddprun import runtime
from ddprun.train import resume as resume_mod


def new_process():
    """What a restarted worker starts with: no process group, no fit finished in this process."""
    runtime._reset()
    resume_mod._FINISHED_IN_THIS_PROCESS.clear()


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    """No launcher environment, and a fresh 'process' before and after each test."""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "DDPRUN_RUN_DIR", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(k, raising=False)
    new_process()
    yield
    new_process()


def regression(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :2].sum(dim=1, keepdim=True))
