"""A node whose CPUs are limited by a cgroup quota, as a container's are (``docker run --cpus``, a
Kubernetes pod's ``resources.limits.cpu``): the process sees every core of the host but may use only
the limit's worth of time (cpus.py).

Before: in a container limited to 1 CPU on this 2-core machine, ``ddprun run --nproc-per-node cpu``
started 2 processes and gave a 1-process job OMP_NUM_THREADS=2; under a 1-CPU quota a 2-thread
step's 90th percentile was 57 ms against 10 ms with one thread (a 512-1024-512 MLP, batch 128:
the two threads are throttled for the rest of each 100 ms period once they have used its 100 ms).
A 96-core host with a 4-CPU pod would have started 96.

The container is made for real: a cgroup with a CPU quota, the agent moved into it, and a cgroup and
mount namespace in which that cgroup is mounted where the controller's root was, as Docker does.
Needs root and a writable cgroup ``cpu`` controller (v1 or v2).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.conftest import describe
from tests.helpers import DDPRUN, job_env
from tests.system import unavailable

pytestmark = pytest.mark.faults
PERIOD_US = 100_000


def _controller() -> tuple[Path, bool]:
    """(the cpu controller's root, whether it is cgroup v2), or the test cannot run here."""
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        unavailable("a CPU-limited container needs root and `unshare` (util-linux)")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, False
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        with contextlib.suppress(OSError):
            (v2 / "cgroup.subtree_control").write_text("+cpu")
        return v2, True
    unavailable("no cgroup cpu controller is mounted at /sys/fs/cgroup(/cpu)")
    raise AssertionError("unreachable")


@contextlib.contextmanager
def container(cpus: float) -> Iterator[list[str]]:
    """A command prefix that execs its command in a new container limited to ``cpus`` CPUs."""
    root, v2 = _controller()
    group = root / f"ddprun-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group.mkdir()
        quota = str(int(cpus * PERIOD_US))
        if v2:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(quota)
    except OSError as e:
        unavailable(f"cannot make a CPU-limited cgroup under {root}: {e}")
    # the process joins the cgroup before its cgroup namespace is made, so that cgroup is its "/"
    inner = f'mount --bind {group} {root} && exec "$@"'
    try:
        yield ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec unshare --cgroup --mount sh -c \'{inner}\' inner "$@"',
               "outer"]
    except BaseException:
        _remove(group, kill=True)  # a test that failed midway: what it started goes with it
        raise
    _remove(group, kill=False)


def _remove(group: Path, kill: bool) -> None:
    """Remove the test's cgroup once its processes have ended (at most 10 s); one still there is a
    process the job left behind (killed only with ``kill``, after a failure)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            group.rmdir()
            return
        except OSError:  # its last processes are still exiting
            for pid in (group / "cgroup.procs").read_text().split() if kill else ():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.1)
    left = (group / "cgroup.procs").read_text().split()
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(int(pid), signal.SIGKILL)
    time.sleep(0.5)
    with contextlib.suppress(OSError):
        group.rmdir()
    raise AssertionError(f"processes left behind in {group}: {left}")


def _cores() -> int:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        unavailable(f"telling a 1-CPU limit from this machine's cores needs 2 or more ({cores} here)")
    return cores


@pytest.mark.timeout(90)
def test_nproc_cpu_in_a_one_cpu_container_starts_one_process_with_one_thread(nodes, tmp_path):
    cores = _cores()
    with container(1.0) as prefix:
        plan = subprocess.run([*prefix, DDPRUN, "plan", "--nproc-per-node", "cpu", "--explain"], env=job_env(),
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
        env = {k: v for k, v in job_env().items() if k != "OMP_NUM_THREADS"}  # ddprun's choice, not the tests'
        [ended] = nodes(1, "cpu", ["--step-s", "0", "--steps", "3"], prefix=prefix, env=env).finish(timeout=60)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert (f"nproc_per_node: 1  <- --nproc-per-node cpu (1 CPU: the cgroup's CPU limit (1 CPU; {cores} cores "
            "visible))") in plan.stdout, plan.stdout
    assert ended.returncode == 0, describe([ended])
    assert "1 node(s) x 1 process(es)" in ended.output, ended.output
    pids = tmp_path / "pids"
    assert sorted(p.name for p in pids.glob("rank-*.pid")) == ["rank-0.pid"], ended.output
    seen = json.loads((pids / "rank-0.env.json").read_text())
    assert seen.get("OMP_NUM_THREADS") == "1", seen.get("OMP_NUM_THREADS")
    assert "rank 0: done after 3 steps" in ended.output, ended.output


@pytest.mark.timeout(90)
def test_a_limit_above_the_cores_changes_nothing(tmp_path):
    cores = _cores()
    with container(cores + 2.0) as prefix:
        plan = subprocess.run([*prefix, DDPRUN, "plan", "--nproc-per-node", "cpu", "--explain"], env=job_env(),
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert f"nproc_per_node: {cores}  <- --nproc-per-node cpu ({cores} CPUs)\n" in plan.stdout, plan.stdout
