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
from pathlib import Path

import pytest

from ddprun.openfiles import FLOOR, needed
from tests.faults.conftest import describe
from tests.system import unavailable

pytestmark = pytest.mark.faults


def _prlimit(nofile: str) -> list[str]:
    """The prefix that starts the agent under ``--nofile=SOFT:HARD``."""
    if shutil.which("prlimit") is None:
        unavailable("`prlimit` (util-linux) is not installed")
    return ["prlimit", f"--nofile={nofile}"]


def _soft_limit(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    return int(line.split()[3])


@pytest.mark.timeout(90)
def test_an_agent_under_a_low_soft_limit_raises_it_and_its_workers_inherit_it(nodes, tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed(2, 1, 2):
        unavailable(f"this machine's hard open-files limit ({hard}) is below what a 1 x 2 job needs")
    until = tmp_path / "seen"
    job = nodes(1, 2, ["--step-s", "0", "--steps", "3", "--until", str(until)], prefix=_prlimit(f"40:{hard}"))
    try:
        limits = [_soft_limit(pid) for pid in job.worker_pids(range(2)).values()]
    finally:
        until.touch()
    [ended] = job.finish(timeout=60)
    want = FLOOR if hard == resource.RLIM_INFINITY else min(hard, FLOOR)
    assert ended.returncode == 0, describe([ended])
    assert limits == [want, want], (limits, ended.output)
    assert "warning" not in ended.output and "Too many open files" not in ended.output, ended.output


@pytest.mark.timeout(90)
def test_a_hard_limit_below_the_jobs_need_is_one_warning_first_and_the_job_still_runs(nodes):
    [ended] = nodes(1, 2, ["--step-s", "0", "--steps", "3"], prefix=_prlimit("200:200")).finish(timeout=60)
    out = ended.output
    assert ended.returncode == 0, out
    warnings = [line for line in out.splitlines() if line.startswith("ddprun: warning:")]
    assert len(warnings) == 1, out
    assert re.search(rf"this job \(2 ranks on 1 node\(s\)\) needs about {needed(2, 1, 2)} open files .* "
                     r"this node's limit is 200 \(ulimit -n; hard limit 200\).*HINT: raise the hard limit", warnings[0])
    assert out.index("ddprun: warning:") < out.index("ddprun: run "), "said before the run starts"
