"""What rank 0 shows while training: one rich progress bar on a terminal, plain lines elsewhere.

On a TTY the bar advances every step and shows step, loss and samples/s (updated every
``log_every`` steps, when the loss is read). When stdout is not a TTY (a rank log file under
``ddprun run``, a CI log) a bar would write escape codes, so one plain line is printed every
``log_every`` steps instead: ``step 50/200  epoch 0  loss 0.4321  samples/s 5120.3``.
Other ranks show nothing.
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, total_steps: int | None, enabled: bool, stream: TextIO | None = None):
        self.total = total_steps
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._bar = None
        self._task = None
        if enabled and _isatty(self.stream):
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn(), TextColumn("{task.fields[stats]}"),
                console=Console(file=self.stream), transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, stats="")
            self._bar.start()

    def advance(self, step: int) -> None:
        """Called every optimizer step; cheap (a no-op without a bar)."""
        if self._bar is not None and self._task is not None:  # set together
            self._bar.update(self._task, completed=step)

    def log(self, step: int, epoch: int, loss: float, samples_per_s: float) -> None:
        """Called every ``log_every`` steps with the values just read."""
        if not self.enabled:
            return
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=step, stats=f"loss {loss:.4f}  {samples_per_s:,.0f} samples/s")
            return
        total = f"/{self.total}" if self.total else ""
        print(f"step {step}{total}  epoch {epoch}  loss {loss:.4f}  samples/s {samples_per_s:.1f}",
              file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line outside the bar (validation results, the final summary)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
