"""What a failed rank's record says (protocol/failure.py ``condense``, worker/exit.py ``error_text``
and ``error_hint``): the error that ended it in a line, not a traceback torch put inside the message,
and a HINT where the node, not the code, is the cause. The real things are in
tests/faults/test_containers.py (a full /dev/shm, a DataLoader worker the OOM killer ends)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from ddprun.protocol import failure as fr
from ddprun.worker.exit import error_hint, error_text

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


def chain(files: list[str], error: BaseException, i: int = 0) -> None:
    """Raise ``error`` from a traceback with a frame in each of ``files`` (outermost first)."""
    code = compile("call(files, error, i + 1) if i + 1 < len(files) else throw()\n", files[i], "exec")
    exec(code, {"call": chain, "files": files, "error": error, "i": i, "throw": lambda: _raise(error)})  # noqa: S102


def _raise(error: BaseException) -> None:
    raise error


HANDOVER = ["/venv/site-packages/torch/utils/data/dataloader.py", "/usr/lib/python3.11/multiprocessing/queues.py",
            "/venv/site-packages/torch/multiprocessing/reductions.py",
            "/usr/lib/python3.11/multiprocessing/connection.py"]


def test_a_loader_worker_gone_in_the_middle_of_a_hand_over_is_said_for_what_it_is_and_no_peers_echo():
    e = chain_error(HANDOVER, ConnectionResetError(104, "Connection reset by peer"))
    text = error_text(e)
    assert text == ("its DataLoader worker ended while handing it a batch (ConnectionResetError: [Errno 104] "
                    "Connection reset by peer)"), text
    assert not fr.looks_like_echo(text) and not fr.FailureRecord(fr.ERROR, 1, text).is_echo
    # the same error outside a batch's hand-over: the user's own connection, said as it is
    for files in (HANDOVER[1:], HANDOVER[:2] + HANDOVER[3:]):
        assert error_text(chain_error(files, ConnectionResetError(104, "Connection reset by peer"))) == \
            "ConnectionResetError: [Errno 104] Connection reset by peer"
    assert error_text(chain_error(HANDOVER, ValueError("bad pickle"))) == "ValueError: bad pickle"


def chain_error(files: list[str], error: BaseException) -> BaseException:
    try:
        chain(files, error)
    except BaseException as e:  # noqa: BLE001
        return e
    raise AssertionError("not raised")


def test_an_error_of_a_ranks_own_loader_worker_is_never_a_peers_echo():
    refused = ("RuntimeError: Caught ConnectionRefusedError in DataLoader worker process 0: ConnectionRefusedError: "
               "[Errno 111] Connection refused")  # the worker's own data server
    assert not fr.looks_like_echo(refused) and not fr.FailureRecord(fr.ERROR, 0, refused).is_echo
    assert fr.looks_like_echo("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer")


LOADER_ENDS = ["RuntimeError: DataLoader worker (pid(s) 4321) exited unexpectedly",
               "RuntimeError: DataLoader worker (pid 4321) is killed by signal: Killed. ",
               "its DataLoader worker ended while handing it a batch (EOFError: )",
               "RuntimeError: Pin memory thread exited unexpectedly"]  # pin_memory=True: its thread took the reset


def test_a_loader_worker_that_ended_without_an_error_gets_the_oom_kill_as_evidence_where_the_cgroup_counted_one():
    for text in LOADER_ENDS:
        assert error_hint(text, oom_kills=(2, 3)).startswith(
            "the out-of-memory killer ended a DataLoader worker of this rank (the cgroup's oom_kill count went 2 -> 3 "
            "while the rank ran): each worker holds its own copy of the dataset"), text
        for counts in [(3, 3), (None, None), (None, 3)]:  # no kill while it ran, or no counter to read
            assert error_hint(text, oom_kills=counts).startswith(
                "a DataLoader worker of this rank ended without a Python error: the out-of-memory killer? "), text


def test_a_loader_worker_that_exited_with_a_code_or_a_python_error_gets_no_oom_hint():
    assert error_hint("RuntimeError: DataLoader worker (pid 7) exited unexpectedly with exit code 1. Details are lost "
                      "due to multiprocessing.", oom_kills=(0, 1)) == ""
    assert error_hint("RuntimeError: Caught ValueError in DataLoader worker process 0: ValueError: x",
                      oom_kills=(0, 1)) == ""
