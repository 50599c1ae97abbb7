"""The agent's console that goes away (agent/console_stream.py): the loss is said once on the
fallback descriptor, and every later line goes there; nothing raises. The real thing is
tests/faults/test_exits.py (a closed pipe under a training job)."""

from __future__ import annotations

import io
import os

from ddprun.agent.console_stream import ConsoleStream


class Broken(io.StringIO):
    def __init__(self, after: int):
        super().__init__()
        self.left = after

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1
        return super().write(text)

    def isatty(self) -> bool:
        return True


def test_after_the_first_failed_write_the_loss_is_said_once_and_every_line_goes_to_the_fallback():
    r, w = os.pipe()
    try:
        inner = Broken(after=1)
        out = ConsoleStream(inner, fallback_fd=w)
        assert out.isatty()
        print("first", file=out, flush=True)  # print writes the line, then its end: the end fails
        print("second", file=out, flush=True)
        out.flush()
        assert out.gone == "BrokenPipeError: [Errno 32] Broken pipe" and not out.isatty()
        os.close(w)
        w = -1
        spilled = os.read(r, 10000).decode()
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert inner.getvalue() == "first"
    note = ("ddprun: the console went away (BrokenPipeError: [Errno 32] Broken pipe): the job goes on, and this "
            "node's lines go to its agent log from here\n")
    assert spilled == note + "\n" + "second\n", spilled  # the end of the first line, then the second


def test_a_fallback_that_is_gone_too_drops_the_lines_without_raising():
    r, w = os.pipe()
    os.close(r)  # nobody reads the fallback either: stderr was the same pipe
    try:
        out = ConsoleStream(Broken(after=0), fallback_fd=w)
        print("lost", file=out, flush=True)
        out.close()
        assert out.gone is not None
    finally:
        os.close(w)


def test_closing_a_console_that_is_there_says_nothing():
    r, w = os.pipe()
    try:
        out = ConsoleStream(io.StringIO(), fallback_fd=w)
        print("line", file=out, flush=True)
        out.close()
        out.close()
        assert out.gone is None
        os.set_blocking(r, False)
        try:
            spilled = os.read(r, 100)
        except BlockingIOError:
            spilled = b""
        assert spilled == b""
    finally:
        os.close(r)
        os.close(w)


def test_a_character_the_console_cannot_encode_is_replaced_not_taken_for_a_console_gone():
    raw = io.BytesIO()
    latin = io.TextIOWrapper(raw, encoding="latin-1")
    out = ConsoleStream(latin, owns=False)
    print("loss ↓ 0.5 ✓", file=out, flush=True)
    assert out.gone is None and raw.getvalue() == b"loss ? 0.5 ?\n"


def test_a_wrapper_of_the_interpreters_stream_never_closes_it():
    inner = io.StringIO()
    out = ConsoleStream(inner, owns=False)
    out.close()
    del out
    assert not inner.closed
