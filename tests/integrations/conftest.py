"""Fixtures shared by the in-process integration tests."""

import os

import pytest

from ddprun import runtime
from tests.helpers import OUTER_JOB, OUTER_JOB_KEYS


@pytest.fixture
def clean_runtime(monkeypatch):
    """No outer job's variables (tests/helpers.py OUTER_JOB; the suite's own DDPRUN_TESTS_* stay), a CPU
    device, and ddprun's runtime state reset before and after."""
    outer = [k for k in os.environ if k.startswith(OUTER_JOB) and not k.startswith("DDPRUN_TESTS_")]
    for key in [*outer, *OUTER_JOB_KEYS]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DDPRUN_DEVICE_KIND", "cpu")
    runtime._reset()
    yield monkeypatch
    runtime._reset()
