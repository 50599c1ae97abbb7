"""metrics.csv in the run directory (rank 0 only), and TensorBoard scalars when tensorboard is installed.

Columns: ``step, epoch, loss, val_*..., samples_per_s, step_time_s``. A training row (every
``log_every`` steps) leaves the val columns empty; a validation row (end of every epoch, and at the
end) leaves loss, samples_per_s and step_time_s empty. Rows are flushed as they are written, so a run
that dies keeps what it logged.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import warnings
from collections.abc import Mapping, Sequence

FILENAME = "metrics.csv"


def columns(val_names: Sequence[str]) -> list[str]:
    """The header for validation metrics named ``val_names`` (already ``val_``-prefixed)."""
    return ["step", "epoch", "loss", *val_names, "samples_per_s", "step_time_s"]


class MetricsLog:
    """Append rows to ``<run_dir>/metrics.csv``; a disabled log (ranks other than 0) does nothing."""

    def __init__(self, run_dir: str, val_names: Sequence[str], enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(run_dir, FILENAME)
        self.header = columns(val_names)
        self._file = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        mode = "w"
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, newline="") as f:
                existing = next(csv.reader(f), [])
            if existing == self.header:
                mode = "a"  # a second fit() in the same run dir continues the file
            else:
                # stacklevel: the user's ddprun.fit line (<- fit's _Loop <- fit_module <- ddprun.api.fit)
                warnings.warn(f"ddprun: {self.path} has other columns ({','.join(existing)}); starting it anew.",
                              stacklevel=5)
        self._file = open(self.path, mode, newline="", buffering=1)
        self._writer = csv.DictWriter(self._file, fieldnames=self.header, restval="")
        if mode == "w":
            self._writer.writeheader()
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

    def write(self, step: int, epoch: int, values: Mapping[str, float]) -> None:
        """One row at optimizer step ``step``; ``values`` keys are header columns."""
        if not self.enabled:
            return
        row: dict[str, object] = {"step": step, "epoch": epoch}
        row.update({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in values.items() if k in self.header})
        self._writer.writerow(row)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
