"""The hang report names the rank whose place differs from the rest."""

import threading
import time

from ddprun.worker.monitor import stall_threshold
from ddprun.worker.stacks import hang_report, main_thread_place


def place(where, user="train.py:57 in main", host="h"):
    return {"where": where, "user_frame": user, "host": host, "frames": ["train.py:57 in main"]}


def test_the_odd_rank_is_named_with_what_the_others_do():
    places = {r: place("in backward (DDP's gradient all-reduce)", "train.py:63 in main") for r in range(3)}
    places[3] = place("at train.py:59 in main", "train.py:59 in main", host="node-b")
    summary, report = hang_report(places, 4, 31.0, {0: 3, 1: 3, 2: 3, 3: 3})
    assert summary == ("no rank advanced for 31 s: rank 3 (node-b) at train.py:59 in main while ranks 0-2 are "
                       "in backward (DDP's gradient all-reduce)")
    assert "rank 3 (node-b), step 3" in report


def test_silent_ranks_are_named():
    places = {0: place("in torch.distributed.all_reduce"), 1: place("in torch.distributed.all_reduce")}
    summary, _ = hang_report(places, 3, 10.0, {})
    assert "rank 2 did not answer" in summary


def test_a_rank_that_did_not_answer_because_its_script_had_ended_is_said_so():
    """NCCL: a peer that ended (uneven data) leaves the others in their collective until its timeout;
    the stall report names it for what it did, not as frozen."""
    from ddprun.protocol.failure import CleanEnd

    places = {0: place("in torch.distributed.all_reduce"), 2: place("in torch.distributed.all_reduce")}
    end = CleanEnd(rank=1, node_rank=0, host="node-a", local_rank=1, steps=5, t=0.0)
    summary, report = hang_report(places, 4, 10.0, {}, ended=end)
    assert summary == ("no rank advanced for 10 s: rank 1 (node-a) ended its script (exit 0) after 5 optimizer steps; "
                       "rank 3 did not answer (frozen, or holding the GIL) while ranks 0, 2 are in "
                       "torch.distributed.all_reduce"), summary
    assert "rank 1: its script ended (exit 0) after 5 optimizer steps. every rank must call the same collectives" in report
    other = CleanEnd(rank=0, node_rank=0, host="node-a", local_rank=0, steps=5, t=0.0)  # it answered: not this stall's
    assert hang_report(places, 4, 10.0, {}, ended=other)[0] == hang_report(places, 4, 10.0, {})[0]


def test_main_thread_place_sees_a_sleep_in_user_code():
    result = {}
    def look():
        time.sleep(0.3)  # let the main thread get into its sleep below
        result.update(main_thread_place())

    t = threading.Thread(target=look)
    t.start()
    time.sleep(1.0)  # the main thread is here while the other thread looks at it
    t.join()
    assert result["where"].startswith("at test_watchdog.py:")
    assert "test_main_thread_place_sees_a_sleep_in_user_code" in result["where"]


def test_stall_threshold_is_longer_before_the_first_step():
    assert stall_threshold(300, armed=True) == 300
    assert stall_threshold(300, armed=False) == 600
    assert stall_threshold(5, armed=False) == 30
