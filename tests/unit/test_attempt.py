"""Attempt ids and the per-attempt store namespace that lets a restarted worker group start cleanly."""

import os
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ddprun.agent import attempt
from ddprun.agent.logs import RankLogsSpecs
from ddprun.protocol import store as keys
from ddprun.protocol.env import WorkerEnv
from ddprun.worker import pgstore
from tests.helpers import free_port, store_server


@pytest.fixture
def store():
    s = store_server(free_port(), 10.0)
    yield s


@pytest.fixture
def handlers(monkeypatch):
    """torch's rendezvous handler table, restored after the test."""
    import importlib

    table = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    monkeypatch.setattr(importlib.import_module("torch.distributed.rendezvous"), "_rendezvous_handlers", dict(table))
    return importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers


def agent_env(store, **extra):
    return {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0", "WORLD_SIZE": "1", **extra}


def test_attempt_id_prefers_the_launcher_value_over_the_restart_count():
    assert keys.attempt_id({"TORCHELASTIC_RESTART_COUNT": "2"}) == "c2"
    assert keys.attempt_id({"TORCHELASTIC_RESTART_COUNT": "2", "DDPRUN_ATTEMPT": "r5"}) == "r5"
    assert keys.attempt_id({}) == "c0"
    assert keys.store_prefix({"TORCHELASTIC_RUN_ID": "j", "DDPRUN_ATTEMPT": "r1"}) == "ddprun/j/r1/"


def test_env_rendezvous_store_is_prefixed_per_attempt(store, handlers, monkeypatch):
    env = agent_env(store, DDPRUN_ATTEMPT="r3")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert pgstore.namespace_process_groups(env) == "ddprun/job/r3/pg"
    assert pgstore.namespace_process_groups(env) == "ddprun/job/r3/pg"  # idempotent: wrapped once
    assert hasattr(handlers["env"], "_ddprun_inner") and not hasattr(handlers["env"]._ddprun_inner, "_ddprun_inner")
    s, rank, world = next(dist.rendezvous("env://"))
    s.set("k", "v")
    assert (rank, world) == (0, 1)
    assert store.get("ddprun/job/r3/pg/k") == b"v" and not store.check(["k"])
    s, _, _ = next(dist.rendezvous(f"tcp://127.0.0.1:{store.port}", rank=0, world_size=1))  # tcp:// as well
    s.set("t", "v")
    assert store.get("ddprun/job/r3/pg/t") == b"v"


def test_a_second_attempt_does_not_see_the_first_attempts_process_group_keys(store, handlers, monkeypatch):
    """The failure this prevents: attempt 2's gloo setup reading attempt 1's peer addresses."""
    for k, v in agent_env(store).items():
        monkeypatch.setenv(k, v)
    first = pgstore.namespace_process_groups(agent_env(store, DDPRUN_ATTEMPT="r0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert store.check([f"{first}/default_pg/0//cpu//0/0"])  # the gloo address key, in attempt r0's space
    handlers["env"] = handlers["env"]._ddprun_inner
    second = pgstore.namespace_process_groups(agent_env(store, DDPRUN_ATTEMPT="r1"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert second != first and store.check([f"{second}/default_pg/0//cpu//0/0"])


def test_nothing_changes_without_the_agent_store(handlers):
    before = dict(handlers)
    assert pgstore.namespace_process_groups({"TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert handlers == before


def test_the_attempt_id_is_the_round_torchs_handler_completed_in_this_process():
    handler = SimpleNamespace(_state_holder=SimpleNamespace(state=SimpleNamespace(round=7)))
    assert attempt.handler_round(handler) == 7
    assert attempt.handler_round(object()) is None  # another backend: no state
    ids = attempt.AttemptIds("c10d")
    ids.set_round(attempt.handler_round(handler))
    assert ids.current("0") == "r7"
    assert attempt.AttemptIds("static").current(2) == "c2"
    assert attempt.AttemptIds("c10d").current("1") == "c1"  # unknown: the restart count, with a line in the agent log


def test_a_real_c10d_handler_gives_its_round():
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{free_port()}", run_id="job", min_nodes=1,
                                  max_nodes=1, is_host="true")
    handler = registry.get_rendezvous_handler(params)
    try:
        handler.next_rendezvous()
        first = attempt.handler_round(handler)
        handler.next_rendezvous()
        assert (first, attempt.handler_round(handler)) == (0, 1)
    finally:
        handler.shutdown()


def test_logs_spec_gives_every_worker_the_attempt_and_keeps_each_attempts_log(tmp_path):
    seen = []

    def attempt_of(count):
        seen.append(count)
        return f"r{len(seen)}"

    spec = RankLogsSpecs(str(tmp_path), None, set(), WorkerEnv(run_dir=str(tmp_path)), attempt_id=attempt_of)
    envs = {0: {"RANK": "0", "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}}
    spec.reify(envs)
    assert envs[0]["DDPRUN_ATTEMPT"] == "r1"
    (tmp_path / "logs" / "rank-0.log").write_text("attempt 1\n")
    # a membership-change restart: the restart count stays 0, the log of the first attempt is kept anyway
    envs = {0: {"RANK": "0", "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}}
    spec.reify(envs)
    assert envs[0]["DDPRUN_ATTEMPT"] == "r2" and seen == ["0", "0"]
    # kept under the attempt that wrote it: the name the restart's line printed (agent/failures.py)
    assert (tmp_path / "logs" / "rank-0.attempt-r1.log").read_text() == "attempt 1\n"


def test_a_log_of_a_rank_an_elastic_round_gave_another_node_is_kept_under_its_attempt_too(tmp_path):
    """The restart line names the failed rank's log as its node keeps it at the next start: also when
    that start gives the node other ranks (the log is no longer at a path this node starts)."""
    spec = RankLogsSpecs(str(tmp_path), None, set(), WorkerEnv(run_dir=str(tmp_path)),
                         attempt_id=lambda count: f"r{count}")
    spec.reify({0: {"RANK": "1", "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"}})
    (tmp_path / "logs" / "rank-1.log").write_text("it failed here\n")
    spec.reify({0: {"RANK": "0", "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}})
    assert not (tmp_path / "logs" / "rank-1.log").exists()
    assert (tmp_path / "logs" / "rank-1.attempt-r0.log").read_text() == "it failed here\n"


def test_a_round_that_moves_rank_0_elsewhere_leaves_this_node_only_its_new_ranks(tmp_path):
    """An elastic round may give a node other ranks: rank 0 in round 0, rank 1 after a node that sorts
    first joined. The node then no longer claims rank 0 (the run report, the console's summary), nor
    the ranks it ran before (a failure's 'stopped because of it'), nor echoes rank 0's log, which the
    new rank 0's node writes at the same path in a shared run directory (seen in the fault tier)."""
    import io

    from ddprun.agent.logs import LogFollower

    out = io.StringIO()
    follower = LogFollower(out, interval_s=3600)  # polled by hand
    spec = RankLogsSpecs(str(tmp_path), follower, set(), WorkerEnv(run_dir=str(tmp_path)))
    spec.reify({0: {"RANK": "0", "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}})
    assert spec.has_rank0 and set(spec.local_workers) == {0}
    log = tmp_path / "logs" / "rank-0.log"
    log.write_text("round 0 on this node\nits last line, unended")
    follower._pump()
    spec.reify({0: {"RANK": "1", "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"}})
    assert not spec.has_rank0 and set(spec.local_workers) == {1}
    assert not log.exists()  # this node kept its own log aside (under its attempt)
    log.write_text("rank 0 on the other node\n")  # the other node starts its rank 0
    follower.stop()
    assert out.getvalue() == "round 0 on this node\nits last line, unended\n"


def test_a_node_that_takes_over_a_rank_keeps_the_log_another_node_wrote_for_it_this_launch(tmp_path):
    """Shared run dir, elastic: a node launched first but joining late becomes rank 0's. The early
    node's rank-0.log of this launch (newer than the late node's launch: not an earlier launch's)
    must not be emptied by torch's open("w"): it is kept as an attempt log, never over another."""
    spec = RankLogsSpecs(str(tmp_path), None, set(), WorkerEnv(run_dir=str(tmp_path)))  # the late node's launch
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0.attempt-0.log").write_text("the early node's restart\n")
    (logs / "rank-0.log").write_text("round 0 on the early node\n")  # written after the late node launched
    # a file's mtime comes from the kernel's coarse clock, which may lag time.time() at the launch by
    # a tick: the test says "after" in seconds, as two nodes' launches differ
    later = time.time() + 1.0
    os.utime(logs / "rank-0.log", (later, later))
    spec.reify({0: {"RANK": "0", "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}})
    assert (logs / "rank-0.log").read_text() == ""  # this start's own, created for its worker
    assert (logs / "rank-0.attempt-0.log").read_text() == "the early node's restart\n"
    assert (logs / "rank-0.attempt-1.log").read_text() == "round 0 on the early node\n"
    assert not list(logs.glob("before-*"))  # not taken for an earlier launch's


def test_a_node_leaves_alone_the_live_log_of_the_node_an_elastic_round_gave_its_rank(tmp_path):
    """Shared run dir, elastic: node A ran rank 1, a round gives rank 1 to node B, whose worker already
    writes rank-1.log when A's own start (now rank 0) comes to move A's last log aside. A moves only the
    file it created: B's live log keeps its name (before, it was moved to rank-1.attempt-<A's>.log and
    B's worker wrote on under that name)."""
    def node():
        return RankLogsSpecs(str(tmp_path), None, set(), WorkerEnv(run_dir=str(tmp_path)),
                             attempt_id=lambda count: f"r{count}")

    a, b = node(), node()
    log = tmp_path / "logs" / "rank-1.log"
    a.reify({0: {"RANK": "1", "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}})
    log.write_text("rank 1 on node A, round 0\n")
    b.reify({0: {"RANK": "1", "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"}})
    with open(log, "a") as live:  # B's worker writes its log
        live.write("rank 1 on node B, round 1\n")
        a.reify({0: {"RANK": "0", "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}})
    assert log.read_text() == "rank 1 on node B, round 1\n"
    kept = [p.read_text() for p in (tmp_path / "logs").glob("rank-1.attempt-*.log")]
    assert kept == ["rank 1 on node A, round 0\n"], kept


def test_a_log_that_took_the_path_between_the_check_and_the_move_gets_its_name_back(tmp_path, monkeypatch):
    from ddprun.agent import logs

    path = tmp_path / "rank-1.log"
    ours = logs.create_log(str(path))
    os.rename(path, tmp_path / "elsewhere.log")  # kept: its inode is not reused for the next file
    path.write_text("the other node's live log\n")  # another file now, after this node's check passed
    checks = iter([ours])
    real = logs.identity
    monkeypatch.setattr(logs, "identity", lambda p: next(checks, None) or real(p))
    logs.keep_as_attempt(str(path), "r0", ours)
    assert path.read_text() == "the other node's live log\n"
    assert not list(tmp_path.glob("rank-1.attempt-*.log"))
