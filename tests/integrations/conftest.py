"""Fixtures shared by the in-process integration tests."""

import os

import pytest

from ddprun import runtime

OUTER_JOB = ("DDPRUN_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "LSB_", "SM_", "SKYPILOT_", "PET_")
"""Variables of a job the suite itself may run in (an ``salloc``, an mpirun, a SageMaker or Kubernetes
job): ddprun's detection reads them (cluster/), so an in-process test would take that job's ranks.
The suite's own switches (DDPRUN_TESTS_*) stay."""


@pytest.fixture
def clean_runtime(monkeypatch):
    outer = [k for k in os.environ if k.startswith(OUTER_JOB) and not k.startswith("DDPRUN_TESTS_")]
    for key in [*outer, "KUBERNETES_SERVICE_HOST",
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DDPRUN_DEVICE_KIND", "cpu")
    runtime._reset()
    yield monkeypatch
    runtime._reset()
