"""openfiles.py: a process's open-files limit, raised within the hard limit and said when too low."""

from __future__ import annotations

import errno
import resource

import pytest

from ddprun import openfiles
from ddprun.openfiles import (
    FLOOR,
    Limits,
    agent_warning,
    exhausted_hint,
    needed,
    needed_without_agent,
    raise_soft_limit,
    target,
    too_low,
)

INF = resource.RLIM_INFINITY


def test_the_soft_limit_rises_to_the_floor_or_the_jobs_need_within_the_hard_limit():
    assert target(1024, 1_048_576, 300) == FLOOR
    assert target(1024, 1_048_576, 200_000) == 200_000
    assert target(1024, 4096, 200_000) == 4096  # no privilege needed up to the hard limit, none beyond
    assert target(1024, INF, 200_000) == 200_000


def test_the_soft_limit_is_never_lowered():
    assert target(500_000, 1_048_576, 300) == 500_000
    assert target(INF, INF, 300) == INF
    assert target(4096, 4096, 300) == 4096


def test_a_thousand_nodes_of_eight_need_more_than_a_default_soft_limit():
    need = needed(8192, 1024, 8)
    assert 8192 * 3 < need < 40_000  # what the store host holds: 3 sockets a rank, 6 a node, its own files
    assert agent_warning(Limits(1024, 1024), 8192, 1024, 8) is not None
    assert agent_warning(Limits(65536, 1_048_576), 8192, 1024, 8) is None
    assert 8192 < needed_without_agent(8192) < need  # srun/mpirun: rank 0's store, one socket a rank


def test_a_hard_limit_below_the_need_is_one_warning_with_the_values_and_a_hint():
    msg = agent_warning(Limits(4096, 4096), 8192, 1024, 8)
    assert msg is not None and msg.startswith("ddprun: warning: ") and "\n" not in msg
    assert f"needs about {needed(8192, 1024, 8)} open files on the node that hosts its stores" in msg
    assert "8192 ranks on 1024 node(s)" in msg and "limit is 4096" in msg and "hard limit 4096" in msg
    assert "HINT: raise the hard limit on every node" in msg and "Connection reset by peer" in msg
    msg = too_low(Limits(4096, 4096), 8448, "8192 ranks", "in rank 0")
    assert msg is not None and "this job (8192 ranks) needs about 8448 open files in rank 0" in msg


def test_an_unlimited_or_sufficient_limit_says_nothing():
    assert agent_warning(Limits(INF, INF), 8192, 1024, 8) is None
    assert agent_warning(Limits(65536, 65536), 16, 2, 8) is None
    assert too_low(Limits(8448, 8448), 8448, "8192 ranks", "in rank 0") is None


@pytest.fixture
def low_soft_limit():
    """This process's soft limit lowered to 256 for the test (lowering needs no privilege), then restored."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    yield hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_raise_soft_limit_sets_the_process_limit(low_soft_limit):
    hard = low_soft_limit
    limits = raise_soft_limit(1000)
    want = FLOOR if hard == INF else min(hard, FLOOR)
    assert limits == Limits(want, hard)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (want, hard)


def test_a_limit_the_sandbox_refuses_is_left_as_it_is(low_soft_limit, monkeypatch):
    class Refusing:  # the module as a sandbox shows it: setrlimit refused (not the real module's, which
        def __getattr__(self, name):  # the fixture needs to restore the limit)
            return getattr(resource, name)

        def setrlimit(self, *_):
            raise ValueError("not allowed")

    monkeypatch.setattr(openfiles, "resource", Refusing())
    assert raise_soft_limit(1000).soft == 256
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 256


def test_running_out_of_open_files_gets_a_hint_with_the_limit_other_errors_none():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hint = exhausted_hint(OSError(errno.EMFILE, "Too many open files"))
    assert hint.startswith("\nHINT: this process ran out of open files") and f"limit of {soft}" in hint
    assert exhausted_hint(OSError(errno.ENOSPC, "No space left on device")) == ""
    assert exhausted_hint(RuntimeError("Too many open files")) == ""


def test_rank_0_without_an_agent_raises_its_limit_for_the_store_it_hosts(low_soft_limit, capsys):
    from types import SimpleNamespace

    from ddprun import runtime

    runtime._open_files(SimpleNamespace(rank=1, world_size=4), {})  # not the store's host
    runtime._open_files(SimpleNamespace(rank=0, world_size=4), {"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 256  # under an agent: the agent's store
    runtime._open_files(SimpleNamespace(rank=0, world_size=4), {})  # srun/mpirun: rank 0 hosts it
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 256
    assert capsys.readouterr().err == ""


def test_rank_0_says_when_its_hard_limit_is_below_the_store_it_hosts(monkeypatch, capsys):
    from types import SimpleNamespace

    from ddprun import runtime

    monkeypatch.setattr(openfiles, "raise_soft_limit", lambda need: Limits(4096, 4096))
    runtime._open_files(SimpleNamespace(rank=0, world_size=8192), {})
    err = capsys.readouterr().err
    assert err.startswith(f"ddprun: warning: this job (8192 ranks) needs about {needed_without_agent(8192)} open "
                          "files in rank 0, which hosts the job's store") and "limit is 4096" in err, err
