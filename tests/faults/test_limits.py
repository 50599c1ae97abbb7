"""A node's open-files limit (openfiles.py): an agent started with a soft limit too low for its
stores raises it within the hard limit, and its workers inherit it; a hard limit below what hosting
the job's stores needs is said first, on the console, with the values and a HINT.

Before: ``ddprun run --nproc-per-node 2`` under a soft limit of 40 ended with "the launcher failed:
OSError: [Errno 24] Too many open files" (36: the agent's own store client retried for torch's 300 s).
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ddprun.openfiles import FLOOR, needed
from tests.faults.conftest import JOB, assert_nothing_left
from tests.helpers import DDPRUN, job_env
from tests.system import unavailable

pytestmark = pytest.mark.faults


def _limited(nofile: str, tmp_path: Path, *job: str) -> subprocess.Popen:
    """``ddprun run`` 1 node x 2 of scripts/job.py under ``prlimit --nofile=SOFT:HARD``."""
    if shutil.which("prlimit") is None:
        unavailable("`prlimit` (util-linux) is not installed")
    cmd = ["prlimit", f"--nofile={nofile}", DDPRUN, "run", "--nproc-per-node", "2", JOB, "--pids", str(tmp_path),
           "--step-s", "0", *job]
    return subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _soft_limit(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    return int(line.split()[3])


def _pids(tmp_path: Path, ranks: int, agent: subprocess.Popen, within_s: float = 60) -> list[int]:
    """Every rank's pid once it made a step; [] when the agent ended first or ``within_s`` passed."""
    deadline = time.monotonic() + within_s
    files = [tmp_path / f"rank-{r}.pid" for r in range(ranks)]
    while not all(f.exists() and f.read_text().strip() for f in files):
        if agent.poll() is not None or time.monotonic() > deadline:
            return []
        time.sleep(0.1)
    return [int(f.read_text()) for f in files]


@pytest.mark.timeout(90)
def test_an_agent_under_a_low_soft_limit_raises_it_and_its_workers_inherit_it(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed(2, 1, 2):
        unavailable(f"this machine's hard open-files limit ({hard}) is below what a 1 x 2 job needs")
    until = tmp_path / "seen"
    p = _limited(f"40:{hard}", tmp_path, "--steps", "3", "--until", str(until))
    try:
        limits = [_soft_limit(pid) for pid in _pids(tmp_path, 2, p)]
    finally:
        until.touch()
        out, _ = p.communicate(timeout=60)
    want = FLOOR if hard == resource.RLIM_INFINITY else min(hard, FLOOR)
    assert p.returncode == 0, out
    assert limits == [want, want], (limits, out)
    assert "warning" not in out and "Too many open files" not in out, out
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(90)
def test_a_hard_limit_below_the_jobs_need_is_one_warning_first_and_the_job_still_runs(tmp_path):
    p = _limited("200:200", tmp_path, "--steps", "3")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    warnings = [line for line in out.splitlines() if line.startswith("ddprun: warning:")]
    assert len(warnings) == 1, out
    assert re.search(rf"this job \(2 ranks on 1 node\(s\)\) needs about {needed(2, 1, 2)} open files .* "
                     r"this node's limit is 200 \(ulimit -n; hard limit 200\).*HINT: raise the hard limit", warnings[0])
    assert out.index("ddprun: warning:") < out.index("ddprun: run "), "said before the run starts"
    assert_nothing_left(tmp_path)
