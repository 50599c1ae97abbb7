"""Failure records and the one classifier behind every node's console and WorkerFailed."""

import json
import re
from dataclasses import dataclass

import pytest

from ddprun.agent import console
from ddprun.protocol import failure as fr
from ddprun.protocol.rundir import RunDir
from ddprun.worker.exit import STOPPED_MARK, stopped_message


@dataclass
class Failure:  # the fields of torch's ProcessFailure that local_records reads
    local_rank: int
    exitcode: int


def rec(kind, rank, summary="", t=1.0, **kw):
    return fr.FailureRecord(kind, rank, summary, kw.pop("node_rank", rank // 2), kw.pop("host", f"h{rank // 2}"),
                            kw.pop("local_rank", rank % 2), t=t, **kw)


def test_a_peers_connection_error_is_never_the_cause_even_when_it_came_first():
    echo = rec(fr.ERROR, 0, "RuntimeError: [gloo] ... Connection reset by peer", t=1.0)
    killed = fr.from_exit(3, -9, node_rank=1, host="h1", local_rank=1, t=2.0)
    assert echo.is_echo and not killed.is_echo
    assert fr.root_cause([echo, killed]) is killed
    assert killed.headline() == "rank 3 (node 1, h1) was killed by SIGKILL"
    assert "OOM" in killed.hint or "out-of-memory" in killed.hint


def test_the_earliest_first_hand_failure_is_the_cause():
    a, b = rec(fr.ERROR, 2, "ValueError: late", t=5.0), rec(fr.ERROR, 1, "ValueError: first", t=4.0)
    stopped = fr.stopped_by(b, rank=0, node_rank=0, host="h0", local_rank=0, t=3.0)
    assert fr.root_cause([a, b, stopped]) is b
    assert fr.root_cause([]) is None


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", json.dumps({"kind": "boom", "rank": 1, "summary": ""}),
                                 json.dumps({"kind": "error", "rank": "1", "summary": "x"}),
                                 json.dumps({"kind": "error", "rank": 1, "summary": 3})])
def test_a_malformed_record_is_skipped_never_trusted(raw):
    good = rec(fr.ERROR, 1, "x").to_json()
    assert fr.parse_many([raw, good.encode()]) == [fr.FailureRecord.from_json(good)]


def test_records_round_trip_through_json():
    r = fr.from_exit(5, 3, node_rank=2, host="b", local_rank=1, t=9.5)
    assert fr.FailureRecord.from_json(r.to_json()) == r and r.how() == "exited with code 3"


def test_every_node_names_the_killed_rank_and_its_own_ranks_as_stopped(tmp_path):
    killed = fr.from_exit(1, -9, node_rank=1, host="b", local_rank=0, t=2.0)
    echo = rec(fr.ERROR, 0, "RuntimeError: Connection closed by peer", node_rank=0, host="a", local_rank=0)
    text = console.summary({0: echo}, [killed], RunDir(str(tmp_path)), "a")
    lines = text.splitlines()
    assert lines[0] == "ddprun: the job failed: rank 1 (node 1, b) was killed by SIGKILL"
    assert lines[1].startswith("HINT: killed by SIGKILL")
    assert "ddprun: rank(s) 0 on a were stopped because of it." in lines
    assert "Connection closed" not in text and lines[-1] == "ddprun: the job failed."


def test_ranks_that_failed_alike_are_one_line_and_their_logs_are_not_repeated(tmp_path):
    line = "Lightning's Trainer and the launch disagree ... HINT: ..."
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-3.log").write_text(f"Adding 1 callbacks\nddprun: {line}\n")
    a, b = rec(fr.MISMATCH, 2, line, t=1.0, node_rank=1, host="h", local_rank=0), \
        rec(fr.MISMATCH, 3, line, t=1.1, node_rank=1, host="h", local_rank=1)
    stopped = fr.stopped_by(a, rank=4, node_rank=1, host="h", local_rank=2, t=1.2)
    local = console.local_records({2: Failure(0, 1), 3: Failure(1, 1), 4: Failure(2, 1), 5: Failure(3, -15)},
                                  {2: a, 3: b, 4: stopped}, "h", 1, a)
    text = console.summary(local, [], RunDir(str(tmp_path)), "h")
    assert text.splitlines()[0] == f"ddprun: the job failed: rank 2 (node 1, h) failed: {line}"
    assert "rank 3 (local rank 1 on h) failed alike" in text and text.count(line) == 1
    assert "last lines" not in text
    assert "rank(s) 4, 5 on h were stopped because of it." in text


def test_a_rank_that_died_here_shows_its_log_tail_without_cpp_frames(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-1.log").write_text("step 3\n[rank1] frame #22: __libc_start_main + 0x80\nstep 4\n")
    killed = fr.from_exit(1, -9, node_rank=0, host="a", local_rank=1, t=2.0)
    text = console.summary({1: killed}, [], RunDir(str(tmp_path)), "a")
    assert "[rank1] step 4" in text and "frame #" not in text


def test_a_cpp_warnings_stack_after_the_python_traceback_does_not_hide_it(tmp_path):
    """A store call that fails as the process ends (its peer's store closed) makes torch log a warning
    with a C++ stack after the traceback: the excerpt shows the traceback, not that stack."""
    (tmp_path / "logs").mkdir()
    cpp = ["[rank1]:[W1204 05:52:00.549125409 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=3): "
           "Failed to recv, got 0 bytes. Connection was likely closed. ",
           "Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 "
           "(most recent call first):",
           *[f"frame #{i}: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7fac in libc10.so)" for i in range(9)],
           "<omitting python frames>", "frame #20: <unknown function> + 0x891f5 (0x7fac in libc.so.6)", ""]
    py = ["Traceback (most recent call last):", '  File "job.py", line 101, in main',
          '    raise RuntimeError(f"injected failure on rank {rank}")', "RuntimeError: injected failure on rank 1"]
    (tmp_path / "logs" / "rank-1.log").write_text("\n".join(["step 3", *py, *cpp]) + "\n")
    failed = fr.FailureRecord(fr.ERROR, 1, "RuntimeError: injected failure on rank 1", 0, "a", local_rank=1)
    text = console.summary({1: failed}, [], RunDir(str(tmp_path)), "a", followed=())
    assert "[rank1] Traceback (most recent call last):" in text and "[rank1] RuntimeError: injected" in text, text
    assert not re.search(r"frame #|omitting|Exception raised|TCPStore|recvValue", text), text
    assert console._CPP_NOISE.match("  [rank0] frame #22: __libc_start_main + 0x80")
    assert not console._CPP_NOISE.match("RuntimeError: frame #3 is missing")


def test_a_rank_stopped_by_another_says_so_in_one_line():
    cause = rec(fr.ERROR, 3, "RuntimeError: injected failure on rank 3", node_rank=1, host="b")
    msg = stopped_message(cause)
    assert msg.startswith(f"{STOPPED_MARK} rank 3 (node 1, b) failed: RuntimeError: injected failure on rank 3")
    lost = fr.FailureRecord(fr.LOST, -1, "its agent stopped answering for 10 s", 1, "b", by="observer")
    assert stopped_message(lost) == f"{STOPPED_MARK} node 1 (b) was lost: its agent stopped answering for 10 s"


def test_a_stopped_rank_names_the_causes_log_as_a_restart_keeps_it():
    """Where a restart may follow this attempt, the cause's log is moved aside under the attempt's id
    before the next start (agent/logs.py keep_as_attempt): the line names that file, not the path the
    next attempt's log takes; in the last attempt the log stays where it is."""
    from types import SimpleNamespace

    cause = rec(fr.ERROR, 3, "RuntimeError: injected failure on rank 3", node_rank=1, host="b")
    ch = SimpleNamespace(last_attempt=False, wenv=SimpleNamespace(attempt="r2"))
    assert stopped_message(cause, ch).endswith("(its log: logs/rank-3.attempt-r2.log on b)")
    ch.last_attempt = True
    assert stopped_message(cause, ch).endswith("(its log: logs/rank-3.log on b)")


def test_a_rank_inferred_to_have_finished_first_is_outranked_by_any_record_seen_first_hand():
    """`finished first` is read from an echo; in a job whose ranks may end at different times, a node
    lost later (its observer's record) is the cause, whenever that record arrives."""
    first = fr.finished_first(fr.CleanEnd(1, 0, "a", 1, 5, t=100.0))
    lost = fr.FailureRecord(fr.LOST, -1, "its agent stopped answering", 2, "c", by="observer", t=130.0)
    echo = fr.FailureRecord(fr.ERROR, 0, "RuntimeError: Connection reset by peer", 0, "a", 0, t=90.0)
    assert fr.root_cause([echo, first]) == first
    assert fr.root_cause([first, lost, echo]) == lost
