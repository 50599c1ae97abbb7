"""The agent's console, which may go away while the job runs: a pipe whose reader ended
(``ddprun run ... | head``, a ``tee`` that was killed), or the terminal of an ssh session that dropped
(EIO). Python ignores SIGPIPE, so the next write raises; in the agent's log follower, or in the
middle of a failure report, that ends the agent and, with it, its workers: a job killed by its
console. A :class:`ConsoleStream` says the loss once, on file descriptor 2 (the agent's log while the
job runs, agent/run.py ``AgentLog``), and from then on writes there what it would have printed: the
job goes on to its end and its exit code, and nothing it says is lost while it runs.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from typing import TextIO


class ConsoleStream(io.TextIOBase):
    """``stream`` until a write or flush fails with OSError (EPIPE, EIO) or ValueError (closed);
    then file descriptor ``fallback_fd``, best effort. A character the console cannot encode is
    replaced, and a write a non-blocking console refused (EAGAIN) goes to the fallback: neither is a
    console gone. ``owns``: closing this closes ``stream`` (never the interpreter's own streams)."""

    def __init__(self, stream: TextIO, fallback_fd: int = 2, owns: bool = True):
        super().__init__()
        self._stream = stream
        self._fd = fallback_fd
        self._owns = owns
        self._lock = threading.Lock()
        self.gone: str | None = None
        """Why the console went away (``BrokenPipeError: [Errno 32] Broken pipe``); None while it is there."""

    def write(self, text: str) -> int:
        if self.gone is None:
            try:
                try:
                    return self._stream.write(text)
                except UnicodeEncodeError:  # a console whose encoding lacks a character (latin-1, ascii)
                    return self._stream.write(text.encode(self.encoding, "replace").decode(self.encoding))
            except BlockingIOError:
                pass  # a non-blocking console that is full now: this text goes to the fallback
            except (OSError, ValueError) as e:
                self._lose(e)
        self._spill(text)
        return len(text)

    def flush(self) -> None:
        if self.gone is None:
            try:
                self._stream.flush()
            except BlockingIOError:
                pass
            except (OSError, ValueError) as e:
                self._lose(e)

    def _lose(self, e: BaseException) -> None:
        with self._lock:
            if self.gone is not None:
                return
            self.gone = f"{type(e).__name__}: {e}"
        self._spill(f"ddprun: the console went away ({self.gone}): the job goes on, and this node's lines "
                    "go to its agent log from here\n")

    def _spill(self, text: str) -> None:
        try:
            os.write(self._fd, text.encode(errors="replace"))
        except OSError:  # the fallback is gone too (stderr was the same pipe, outside the job's run)
            pass

    # what rich and print ask of a text stream
    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        try:
            return self.gone is None and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self._stream.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self.closed:
            return
        super().close()  # flushes first, through flush() above
        try:
            if self._owns:
                self._stream.close()
        except (OSError, ValueError):  # its buffer could not be written: the console is gone
            pass


def guard_standard_streams() -> None:
    """sys.stdout and sys.stderr of this process (the agent) as :class:`ConsoleStream`: the I/O edge,
    called once by the CLI before a launch."""
    if not isinstance(sys.stdout, ConsoleStream):
        sys.stdout = ConsoleStream(sys.stdout, owns=False)
    if not isinstance(sys.stderr, ConsoleStream):
        sys.stderr = ConsoleStream(sys.stderr, owns=False)
