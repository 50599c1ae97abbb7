"""Bad input is one message on the console: the flag or variable, the value seen, a HINT; exit code 2
for usage errors, and no traceback."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DDPRUN, free_port, job_env

pytestmark = pytest.mark.faults

SCRIPT = str(Path(__file__).parent / "scripts" / "job.py")


def ddprun(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([DDPRUN, *args], cwd=cwd, env=env or job_env(), capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, names", [
    (["--tee", "x:1"], ["--tee", "'x:1'"]),
    (["--redirects", "7"], ["--redirects", "'7'"]),
    (["--join-timeout", "inf"], ["--join-timeout", "inf"]),
    (["--stall-timeout", "nan"], ["--stall-timeout", "nan"]),
    (["--max-restarts", "-1"], ["--max-restarts", "-1"]),
    (["--master-port", "70000", "--master-addr", "127.0.0.1"], ["--master-port", "70000"]),
    (["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "0"], ["Port 0", "2 nodes"]),
    (["--nnodes", "2", "--master-addr", "nosuch.invalid", "--master-port", "29400"], ["'nosuch.invalid'",
                                                                                     "does not resolve"]),
    (["--join-timeout", "0.5"], ["--join-timeout", "0.5", "at least 1 second"]),
    (["--rdzv-conf", "join_timeout=5m"], ["join_timeout", "'join_timeout=5m'", "whole number"]),
    (["--log-dir", "/dev/null/runs"], ["--log-dir", "/dev/null/runs", "/dev/null is not a directory"]),
    (["--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=2"], ["keep_alive_max_attempt=5 or more"]),
    (["--standalone", "--nnodes", "2"], ["--standalone", "--nnodes 2", "contradicts"]),
], ids=["tee", "redirects", "join-inf", "stall-nan", "restarts", "port-range", "port-0-multinode", "no-such-host",
        "join-subsecond", "rdzv-conf-int", "log-dir-unmakeable", "keep-alive-too-short", "standalone-multinode"])
def test_a_bad_flag_is_one_message_with_its_value_and_a_hint(tmp_path, flags, names):
    r = ddprun("run", *flags, SCRIPT, "--pids", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr
    assert err.startswith("ddprun: error: ") and "HINT:" in err, err
    assert all(n in err for n in names), err
    assert "Traceback" not in err + r.stdout
    assert not (tmp_path / "runs").exists(), "a refused launch must not create a run"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("line, seen", [("localhost slot=2", "did you mean slots=2?"),
                                        ("localhost slots=two", "slots is not a positive number")])
def test_a_malformed_hostfile_line_is_named(tmp_path, line, seen):
    (tmp_path / "hosts").write_text(f"{line}\n")
    r = ddprun("run", "--hostfile", str(tmp_path / "hosts"), SCRIPT, "--pids", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and seen in r.stderr and f"hosts:1: {line!r}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def worker_env(**bad: str) -> dict:
    """A worker's environment as torch's agent gives it, with one bad DDPRUN_* value."""
    port = free_port()
    env = job_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                  TORCHELASTIC_RUN_ID="bad", DDPRUN_RUN_DIR="/nonexistent/run")
    env.update(bad)
    return env


@pytest.mark.timeout(60)
@pytest.mark.parametrize("var, value", [("DDPRUN_STALL_TIMEOUT", "abc"), ("DDPRUN_JOIN_TIMEOUT", "-5"),
                                        ("DDPRUN_NNODES", "2:1"), ("DDPRUN_DEVICE_KIND", "tpu"),
                                        ("DDPRUN_SOFT_EXIT", "yes")])
def test_a_malformed_ddprun_variable_is_named_not_reported_as_an_unreachable_store(tmp_path, var, value):
    r = subprocess.run([sys.executable, "-m", "ddprun.worker", SCRIPT, "--pids", str(tmp_path)], cwd=tmp_path,
                       env=worker_env(**{var: value}), capture_output=True, text=True, timeout=50)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert f"{var}={value!r}" in out and "HINT:" in out and "unreachable" not in out, out
    assert "Traceback" not in out
    assert not list(tmp_path.glob("rank-*.pid")), "user code ran despite the bad value"
    assert os.environ.get(var) is None  # the test's own environment untouched


@pytest.mark.timeout(120)
def test_a_script_that_fits_outside_its_main_guard_trains_without_loader_workers_and_says_why(nodes, tmp_path):
    """Each DataLoader worker (forkserver) imports the main script again: one whose top-level code
    runs fit would run it in every worker. Before: every worker ran the script's body and failed,
    and rank 0 ended with only `DataLoader worker (pid(s) N) exited unexpectedly` (8.5 s)."""
    script = str(Path(__file__).parent / "scripts" / "fit_unguarded.py")
    line = next(i for i, text in enumerate(Path(script).read_text().splitlines(), 1) if text.startswith("result ="))
    [ended] = nodes(1, 2, ["1"], script=script).finish(timeout=90)
    out = ended.output
    assert ended.returncode == 0, out
    assert re.search(r"ddprun: fit loads the data in the training process \(num_workers=0, not 1\): "
                     rf"\S+fit_unguarded\.py, line {line} runs at the top level of the script, outside "
                     r'`if __name__ == "__main__":`.*HINT: put the script\'s top-level code under', out), out
    assert out.count("ddprun: fit loads the data") == 1, out  # rank 0, once
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("runs/*/logs/rank-*.log")))
    bodies = set(re.findall(r"the script's body runs in pid (\d+)", out + logs))
    assert len(bodies) == 2, (bodies, out)  # the two ranks; no worker ran it
    assert re.search(r"rank 0: trained 4 steps", out), out
