"""Which collective each rank is in at a stall (worker/collectives.py): the attribution from each
rank's last Flight Recorder entries, the workers' recorder settings, and a real recorder read."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from ddprun.protocol.env import flight_recorder_env
from ddprun.worker.collectives import attribution, last_collectives, op_name
from tests.helpers import free_port


def at(seq: int, op: str = "gloo:all_reduce") -> dict:
    return {"collectives": [{"pg": "0", "desc": "default_pg", "seq": seq, "op": op, "state": "scheduled"}]}


def test_a_rank_that_never_entered_the_collective_the_others_wait_in_is_named():
    places = {0: at(7), 1: at(6), 2: at(7), 3: at(7)}
    assert attribution(places) == ["rank 1 never entered ALLREDUCE #7 of the default group; ranks 0, 2, 3 wait "
                                   "in it (rank 1 is at #6)"]


def test_different_collectives_at_one_number_are_named_with_their_ranks():
    places = {0: at(7, "nccl:all_gather"), 1: at(7), 2: at(7)}
    assert attribution(places) == ["ranks call different collectives as #7 of the default group: ALLGATHER on "
                                   "rank 0; ALLREDUCE on ranks 1, 2"]


def test_every_rank_in_the_same_collective_or_no_recorder_says_nothing():
    assert attribution({0: at(7), 1: at(7)}) == []
    # a rank without a recorder (or that did not answer) is left out, not taken for one behind
    assert attribution({0: at(7), 1: {"where": "?"}, 2: {"collectives": None}}) == []


def test_a_member_that_never_used_its_group_is_behind_in_it_and_a_rank_of_unknown_membership_is_not():
    def in5(seq: int, **more) -> dict:
        return {"pg": "5", "desc": "undefined", "seq": seq, "op": "gloo:all_reduce", **more}

    places = {0: {"collectives": [at(9)["collectives"][0], in5(3, ranks=[0, 1])]},
              1: {"collectives": [at(9)["collectives"][0]]}}
    assert attribution(places) == ["rank 1 never entered ALLREDUCE #3 of group 5; rank 0 waits in it (rank 1 "
                                   "never used it)"]
    places[0]["collectives"][1] = in5(3)  # who is in group 5 is not known: rank 1 may be no member of it
    assert attribution(places) == []
    assert op_name("nccl:reduce_scatter_tensor_coalesced") == "REDUCESCATTERTENSORCOALESCED"


def test_the_workers_get_the_recorder_unless_the_user_set_it(tmp_path):
    env = flight_recorder_env({}, str(tmp_path))
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": os.path.join(str(tmp_path), "nccl-trace-rank-")}
    assert flight_recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
                               str(tmp_path)) == {}
    assert "TORCH_FR_BUFFER_SIZE" not in flight_recorder_env({"TORCH_FR_BUFFER_SIZE": "0"}, str(tmp_path))


RECORD_THREE = """
import sys, torch, torch.distributed as dist
from ddprun.worker.collectives import last_collectives
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
for _ in range(3):
    dist.all_reduce(torch.ones(1))
print("LAST", last_collectives())
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_a_buffer_size_of_0_turns_the_recorder_off(tmp_path):
    """The README's off switch: torch reads the size once per process, hence a process per value."""
    def last(size: str) -> str:
        env = {**os.environ, "TORCH_FR_BUFFER_SIZE": size, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", RECORD_THREE, str(free_port())], env=env, timeout=50,
                             capture_output=True, text=True, check=True).stdout
        return out.split("LAST ", 1)[1].strip()

    assert last("0") == "None"
    assert "'op': 'gloo:all_reduce'" in last("50")  # the same script records when the size is not 0


def test_a_real_gloo_group_records_its_collectives_and_the_trace_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")  # read when the group is created
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        t = torch.ones(1)
        for _ in range(3):
            dist.all_reduce(t)
        dist.all_gather([torch.zeros(1)], t)
        got = last_collectives(str(tmp_path / "stacks" / "fr-rank-0.json"))
    finally:
        dist.destroy_process_group()
    assert got is not None and len(got) == 1, got
    (last,) = got
    assert last["op"] == "gloo:all_gather" and last["seq"] >= 4, last
    trace = json.loads((tmp_path / "stacks" / "fr-rank-0.json").read_text())
    assert [e["profiling_name"] for e in trace["entries"]][-4:] == ["gloo:all_reduce"] * 3 + ["gloo:all_gather"]


def test_nccl_entries_kept_in_their_own_recorder_are_read_too_and_an_entry_in_both_counts_once(monkeypatch, tmp_path):
    """torch 2.11's CUDA build keeps NCCL's recorder apart (``_dump_nccl_trace_json``; seen on an H200):
    reading only the common one found no collective of an NCCL group."""
    import torch._C._distributed_c10d as c10d

    def entry(pg: tuple[str, str], seq: int, op: str) -> dict:
        return {"process_group": list(pg), "collective_seq_id": seq, "profiling_name": op, "state": "scheduled"}

    gloo = {"version": "2.10", "entries": [entry(("1", "gloo_pg"), 2, "gloo:all_reduce")]}
    nccl = {"version": "2.10", "entries": [entry(("0", "default_pg"), 7, "nccl:all_reduce"), *gloo["entries"]],
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}}
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *_: json.dumps(gloo), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *_: json.dumps(nccl), raising=False)
    got = last_collectives(str(tmp_path / "fr.json"))
    assert sorted((g["pg"], g["desc"], g["seq"], g["op"], g.get("ranks")) for g in got) == [
        ("0", "default_pg", 7, "nccl:all_reduce", [0, 1, 2, 3]), ("1", "gloo_pg", 2, "gloo:all_reduce", None)]
    assert len(json.loads((tmp_path / "fr.json").read_text())["entries"]) == 2
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *_: (_ for _ in ()).throw(RuntimeError("off")))
    assert [g["desc"] for g in last_collectives()] == ["gloo_pg"]  # one recorder off: the other still read


SUBGROUPS = """
import json, sys, torch, torch.distributed as dist
from datetime import timedelta
from ddprun.worker.collectives import last_collectives
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=40))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
alone, other, both = dist.new_group([0]), dist.new_group([1]), dist.new_group([0, 1])  # no group_desc
t = torch.ones(1)
for _ in range(3 if rank == 0 else 1):  # each rank's own group, a different number of times
    dist.all_reduce(t, group=alone if rank == 0 else other)
dist.all_reduce(t, group=both)
dist.all_reduce(t)
healthy = last_collectives()
store.set(f"healthy{rank}", "1")
store.wait(["healthy0", "healthy1"])
work = dist.all_reduce(t, group=both, async_op=True) if rank == 0 else None  # rank 1 lags behind in it
stuck = last_collectives()
store.set(f"stuck{rank}", "1")
store.wait(["stuck0", "stuck1"])
if rank == 1:
    dist.all_reduce(t, group=both)
else:
    work.wait()
json.dump({"healthy": healthy, "stuck": stuck}, open(out, "w"))
dist.destroy_process_group()
"""


@pytest.mark.timeout(90)
def test_subgroups_without_a_description_are_judged_apart_with_real_recorders(tmp_path):
    """Every new_group() without group_desc is described "undefined": the groups [0], [1] and [0, 1]
    of a healthy job were once merged into one, and rank 1 named behind rank 0's third collective
    of its own group."""
    port = free_port()
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "100", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", SUBGROUPS, str(r), str(port), str(tmp_path / f"{r}.json")],
                              env=env) for r in (0, 1)]
    assert [p.wait(timeout=80) for p in procs] == [0, 0]
    got = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)}
    assert attribution({r: {"collectives": got[r]["healthy"]} for r in (0, 1)}) == []
    assert attribution({r: {"collectives": got[r]["stuck"]} for r in (0, 1)}) == [
        "rank 1 never entered ALLREDUCE #2 of group 3; rank 0 waits in it (rank 1 is at #1)"]
