"""The console follower (agent/logs.py LogFollower) across a restart: torch's agent moves rank-N.log
aside and creates a new one. Every line of both attempts reaches the console once, in order.

CI once showed a restarted job replaying attempt 0's rank-0 log and never printing attempt 1's
("resuming from ..."): a poll had the old file open when the restart reset its offset to 0, read
the old file again, and kept the old file's size as the new file's offset."""

from __future__ import annotations

import io
import os
import time

import pytest

from ddprun.agent.logs import LogFollower

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def follower():
    out = io.StringIO()
    f = LogFollower(out, interval_s=3600)  # polled by hand below
    yield f, out
    f.stop()


def write(path, text: str) -> None:
    with open(path, "a") as fp:
        fp.write(text)


def restart(path) -> None:
    """What RankLogsSpecs.reify does to a rank's log before the next attempt's worker starts."""
    os.replace(path, str(path).replace(".log", ".attempt-0.log"))


def test_a_restart_shows_the_old_attempts_last_lines_then_the_new_attempt_once(tmp_path, follower):
    f, out = follower
    log = tmp_path / "rank-0.log"
    write(log, "".join(f"old {i}\n" for i in range(20)))
    f.follow({str(log): ""})
    f._pump()
    write(log, "old tail\n")  # written after the last poll, before the move
    restart(log)
    write(log, "resuming from step 8\n")  # the new attempt: shorter than the old one
    f.follow({str(log): ""})  # reify follows the same path again
    f._pump()
    write(log, "done\n")
    f._pump()
    assert out.getvalue() == "".join(f"old {i}\n" for i in range(20)) + "old tail\nresuming from step 8\ndone\n"


def test_a_poll_between_the_move_and_the_new_file_keeps_reading_the_old_one(tmp_path, follower):
    f, out = follower
    log = tmp_path / "rank-1.log"
    write(log, "a\n")
    f.follow({str(log): "[rank1] "})
    f._pump()
    restart(log)
    f._pump()  # no file at the path yet
    write(tmp_path / "rank-1.attempt-0.log", "late a\n")  # the dying worker's last words, after the move
    f._pump()
    write(log, "b\n")
    f._pump()
    assert out.getvalue() == "[rank1] a\n[rank1] late a\n[rank1] b\n"


def test_an_incomplete_last_line_ends_at_the_move_and_at_stop(tmp_path):
    out = io.StringIO()
    f = LogFollower(out, interval_s=3600)
    log = tmp_path / "rank-0.log"
    write(log, "whole\nhalf")
    f.follow({str(log): ""})
    f._pump()
    assert out.getvalue() == "whole\n"  # a line being written is not split
    restart(log)
    write(log, "new\nlast, no newline")
    f._pump()
    assert out.getvalue() == "whole\nhalf\nnew\n"
    f.stop()
    assert out.getvalue() == "whole\nhalf\nnew\nlast, no newline\n"
    assert all(g.fp is None for g in f._files.values())  # stop closes what it kept open


def test_the_thread_follows_a_file_created_after_follow(tmp_path):
    out = io.StringIO()
    f = LogFollower(out, interval_s=0.01)
    log = tmp_path / "rank-0.log"
    f.follow({str(log): ""})
    write(log, "hello\n")
    deadline = time.monotonic() + 5
    while out.getvalue() != "hello\n" and time.monotonic() < deadline:  # the thread's poll, not stop()'s last read
        time.sleep(0.01)
    seen = out.getvalue()
    f.stop()
    assert seen == "hello\n" and out.getvalue() == "hello\n"


def test_a_dropped_file_is_copied_by_the_next_poll_to_the_end_of_what_it_has_open(tmp_path, follower):
    """follow(only=True) (a round gave this node other ranks) leaves the copying to the poller, so what
    a poll read before is written first; the dropped file is read to its end, and a file that took
    its path (another node's rank) is never read."""
    f, out = follower
    log = tmp_path / "rank-0.log"
    write(log, "1\n")
    f.follow({str(log): ""})
    f._pump()
    write(log, "2\nunended")
    f.follow({}, only=True)
    assert out.getvalue() == "1\n"  # nothing written by follow() itself
    restart(log)
    write(log, "another node's rank 0\n")
    f._pump()
    f._pump()
    assert out.getvalue() == "1\n2\nunended\n"


def test_tee_puts_the_chosen_local_ranks_on_the_console_prefixed_and_no_other(tmp_path, follower):
    """`ddprun run --tee 1:3 --nproc-per-node 3` on node 1 of a 2 × 3 job (ranks 3-5): its local
    rank 1 (rank 4) is followed with a ``[rank4]`` prefix, local ranks 0 and 2 stay in their logs."""
    from ddprun.agent.logs import RankLogsSpecs
    from ddprun.agent.run import parse_local_ranks
    from ddprun.protocol.env import WorkerEnv

    f, out = follower
    tee = parse_local_ranks("1:3", 3)
    spec = RankLogsSpecs(str(tmp_path), f, tee, WorkerEnv(run_dir=str(tmp_path)))
    spec.reify({lr: {"RANK": str(3 + lr), "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"} for lr in range(3)})
    for rank in (3, 4, 5):
        write(tmp_path / "logs" / f"rank-{rank}.log", f"step 1 on rank {rank}\n")
    f._pump()
    assert (tee, out.getvalue()) == ({1}, "[rank4] step 1 on rank 4\n")
    assert parse_local_ranks("3", 3) == {0, 1, 2} and parse_local_ranks("0", 3) == set()
