"""Preflight checks over node facts: each inconsistency is named with its nodes and values."""

import pytest

from ddprun.worker.preflight import check


def node(rank, host="h", **kw):
    base = {"node_rank": rank, "host": f"{host}{rank}", "nproc": 2, "gpus": 0, "nnodes": "2:2",
            "torch": "2.13.0", "cuda": "", "nccl": "", "python": "3.11.7", "script_sha": "abc",
            "free_disk_gb": 50.0}
    base.update(kw)
    return base


def errors(findings):
    return [f.message for f in findings if f.level == "error"]


def test_consistent_nodes_pass():
    assert check([node(0), node(1)], 4) == []


def test_different_process_counts_name_every_node_and_the_world_size():
    (msg,) = errors(check([node(0, nproc=2), node(1, nproc=1)], 3))
    assert "node 0 (h0) runs 2" in msg and "node 1 (h1) runs 1" in msg and "WORLD_SIZE became 3" in msg
    assert "HINT" in msg


def test_gpus_not_matching_processes_is_an_error():
    (msg,) = errors(check([node(0, gpus=4, nproc=4), node(1, gpus=8, nproc=4)], 8))
    assert "node 1 (h1) has 8 GPUs but runs 4 processes (4 GPUs idle)" in msg


def test_version_mismatch_names_the_odd_node():
    msgs = errors(check([node(0), node(1), node(2, torch="2.12.0")], 6))
    assert any("torch differs" in m and "node 2 (h2) has '2.12.0'" in m for m in msgs)


def test_nnodes_disagreement_and_duplicate_host_rank():
    msgs = errors(check([node(0, nnodes="2:2"), node(1, nnodes="3:3")], 4))
    assert any("--nnodes differs" in m for m in msgs)
    msgs = errors(check([node(0, host="x"), {**node(0, host="x")}], 4))
    assert any("same host and node rank (x0, node 0)" in m for m in msgs)


def test_different_script_is_only_a_warning():
    findings = check([node(0), node(1, script_sha="zzz")], 4)
    assert errors(findings) == []
    assert any(f.level == "warning" and "script differs" in f.message for f in findings)


def test_uneven_nodes_pass_only_when_every_node_allows_them():
    from ddprun.worker.preflight import check

    def node(rank, nproc, ok):
        return {"node_rank": rank, "host": f"h{rank}", "nproc": nproc, "gpus": 0, "torch": "2", "cuda": "", "nccl": "",
                "nnodes": "2:2", "python": "3.11", "script_sha": "s", "free_disk_gb": 50, "uneven_ok": ok}

    refused = [f.message for f in check([node(0, 2, False), node(1, 1, False)], 3) if f.level == "error"]
    assert len(refused) == 1 and "pass --allow-uneven-nodes on every node" in refused[0]
    assert [f for f in check([node(0, 2, True), node(1, 1, True)], 3) if f.level == "error"] == []
    partial = [f.message for f in check([node(0, 2, True), node(1, 1, False)], 3) if f.level == "error"]
    assert any("--allow-uneven-nodes is given on some nodes only: node 0 (h0) with, node 1 (h1) without" in m
               for m in partial)


def test_a_rank_started_twice_stops_with_its_node_and_a_hint(monkeypatch, capsys):
    from ddprun.protocol import failure as fr
    from ddprun.protocol.env import WorkerEnv
    from ddprun.worker import exit as worker_exit
    from ddprun.worker.channel import JobChannel
    from ddprun.worker.preflight import announce

    class CountingStore:
        def __init__(self):
            self.counts, self.data = {}, {}

        def add(self, key, n):
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]

        def set(self, key, value):
            self.data[key] = value

    environ = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    store = CountingStore()
    ch = JobChannel(environ, WorkerEnv(run_dir="/nonexistent"), connect=lambda: store)
    store.add(ch.keys.rank_count(3), 1)  # the other node that claims node rank 1 published rank 3 first
    recorded = []
    monkeypatch.setattr(worker_exit, "record", lambda rec, channel: recorded.append(rec))
    with pytest.raises(SystemExit) as stop:
        announce(ch)
    assert stop.value.code == 1 and ch.keys.rank(3) not in store.data  # its row never overwrote the first's
    err = capsys.readouterr().err
    assert err.startswith(f"ddprun: preflight: global rank 3 was started twice (this one on {ch.host}, node rank 1): "
                          "two nodes share a node rank. HINT: give each node its own --node-rank")
    assert [(r.kind, r.rank, r.node_rank) for r in recorded] == [(fr.PREFLIGHT, 3, 1)]


def test_rank_0_waits_for_slow_starting_ranks_as_long_as_the_group_init_may_take_naming_them(tmp_path, capsys):
    # a rank whose imports from a loaded shared file system outlast the join timeout is alive, only
    # slow: preflight failed the healthy job with "ranks [1] did not start within 120 s"
    import json
    import threading

    from ddprun.protocol import defaults
    from ddprun.protocol.env import WorkerEnv
    from ddprun.worker import preflight
    from ddprun.worker.channel import JobChannel
    from tests.helpers import store_server

    assert preflight.start_bound(WorkerEnv(run_dir=str(tmp_path), join_timeout=1)) == defaults.INIT_TIMEOUT_S
    assert preflight.start_bound(WorkerEnv(run_dir=str(tmp_path), join_timeout=900)) == 900
    store = store_server()
    environ = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "TORCHELASTIC_RUN_ID": "a", "DDPRUN_ATTEMPT": "0"}
    ch = JobChannel(environ, WorkerEnv(run_dir=str(tmp_path), join_timeout=1), connect=lambda: store)
    store.set(ch.keys.rank(0), json.dumps({"rank": 0}))
    late = threading.Timer(1.5, store.set, args=(ch.keys.rank(1), json.dumps({"rank": 1})))
    late.start()
    rows = preflight._rows(ch, timeout=20, say_every_s=0.5)
    late.join()
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert "ddprun: preflight: rank(s) 1 not started yet after " in capsys.readouterr().err
