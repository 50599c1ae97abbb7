"""metrics.csv (rank 0 only, continued by a second fit with the same columns) and the TensorBoard
scalars written beside it when tensorboard is installed (a recording SummaryWriter stands in here)."""

import csv
import importlib.util
import sys
import types

from ddprun.train import metrics


def test_rank_0_writes_rows_other_ranks_nothing_and_a_second_fit_continues_the_file(tmp_path):
    log = metrics.MetricsLog(str(tmp_path), ["val_loss"])
    log.write(5, 0, {"loss": 0.5, "samples_per_s": 100.0, "step_time_s": 0.01})
    log.close()
    metrics.MetricsLog(str(tmp_path / "other"), ["val_loss"], enabled=False).write(5, 0, {"loss": 1.0})
    assert not (tmp_path / "other").exists()
    again = metrics.MetricsLog(str(tmp_path), ["val_loss"])
    again.write(10, 1, {"val_loss": 0.25})
    again.close()
    with open(tmp_path / metrics.FILENAME, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"step": "5", "epoch": "0", "loss": "0.5", "val_loss": "", "samples_per_s": "100",
                     "step_time_s": "0.01"},
                    {"step": "10", "epoch": "1", "loss": "", "val_loss": "0.25", "samples_per_s": "",
                     "step_time_s": ""}]


def test_with_tensorboard_installed_every_value_is_also_a_scalar_under_run_dir_tensorboard(tmp_path, monkeypatch):
    written = []

    class Recording:
        def __init__(self, log_dir):
            written.append(("open", log_dir))

        def add_scalar(self, name, value, step):
            written.append((name, value, step))

        def close(self):
            written.append(("close",))

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "tensorboard" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Recording))
    log = metrics.MetricsLog(str(tmp_path), ["val_acc"])
    log.write(3, 0, {"loss": 0.5, "samples_per_s": 10.0})
    log.close()
    assert written == [("open", str(tmp_path / "tensorboard")), ("loss", 0.5, 3), ("samples_per_s", 10.0, 3),
                       ("close",)]
