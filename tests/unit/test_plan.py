"""The rank rule: global rank = node rank x processes per node + local rank."""

import pytest

from ddprun.cluster.plan import make_plan
from ddprun.errors import ConfigError


def test_five_nodes_of_four_gpus():
    plan = make_plan(5, 4, "cuda")
    assert plan.world_size == 20 and len(plan.slots) == 20
    assert [s.rank for s in plan.slots] == list(range(20))
    s = plan.slots[13]
    assert (s.node_rank, s.local_rank, s.rank, s.device) == (3, 1, 13, "cuda:1")


def test_cpu_nodes_use_cpu_devices():
    assert {s.device for s in make_plan(2, 2, "cpu").slots} == {"cpu"}


def test_json_round_trip_fields():
    j = make_plan(2, 3).to_json()
    assert j["world_size"] == 6 and j["ranks"][4] == {"node_rank": 1, "local_rank": 1, "rank": 4, "device": "cpu"}


@pytest.mark.parametrize("nnodes,nproc", [(0, 1), (1, 0), (-1, 2)])
def test_empty_plans_are_refused(nnodes, nproc):
    with pytest.raises(ConfigError, match="HINT"):
        make_plan(nnodes, nproc)
