"""The job's first clean end (worker/channel.py ``mark_clean_end``, ``first_clean_end``): the first
rank whose script ended by itself with exit 0, which a rank whose peer then went away names; on a
real TCPStore, since the first writer must win."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from ddprun.protocol import failure as fr
from ddprun.protocol.env import WorkerEnv
from ddprun.worker.channel import JobChannel


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def channel(server, rank: int, node: int) -> JobChannel:
    environ = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "3", "GROUP_RANK": str(node),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "TORCHELASTIC_RUN_ID": "a",
               "DDPRUN_ATTEMPT": "0"}
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))
    return JobChannel(environ, WorkerEnv(run_dir="/nonexistent"), connect=lambda: client)


def test_the_first_rank_to_end_cleanly_is_the_one_every_other_rank_reads(server):
    ranks = [channel(server, r, r) for r in range(3)]
    assert all(ch.first_clean_end() is None for ch in ranks)  # nobody ended yet
    ranks[2].mark_clean_end(5)
    ranks[1].mark_clean_end(7)  # later: not the first
    first = ranks[0].first_clean_end()
    assert first is not None and (first.rank, first.node_rank, first.steps) == (2, 2, 5)
    assert ranks[1].first_clean_end() == first
    assert ranks[2].first_clean_end() is None  # its own end names nothing for it


def test_a_bad_value_at_the_key_names_nothing(server):
    ch = channel(server, 0, 0)
    for bad in ("[1]", "{}", '{"rank": -1, "node_rank": 0, "host": "h", "local_rank": 0, "steps": 1, "t": 0}',
                "\\x00"):
        server.set(ch.keys.first_end, bad)
        assert ch.first_clean_end() is None, bad
    assert fr.CleanEnd.parse(None) is None and fr.CleanEnd.parse(b"") is None


def test_the_monitor_reads_it_on_its_own_client(server):
    ended, reader = channel(server, 1, 1), channel(server, 0, 0)
    ended.mark_clean_end(3)
    own = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))
    first = reader.first_clean_end(own)
    assert first is not None and (first.rank, first.steps) == (1, 3)
