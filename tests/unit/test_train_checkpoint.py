"""Checkpoints are written atomically, found through `latest`, and read with weights_only=True."""

import io
import os
import random

import numpy as np
import pytest
import torch

from ddprun.errors import ConfigError
from ddprun.train import checkpoint
from ddprun.train.metrics import MetricsLog, columns
from ddprun.train.progress import Progress


def test_save_then_load_latest(tmp_path):
    p1 = checkpoint.save(str(tmp_path), {"step": 10, "model": {"w": torch.ones(2)}})
    p2 = checkpoint.save(str(tmp_path), {"step": 20, "model": {"w": torch.zeros(2)}})
    assert (tmp_path / "latest").read_text().strip() == "step-00000020.pt"
    assert checkpoint.latest(str(tmp_path)) == p2 and os.path.exists(p1)
    state = checkpoint.load(str(tmp_path))
    assert state["step"] == 20 and torch.equal(state["model"]["w"], torch.zeros(2))
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000010.meta.json", "step-00000010.pt",
                                            "step-00000020.meta.json", "step-00000020.pt"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "f"
    checkpoint.write_atomic(str(target), lambda f: f.write(b"old"))

    def broken(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        checkpoint.write_atomic(str(target), broken)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_rng_states_survive_a_weights_only_load(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    checkpoint.save(str(tmp_path), {"step": 1, "rng": checkpoint.rng_state()})
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    checkpoint.restore_rng(checkpoint.load(str(tmp_path))["rng"])
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_missing_and_newer_checkpoints_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        checkpoint.load(str(tmp_path))
    torch.save({"format_version": checkpoint.FORMAT_VERSION + 1, "step": 1}, tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="HINT"):
        checkpoint.load(str(tmp_path / "x.pt"))


def test_metrics_csv_header_and_disabled_ranks(tmp_path):
    assert columns(["val_loss"]) == ["step", "epoch", "loss", "val_loss", "samples_per_s", "step_time_s"]
    log = MetricsLog(str(tmp_path / "off"), ["val_loss"], enabled=False)
    log.write(1, 0, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "off").exists()


def test_progress_without_a_terminal_prints_plain_lines():
    out = io.StringIO()
    p = Progress(100, enabled=True, stream=out)
    p.advance(1)
    p.log(50, 0, 0.25, 1234.5)
    p.close()
    assert out.getvalue() == "step 50/100  epoch 0  loss 0.2500  samples/s 1234.5\n"
    quiet = io.StringIO()
    Progress(100, enabled=False, stream=quiet).log(50, 0, 0.25, 1.0)
    assert quiet.getvalue() == ""


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_is_one_rich_bar_with_the_step_loss_and_rate_and_messages_above_it():
    out = Terminal()
    p = Progress(100, enabled=True, stream=out)
    p.advance(10)
    p.log(50, 0, 0.25, 1234.5)
    p.message("validation at step 50 (epoch 0): val_loss 0.3000")
    p.close()
    text = out.getvalue()
    assert "\x1b[" in text  # a bar drawn with escape codes, not plain lines
    assert "train" in text and "50/100" in text and "loss 0.2500" in text and "1,234 samples/s" in text, text
    assert "validation at step 50 (epoch 0): val_loss 0.3000" in text
    assert "step 50/100  epoch 0" not in text  # no plain line beside the bar
    quiet = Terminal()
    Progress(100, enabled=False, stream=quiet).log(50, 0, 0.25, 1.0)  # another rank: nothing, not even a bar
    assert quiet.getvalue() == ""


def test_a_rank_saves_and_restores_its_own_cuda_device_state_whatever_the_nodes_gpu_count(monkeypatch):
    """Resumed on nodes with fewer GPUs (2 x 8 -> 4 x 4), a rank's device index changes: the checkpoint
    holds the state of the device it computed on and restores it to the one it computes on now; an
    older checkpoint with every device's state restores those this node has (set_rng_state_all raised
    IndexError for the others)."""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append((int(state[0]), device)))
    state = checkpoint.rng_state()
    assert int(state["cuda_device"][0]) == 7 and "cuda" not in state
    checkpoint.restore_rng(state)
    assert calls == [(7, "cuda")]  # the current device, as ddprun.init set it
    calls.clear()
    old = {k: v for k, v in state.items() if k != "cuda_device"}
    old["cuda"] = [torch.tensor([i], dtype=torch.uint8) for i in range(8)]  # written on a node of 8
    checkpoint.restore_rng(old)
    assert calls == [(0, 0), (1, 1)]


def test_an_old_checkpoint_the_file_system_will_not_delete_stays_with_one_warning_and_the_save_succeeds(
        tmp_path, monkeypatch):
    # pruning caught FileNotFoundError only: EACCES/EIO on an old file escaped a good save as a raw
    # OSError and killed the job
    import errno
    import warnings

    stuck = str(tmp_path / "step-00000001.pt")
    unlink = os.unlink

    def refusing(path, *a, **kw):
        if os.fspath(path) == stuck:
            raise OSError(errno.EIO, "Input/output error", path)
        return unlink(path, *a, **kw)

    checkpoint.save(str(tmp_path), {"step": 1})
    monkeypatch.setattr(os, "unlink", refusing)
    with pytest.warns(UserWarning) as said:
        p2 = checkpoint.save(str(tmp_path), {"step": 2}, keep=1)
    assert [str(w.message) for w in said] == [
        f"ddprun: the old checkpoint {stuck} could not be deleted (Input/output error); it stays, and training "
        "goes on. Delete it yourself to keep 1 checkpoint(s)."]
    assert os.path.exists(stuck) and os.path.exists(checkpoint.meta_path(stuck))  # the file with its meta
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not at every save
        p3 = checkpoint.save(str(tmp_path), {"step": 3}, keep=1)
    assert not os.path.exists(p2) and checkpoint.latest(str(tmp_path)) == p3
    monkeypatch.setattr(os, "unlink", unlink)
    assert checkpoint.prune(str(tmp_path), 1) == [stuck]  # deleted once the file system lets it
