"""Checkpoints under faults: a writer SIGKILLed mid-write, truncated and corrupted files, a full disk.
In each case the previous checkpoint stays loadable and fit resumes from it."""

import glob
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from torch import nn

import ddprun
from ddprun.errors import CheckpointError
from ddprun.train import checkpoint
from tests.system import unavailable
from tests.unit.restart_support import new_process, one_process, regression  # noqa: F401 (autouse fixture)


def mlp(width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))


def train(run_dir, epochs=1, width=16, **kw):
    """8 steps per epoch (64 samples, batch 8), SGD: checkpoints of about 1 KB + 4 bytes per parameter."""
    new_process()
    kw.setdefault("checkpoint_every", 4)
    return ddprun.fit(mlp(width), regression(), loss_fn=nn.functional.mse_loss, batch_size=8, epochs=epochs,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), run_dir=str(run_dir), log_every=100, **kw)


def params(res):
    return [p.detach().clone() for p in res.model.parameters()]


SLOW_WRITER = textwrap.dedent("""
    import sys, time, torch
    from ddprun.train import checkpoint
    write = checkpoint._HashingWriter.write
    def slow(self, data):  # a slow disk: the parent has time to kill this process mid-file
        time.sleep(0.01)
        return write(self, data)
    checkpoint._HashingWriter.write = slow
    state = {"step": 100, "model": {f"w{i}": torch.full((16384,), float(i)) for i in range(400)}}
    checkpoint.save(sys.argv[1], state)
""")


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint_and_the_run_resumes_from_it(tmp_path, capsys):
    train(tmp_path)  # checkpoints at steps 4 and 8
    ckdir = str(tmp_path / "checkpoints")
    child = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, ckdir])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            temps = glob.glob(os.path.join(ckdir, ".step-00000100.pt.*.tmp"))
            if temps and os.path.getsize(temps[0]) > 1 << 20:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the writer never got 1 MiB into its temp file")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    assert glob.glob(os.path.join(ckdir, ".step-00000100.pt.*.tmp"))  # what the killed writer left
    assert not os.path.exists(os.path.join(ckdir, "step-00000100.pt"))
    assert checkpoint.latest(ckdir).endswith("step-00000008.pt")
    assert checkpoint.load(ckdir)["step"] == 8

    res = train(tmp_path, epochs=2)
    assert "resuming from " + os.path.join(ckdir, "step-00000008.pt") in capsys.readouterr().out
    assert res.steps == 16 and not glob.glob(os.path.join(ckdir, ".*.tmp"))  # temp file cleaned at the start
    ref = train(tmp_path / "ref", epochs=2)
    assert all(torch.equal(a, b) for a, b in zip(params(ref), params(res)))


def test_a_truncated_newest_checkpoint_is_skipped_with_a_warning_and_the_previous_used(tmp_path, capsys):
    train(tmp_path)
    newest = tmp_path / "checkpoints" / "step-00000008.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with pytest.warns(UserWarning, match=r"step-00000008.pt is unusable: \d+ bytes on disk, \d+ were written "
                                         r"\(truncated\?\); using step-00000004.pt instead"):
        res = train(tmp_path, epochs=2)
    assert "resuming from " + str(tmp_path / "checkpoints" / "step-00000004.pt") in capsys.readouterr().out
    ref = train(tmp_path / "ref", epochs=2)
    assert res.steps == 16 and all(torch.equal(a, b) for a, b in zip(params(ref), params(res)))


def test_a_corrupted_checkpoint_of_unchanged_size_is_caught_by_its_checksum(tmp_path):
    train(tmp_path)
    ckdir = str(tmp_path / "checkpoints")
    path = os.path.join(ckdir, "step-00000008.pt")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside a tensor: torch would read it without a word
    open(path, "wb").write(bytes(data))
    assert checkpoint.verify(path) == "its SHA-256 differs from the one written (corrupted)"
    with pytest.warns(UserWarning, match="step-00000008.pt is unusable: its SHA-256 differs"):
        assert checkpoint.load(ckdir)["step"] == 4
    with pytest.raises(CheckpointError, match="damaged") as err:
        checkpoint.load(path)  # a file asked for by name is not replaced by another
    assert "HINT:" in str(err.value)


def test_without_any_usable_checkpoint_the_run_starts_anew_with_a_warning(tmp_path):
    train(tmp_path, checkpoint_every=None)  # the final checkpoint only
    path = tmp_path / "checkpoints" / "step-00000008.pt"
    path.write_bytes(b"not a zip")
    (tmp_path / "checkpoints" / "step-00000008.meta.json").unlink()  # no checksum: torch's reader decides
    with pytest.warns(UserWarning, match="torch.load failed.*no usable checkpoint left"):
        res = train(tmp_path, checkpoint_every=None)
    assert res.steps == 8


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root only; unmounted afterwards)."""
    if os.geteuid() != 0:
        unavailable("mounting a tmpfs needs root")
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_fails_the_save_clearly_and_keeps_the_previous_checkpoint(tmp_path, tiny_disk):
    ckdir = tiny_disk / "ck"
    # 10,000 hidden units: 400 KB per checkpoint; steps 2 and 4 fit in 1 MiB, step 6 does not
    with pytest.raises(CheckpointError) as err:
        train(tmp_path, width=10_000, checkpoint_every=2, keep_checkpoints=5, checkpoint_dir=str(ckdir))
    msg = str(err.value)
    assert msg.startswith("Saving the checkpoint of step 6 failed.")
    assert re.search(r"step-00000006.pt: No space left on device; [\d.]+ MiB free there", msg)
    assert "the previous checkpoint step-00000004.pt is intact" in msg and "HINT:" in msg
    assert sorted(os.listdir(ckdir)) == [".ddprun-writer.lock", "latest", "step-00000002.meta.json", "step-00000002.pt",
                                         "step-00000004.meta.json", "step-00000004.pt"]  # no temp file left
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the previous one verifies: no warning
        assert checkpoint.load(str(ckdir))["step"] == 4


def test_a_resave_of_a_step_whose_meta_write_fails_leaves_that_step_loadable(tmp_path, monkeypatch):
    # fit saves its last step twice when checkpoint_every divides the epoch (once its epoch counted):
    # a crash or a full disk between the new file's rename and its meta's must not leave the old meta
    # contradicting the new file (a whole checkpoint read as corrupted: a restart from step 0)
    state = {"step": 8, "epoch": 0, "model": {"w": torch.zeros(64)}}
    checkpoint.save(str(tmp_path), state, keep=1)
    write = checkpoint.write_atomic

    def full_for_meta(path, fn):
        if path.endswith(".meta.json"):
            raise OSError(28, "No space left on device")
        return write(path, fn)

    monkeypatch.setattr(checkpoint, "write_atomic", full_for_meta)
    with pytest.raises(CheckpointError) as err:
        checkpoint.save(str(tmp_path), {**state, "epoch": 1, "model": {"w": torch.ones(64)}}, keep=1)
    monkeypatch.undo()
    assert "the checkpoint of this step on disk (step-00000008.pt) is whole" in str(err.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it verifies: no "corrupted" warning
        found = checkpoint.newest_valid(str(tmp_path))
    assert found is not None and found[1]["epoch"] == 1 and torch.equal(found[1]["model"]["w"], torch.ones(64))


class _BytesExtraState(nn.Linear):
    """Older Transformer Engine modules keep their extra state as a BytesIO."""

    def get_extra_state(self):
        import io
        return io.BytesIO(b"fp8 meta")

    def set_extra_state(self, state):
        pass


def test_a_state_that_weights_only_load_refuses_fails_its_first_save_not_the_restart(tmp_path):
    checkpoint.save(str(tmp_path), {"step": 2, "model": nn.Linear(2, 2).state_dict()})
    with pytest.raises(CheckpointError) as err:
        checkpoint.save(str(tmp_path), {"step": 4, "model": _BytesExtraState(2, 2).state_dict()})
    msg = str(err.value)
    assert msg.startswith("The checkpoint of step 4 could not be loaded back, so it was not kept.")
    assert "step-00000004.pt holds _io.BytesIO, which torch.load(weights_only=True) refuses" in msg
    assert "add_safe_globals" in msg
    assert checkpoint.latest(str(tmp_path)).endswith("step-00000002.pt")
    assert not os.path.exists(tmp_path / "step-00000004.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpoint.newest_valid(str(tmp_path))[1]["step"] == 2


def test_the_start_removes_a_killed_writers_checkpoint_temp_files_and_no_other_writers(tmp_path):
    # checkpoint_dir may be the run dir, where the agent writes its own files the same atomic way
    left = [".step-00000012.pt.a1b2c3.tmp", ".step-00000012.meta.json.x9.tmp", ".latest.q7.tmp"]
    others = [".report.json.k2.tmp", ".plan.json.z1.tmp", "notes.tmp"]
    for name in left + others:
        (tmp_path / name).write_bytes(b"x")
    checkpoint.remove_temp_files(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(others)


def test_fit_checks_that_its_checkpoint_loads_back_at_its_first_save_only(tmp_path, monkeypatch):
    # the scan walks the pickle in Python: seconds at thousands of ranks (each rank's RNG state)
    scans = []
    scan = checkpoint._check_loadable
    monkeypatch.setattr(checkpoint, "_check_loadable", lambda path, step: scans.append(step) or scan(path, step))
    train(tmp_path, epochs=2, checkpoint_every=4)
    assert scans == [4]
