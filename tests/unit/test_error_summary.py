"""What a failed rank's record says (protocol/failure.py ``condense``, worker/exit.py ``error_hint``):
the error that ended it in a line, not a traceback torch put inside the message, and a HINT where the
node, not the code, is the cause. The real thing is tests/faults/test_containers.py (a full /dev/shm)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from ddprun.protocol import failure as fr
from ddprun.worker.exit import error_hint

WORKER_ERROR = """RuntimeError: Caught RuntimeError in DataLoader worker process 0.
Original Traceback (most recent call last):
  File "/venv/torch/utils/data/_utils/worker.py", line 374, in _worker_loop
    data = fetcher.fetch(index)
           ^^^^^^^^^^^^^^^^^^^^
  File "/venv/torch/storage.py", line 414, in _new_shared
    return cls._new_using_fd_cpu(size)
RuntimeError: unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left on device (28)
"""


def test_a_traceback_inside_the_message_becomes_the_error_that_ended_it():
    assert fr.condense(WORKER_ERROR) == ("RuntimeError: Caught RuntimeError in DataLoader worker process 0: RuntimeError: "
                                         "unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left "
                                         "on device (28)")


def test_a_message_without_a_traceback_is_kept_as_it_is():
    text = "ValueError: bad shape\n  expected (2, 3)\n  got (3, 2)"
    assert fr.condense(text) == text
    assert fr.condense("Traceback (most recent call last):\n  File x\nKeyError: 1") == \
        "Traceback (most recent call last):\n  File x\nKeyError: 1"  # nothing before it to keep


def test_the_head_is_one_line_and_an_errors_own_continuation_lines_stay():
    text = ("ProcessRaisedException: \n\n-- Process 1 terminated with the following error:\n"
            "Traceback (most recent call last):\n  File \"w.py\", line 3, in f\n    g()\n    ^^^\n"
            "ValueError: bad shape\n  expected (2, 3)\n")
    assert fr.condense(text) == ("ProcessRaisedException: -- Process 1 terminated with the following error: "
                                 "ValueError: bad shape\n  expected (2, 3)")


def test_a_long_text_keeps_its_start_and_its_end_in_exactly_the_limit_and_says_how_much_is_left_out():
    text = "RuntimeError: " + "x" * 5000 + " the end"
    out = fr.condense(text, limit=1000)
    assert out.startswith("RuntimeError: xxx") and out.endswith("x the end"), out
    assert len(out) == 1000 and "[... 4049 characters ...]" in out, out
    assert fr.condense(out, limit=1000) == out  # a record read back is not clipped again


def test_a_peers_echo_stays_one_however_it_is_shortened():
    middle = "RuntimeError: " + "y" * 3000 + " Connection reset by peer " + "z" * 3000
    out = fr.condense(middle, limit=1000)
    assert len(out) == 1000 and "[... 5099 characters with 'Connection reset by peer' ...]" in out, out
    assert fr.looks_like_echo(out) and fr.condense(out, limit=1000) == out
    inside = "RuntimeError: Caught in worker 0.\nTraceback (most recent call last):\n  File \"x\", line 1\n" \
             "    recvBytes(...)  # Connection reset by peer\nRuntimeError: gone"
    assert fr.looks_like_echo(fr.condense(inside))  # the traceback stays where only it says so


def test_a_record_read_back_is_condensed_once():
    rec = fr.FailureRecord(fr.ERROR, 1, fr.condense("E: " + "y" * 3000 + " tail"), 0, "h", 1, 1)
    back = fr.FailureRecord.from_json(rec.to_json())
    assert back.summary == rec.summary and back.summary.endswith(" tail") and len(back.summary) == fr.SUMMARY_MAX


def test_a_full_dev_shm_gets_a_hint_with_its_size():
    stat = lambda path: SimpleNamespace(f_blocks=16384, f_frsize=4096)  # noqa: E731 - 64 MiB
    hint = error_hint(fr.condense(WORKER_ERROR), statvfs=stat)
    assert hint.startswith("the shared memory DataLoader workers pass batches through is full (/dev/shm is 64 MiB): "
                           "give the container more (docker run --shm-size=8g or --ipc=host"), hint
    bus = "RuntimeError: DataLoader worker (pid 7) is killed by signal: Bus error. It is possible that dataloader's " \
          "workers are out of shared memory. Please try to raise your shared memory limit."
    assert "(/dev/shm is 64 MiB)" in error_hint(bus, statvfs=stat)


def test_an_unreadable_dev_shm_is_said_and_other_errors_get_no_hint():
    def missing(path):
        raise OSError(2, os.strerror(2))

    assert "(/dev/shm is unreadable: No such file or directory)" in error_hint(WORKER_ERROR, statvfs=missing)
    assert error_hint("ValueError: bad shape") == ""
