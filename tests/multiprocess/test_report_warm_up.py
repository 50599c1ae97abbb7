"""The run report's warm-up (agent/run.py, warm_run_report): the agent of rank 0's node imports
matplotlib while its workers run, only where the machine has a CPU they do not take; the report is
written at the end either way."""

import os

import pytest

from tests.faults.conftest import assert_nothing_left
from tests.helpers import DDPRUN, describe, free_port, run_agents

pytestmark = pytest.mark.multiprocess

WARM = "run report: importing matplotlib while the workers run"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ncpus, warm", [(2, True), (1, False)], ids=["a-spare-cpu", "no-spare-cpu"])
def test_rank_0s_agent_warms_the_report_up_only_with_a_cpu_its_workers_do_not_take(tmp_path, ncpus, warm):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ncpus:
        pytest.skip(f"this machine lets the tests use {len(cpus)} CPU(s), the case needs {ncpus}")
    script = tmp_path / "job.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'done', flush=True)\n")
    pin = ["taskset", "-c", ",".join(map(str, cpus[:ncpus]))]  # what the agent counts: its affinity
    cmd = [*pin, DDPRUN, "run", "--nproc-per-node", "1", "--master-port", str(free_port()), "--rdzv-id", "rw",
           str(script)]
    results = run_agents([cmd], timeout=45, cwd=tmp_path)
    assert results[0].returncode == 0, describe(results)
    assert_nothing_left(tmp_path)
    (agent_log,) = (tmp_path / "runs" / "rw" / "logs").glob("agent-*.log")
    assert (WARM in agent_log.read_text()) is warm, agent_log.read_text()
    assert "rank 0 done" in results[0].output
    assert "ddprun: report: runs/rw/report.html" in results[0].output, results[0].output
    assert (tmp_path / "runs" / "rw" / "report.html").stat().st_size > 0
