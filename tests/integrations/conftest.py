"""Fixtures shared by the in-process integration tests."""

import pytest

from ddprun import runtime


@pytest.fixture
def clean_runtime(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "DDPRUN_RUN_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DDPRUN_DEVICE_KIND", "cpu")
    runtime._reset()
    yield monkeypatch
    runtime._reset()
