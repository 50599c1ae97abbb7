"""Suite-wide: which tests may run beside another. scripts/test.sh runs two at a time (pytest-xdist,
``--dist loadgroup``): most multi-process tests wait on timers, and the machine's two cores sit half
idle while one runs. A tier that owns something machine-wide runs its tests one at a time, on one
worker: real hosts and the SLURM cluster (network namespaces, veth links, subnets), and the third
parties' launchers (a Ray cluster, mpirun, a browser)."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ALONE = {"hosts": "netns", "slurm": "netns", "integrations": "integrations"}
"""tier (a folder of tests/) -> the group whose tests run on one worker, one at a time."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if tier in ALONE:
            item.add_marker(pytest.mark.xdist_group(ALONE[tier]))
