"""System tools a tier needs (mpirun, ``ip netns``, SLURM, Chromium, a tmpfs mount): a test without
one is skipped with the reason, unless DDPRUN_TESTS_NEED_SYSTEM is set. .ci/run sets it, since it
installs every one of them, so there a missing or broken tool fails the test instead of hiding as
a skip."""

from __future__ import annotations

import os

import pytest


def unavailable(reason: str) -> None:
    """Skip the test (or fixture) for ``reason``, or fail it where the tools are required. Never returns."""
    if os.environ.get("DDPRUN_TESTS_NEED_SYSTEM"):
        pytest.fail(f"{reason} (DDPRUN_TESTS_NEED_SYSTEM is set: this machine should have it)", pytrace=False)
    pytest.skip(reason)
