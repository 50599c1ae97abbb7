"""The demo's data ships with the package and is learned in one process too."""

import re

import pytest
import torch

from ddprun import demo_train, runtime


@pytest.fixture(autouse=True)
def one_process(monkeypatch, tmp_path):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DDPRUN_RUN_DIR", str(tmp_path / "run"))
    runtime._reset()
    yield
    runtime._reset()


def test_digits_load_and_split_deterministically():
    x, y = demo_train.load_digits()
    assert x.shape == (1797, 64) and y.shape == (1797,)
    assert 0.0 <= x.min() and x.max() <= 1.0 and set(y.tolist()) == set(range(10))
    train, val = demo_train.split(x, y)
    again, _ = demo_train.split(x, y)
    assert len(train) + len(val) == 1797 and len(val) == 359
    assert torch.equal(train.tensors[1], again.tensors[1])


def test_demo_learns_in_one_process(capsys):
    demo_train.main([])
    out = capsys.readouterr().out
    acc = float(re.search(r"^val_accuracy=(\d\.\d+)$", out, re.M).group(1))
    assert acc > 0.9, out
