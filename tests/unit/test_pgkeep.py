"""pgkeep.py: the gloo groups ``destroy_process_group`` destroys stay referenced (the deadlock
it prevents: tests/multiprocess/test_launcher.py); NCCL groups are destroyed as torch does."""

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddprun import pgkeep
from tests.helpers import free_port


@pytest.fixture
def keeping(monkeypatch):
    # monkeypatch restores torch's functions and the list afterwards
    monkeypatch.setattr(c10d, "destroy_process_group", c10d.destroy_process_group)
    monkeypatch.setattr(dist, "destroy_process_group", dist.destroy_process_group)
    monkeypatch.setattr(pgkeep, "KEPT", [])
    pgkeep.keep_destroyed_groups()
    pgkeep.keep_destroyed_groups()  # idempotent: one wrapper
    assert dist.destroy_process_group is c10d.destroy_process_group
    assert not getattr(dist.destroy_process_group.__wrapped__, "_ddprun_keeps", False)
    yield pgkeep


def test_a_destroyed_gloo_group_and_then_the_default_one_are_kept(keeping):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    default, sub = c10d.GroupMember.WORLD, dist.new_group([0])
    dist.destroy_process_group(sub)
    assert keeping.KEPT == [sub]
    dist.destroy_process_group()
    assert not dist.is_initialized() and keeping.KEPT[0] is sub and default in keeping.KEPT[1:]


def test_a_group_of_another_backend_is_destroyed_as_torch_does(keeping, monkeypatch):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    monkeypatch.setattr(c10d, "get_backend", lambda group=None: "nccl")  # its GPU memory must be freed
    dist.destroy_process_group()
    assert not dist.is_initialized() and keeping.KEPT == []
