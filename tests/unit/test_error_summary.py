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


def test_a_long_text_keeps_its_start_and_its_end():
    text = "RuntimeError: " + "x" * 5000 + " the end"
    out = fr.condense(text, limit=1000)
    assert out.startswith("RuntimeError: xxx") and out.endswith("x the end"), out
    assert "[... 4022 characters ...]" in out and len(out) < 1100


def test_a_record_read_back_is_condensed_too():
    rec = fr.FailureRecord(fr.ERROR, 1, "E: " + "y" * 3000 + " tail", 0, "h", 1, 1)
    back = fr.FailureRecord.from_json(rec.to_json())
    assert back.summary.endswith(" tail") and len(back.summary) < fr.SUMMARY_MAX + 50


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
