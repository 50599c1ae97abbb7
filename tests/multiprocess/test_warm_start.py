"""Warm start (agent/standby.py): the first workers are interpreters started before the rendezvous,
and each is, from its first line on, the process a fresh worker would have been."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.conftest import assert_nothing_left
from tests.helpers import DDPRUN, ddprun_nodes, describe, free_port, job_env, run_agents

pytestmark = pytest.mark.multiprocess

PROBE = str(Path(__file__).parent / "scripts" / "warm_probe.py")


def _run(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[list[dict], str, str]:
    out = tmp_path / "out"
    out.mkdir()
    cmd = [DDPRUN, "run", "--nnodes", "1", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--rdzv-id", "warm", *(flags or ("--warm-start", "on")), PROBE, str(out)]
    results = run_agents([cmd], timeout=60, cwd=tmp_path, env=env)
    assert results[0].returncode == 0, describe(results)
    assert_nothing_left(tmp_path)
    logs = tmp_path / "runs" / "warm" / "logs"
    agent_log = next(logs.glob("agent-*.log")).read_text()
    facts = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    return facts, agent_log, results[0].output


@pytest.mark.timeout(90)
def test_the_first_workers_are_the_standbys_each_with_its_workers_command_line_and_environment(tmp_path):
    facts, agent_log, _ = _run(tmp_path)
    became = {int(rank): int(pid) for pid, rank in
              re.findall(r"standby worker pid (\d+) is the worker of rank (\d+)", agent_log)}
    assert became == {0: facts[0]["pid"], 1: facts[1]["pid"]}, agent_log
    for rank, f in enumerate(facts):
        # the command line torch's agent would have started; the standby's variable is gone
        assert f["cmdline"] == [sys.executable, "-m", "ddprun.worker", PROBE, str(tmp_path / "out")], f
        assert f["argv"] == [PROBE, str(tmp_path / "out")]
        assert f["env"]["RANK"] == str(rank) and f["env"]["LOCAL_RANK"] == str(rank)
        assert "DDPRUN_STANDBY_FD" not in f["env"]
        assert f["env"]["OMP_NUM_THREADS"] == "1" and f["cwd"] == str(tmp_path)
        log = (tmp_path / "runs" / "warm" / "logs" / f"rank-{rank}.log").read_text()
        assert f"probe stdout rank {rank}" in log and f"probe stderr rank {rank}" in log
    agent_pids = {f["ppid"] for f in facts}
    assert len(agent_pids) == 1  # children of the agent, as torch's own workers are
    # what a worker compares its parent with when it ties its life to its agent's
    assert {f["env"]["DDPRUN_AGENT_PID"] for f in facts} == {str(pid) for pid in agent_pids}


@pytest.mark.timeout(90)
def test_what_an_interpreter_printed_at_its_start_is_in_its_rank_log_once(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os, sys\nprint(f'site says hello from {os.getpid()}', "
                                           "file=sys.stderr, flush=True)\n")
    env = job_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    facts, _, _ = _run(tmp_path, env=env)
    for rank, f in enumerate(facts):
        log = (tmp_path / "runs" / "warm" / "logs" / f"rank-{rank}.log").read_text()
        assert log.count(f"site says hello from {f['pid']}") == 1, log
        assert log.index("site says hello") < log.index(f"probe stdout rank {rank}")


@pytest.mark.timeout(90)
def test_warm_start_off_starts_fresh_workers_after_the_rendezvous(tmp_path):
    facts, agent_log, _ = _run(tmp_path, "--warm-start", "off")
    assert "standby" not in agent_log
    for f in facts:
        assert f["cmdline"][:3] == [sys.executable, "-m", "ddprun.worker"]
        assert f["imported_first"]["torch._dynamo"] is False  # nothing imported it before the script
        assert f["env"]["DDPRUN_AGENT_PID"] == str(f["ppid"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nodes, nproc, ncpus, warm", [
    (1, 2, 2, True),  # a CPU for each of this node's processes: nothing more for the agent needed
    (1, 2, 1, False),
    (2, 1, 2, True),  # two nodes on loopback: both run here, 2 processes for 2 CPUs
    (2, 1, 1, False),  # ... for 1 CPU: the other node's process counts too
], ids=["1x2-2cpus", "1x2-1cpu", "2x1-loopback-2cpus", "2x1-loopback-1cpu"])
def test_auto_starts_standbys_where_the_machine_has_a_cpu_for_each_worker_process_it_runs(
        tmp_path, nodes, nproc, ncpus, warm):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ncpus:
        pytest.skip(f"this machine lets the tests use {len(cpus)} CPU(s), the case needs {ncpus}")
    out = tmp_path / "out"
    out.mkdir()
    pin = ["taskset", "-c", ",".join(map(str, cpus[:ncpus]))]  # what the agent counts: its affinity
    cmds = [pin + c for c in ddprun_nodes(nodes, nproc, [PROBE, str(out)], rdzv_id="auto",
                                          extra=["--warm-start", "auto"])]
    results = run_agents(cmds, timeout=75, cwd=tmp_path)
    assert [r.returncode for r in results] == [0] * nodes, describe(results)
    assert_nothing_left(tmp_path)
    logs = tmp_path / "runs" / "auto" / "logs"
    agent_logs = "\n".join(p.read_text() for p in logs.glob("agent-*.log"))
    became = {int(rank): int(pid) for pid, rank in
              re.findall(r"standby worker pid (\d+) is the worker of rank (\d+)", agent_logs)}
    facts = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nodes * nproc)]
    assert became == ({r: f["pid"] for r, f in enumerate(facts)} if warm else {}), agent_logs
    for rank, f in enumerate(facts):
        assert f["env"]["RANK"] == str(rank)
        assert f["cmdline"][:3] == [sys.executable, "-m", "ddprun.worker"]


PREIMPORT = """
import os, sys
from ddprun.worker.standby import preimport
r, w = os.pipe()
if sys.argv[1] == "go-there":
    os.write(w, b"{}")
preimport(r)
print(sorted(m for m in ("torch", "torch._dynamo") if m in sys.modules))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("go, imported", [("waiting", ["torch", "torch._dynamo"]), ("go-there", ["torch"])])
def test_a_standby_imports_what_ddp_imports_only_while_it_waits(go, imported):
    # while the rendezvous waits there is time for DDP's 2 s of imports; with the go message there
    # (an agent with nothing to wait for) they would only delay the user's first line
    proc = subprocess.run([sys.executable, "-c", PREIMPORT, go], env=job_env(), capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr(imported)


def _pool_env() -> dict[str, str]:
    return {**job_env(), "RANK": "0"}


@pytest.mark.timeout(60)
def test_a_standby_is_used_only_for_its_own_command_and_environment_and_closing_kills_the_rest(tmp_path,
                                                                                            monkeypatch):
    from ddprun.agent.standby import StandbyPool

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)  # the standbys' working directory: assert_nothing_left finds them by it
    args = (sys.executable, "-m", "ddprun.worker", PROBE, str(out))
    env = _pool_env()
    pool = StandbyPool().start(2, env, [PROBE, str(out)])
    log = str(tmp_path / "rank-0.log")
    try:
        assert pool.take((*args, "--more"), env, str(tmp_path), log, log) is None  # another command
        assert pool.take(args, {**env, "OMP_NUM_THREADS": "4"}, str(tmp_path), log, log) is None  # read at import
        proc = pool.take(args, {**env, "LOCAL_RANK": "0", "DDPRUN_RUN_ID": "x"}, str(tmp_path), log, log)
        assert proc is not None
        assert proc.wait(timeout=45) == 0
    finally:
        pool.close()
    facts = json.loads((out / "rank-0.json").read_text())
    assert facts["pid"] == proc.pid and facts["env"]["LOCAL_RANK"] == "0" and "DDPRUN_STANDBY_FD" not in facts["env"]
    assert "probe stdout rank 0" in Path(log).read_text()
    assert pool.take(args, env, str(tmp_path), log, log) is None  # closed: none left to take
    assert_nothing_left(tmp_path, within_s=1.0)  # the unused standby was killed and reaped
