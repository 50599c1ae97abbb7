"""Every unit test leaves torch.distributed as it found it: ddprun.init() wraps
``destroy_process_group`` to keep destroyed gloo groups (pgkeep.py) until the process exits;
in this one pytest process each test's wrapper is undone and its kept groups freed."""

import pytest


@pytest.fixture(autouse=True)
def _torch_destroy_restored(monkeypatch):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ddprun import pgkeep

    monkeypatch.setattr(c10d, "destroy_process_group", c10d.destroy_process_group)
    monkeypatch.setattr(dist, "destroy_process_group", dist.destroy_process_group)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    pgkeep.release_kept()
