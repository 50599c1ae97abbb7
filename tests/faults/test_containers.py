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
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddprun import cgroups
from tests.faults.conftest import describe
from tests.helpers import DDPRUN, job_env
from tests.system import unavailable

pytestmark = pytest.mark.faults
PERIOD_US = 100_000


def _hierarchy(controller: str) -> tuple[Path, Path, bool]:
    """(the mount point of the hierarchy with ``controller``, this process's cgroup there, whether it
    is cgroup v2), or the test cannot run here."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        unavailable("a container needs root and `unshare` (util-linux)")
    for place in cgroups.mine(controller):
        mount, own = Path(place.mount), Path(place.dir)
        if not own.is_dir():
            continue
        if not place.v2:
            return mount, own, False
        if controller in (own / "cgroup.controllers").read_text(errors="replace").split():
            with contextlib.suppress(OSError):  # children get the controller's files only where it is on
                (own / "cgroup.subtree_control").write_text(f"+{controller}")
            return mount, own, True
    unavailable(f"no cgroup {controller} controller is mounted for this process")
    raise AssertionError("unreachable")


@contextlib.contextmanager
def container(controller: str, v1: dict[str, str], v2: dict[str, str], cgroupns: bool = True) -> Iterator[list[str]]:
    """A command prefix that execs its command in a new container: a cgroup made under this
    process's own with ``controller``'s files set (``v1`` or ``v2``: the first is the limit; a later
    one the kernel does not have, as swap accounting may not be, is left out), mounted where the
    hierarchy was in a mount namespace of its own, and (``cgroupns``) a cgroup namespace in which it
    is ``/``; without one its processes see its host path, as in a Docker container on cgroup v1."""
    mount, own, is_v2 = _hierarchy(controller)
    group = own / f"ddprun-test-{os.getpid()}-{time.monotonic_ns()}"
    files = v2 if is_v2 else v1
    try:
        group.mkdir()
        for i, (name, value) in enumerate(files.items()):
            if i == 0 or (group / name).exists():
                (group / name).write_text(value)
    except OSError as e:
        with contextlib.suppress(OSError):
            group.rmdir()
        unavailable(f"cannot make a {controller} cgroup under {own} (on cgroup v2 a cgroup with processes "
                    f"cannot give its children a controller): {e}")
    # the process joins the cgroup before its cgroup namespace is made, so that cgroup is its "/"
    inner = f'mount --bind {group} {mount} && exec "$@"'
    unshare = "unshare --cgroup --mount" if cgroupns else "unshare --mount"
    try:
        yield ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec {unshare} sh -c \'{inner}\' inner "$@"', "outer"]
    except BaseException:
        _remove(group, kill=True)  # a test that failed midway: what it started goes with it
        raise
    _remove(group, kill=False)


def cpu_limited(cpus: float, cgroupns: bool = True) -> contextlib.AbstractContextManager[list[str]]:
    """A container limited to ``cpus`` CPUs (``docker run --cpus``)."""
    quota = str(int(cpus * PERIOD_US))
    return container("cpu", {"cpu.cfs_quota_us": quota, "cpu.cfs_period_us": str(PERIOD_US)},
                     {"cpu.max": f"{quota} {PERIOD_US}"}, cgroupns)


def memory_limited(limit: int) -> contextlib.AbstractContextManager[list[str]]:
    """A container limited to ``limit`` bytes of memory and no swap (``docker run --memory``)."""
    return container("memory", {"memory.limit_in_bytes": str(limit), "memory.memsw.limit_in_bytes": str(limit)},
                     {"memory.max": str(limit), "memory.swap.max": "0"})


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
@pytest.mark.parametrize("cgroupns", [True, False], ids=["cgroup-namespace", "host-path"])
def test_nproc_cpu_in_a_one_cpu_container_starts_one_process_with_one_thread(nodes, tmp_path, cgroupns):
    cores = _cores()
    with cpu_limited(1.0, cgroupns) as prefix:
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
    with cpu_limited(cores + 2.0) as prefix:
        plan = subprocess.run([*prefix, DDPRUN, "plan", "--nproc-per-node", "cpu", "--explain"], env=job_env(),
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert f"nproc_per_node: {cores}  <- --nproc-per-node cpu ({cores} CPUs)\n" in plan.stdout, plan.stdout


@pytest.mark.timeout(90)
def test_a_worker_the_containers_oom_killer_ends_is_named_with_the_evidence(nodes):
    """Rank 1 of a 1 x 2 job grows by 64 MiB at a time in a container limited to 1.5 GB (the other
    processes hold ~0.9 GB): the kernel's OOM killer ends it. Before (cgroup v1): only the guess
    `the out-of-memory killer? see dmesg ...`, while the cgroup counted the kill."""
    with memory_limited(1_500_000_000) as prefix:
        [ended] = nodes(1, 2, ["--step-s", "0.02", "--steps", "400", "--hog-rank", "1"],
                        prefix=prefix).finish(timeout=60)
    out = ended.output
    assert ended.returncode == 1, describe([ended])
    assert re.search(r"ddprun: the job failed: rank 1 \(node 0, \S+\) was killed by SIGKILL\n"
                     r"HINT: the out-of-memory killer ended it \(the cgroup's oom_kill count went 0 -> [1-9]\d*\)", out), out
    assert re.search(r"rank\(s\) 0 on \S+ were stopped because of it", out), out


@pytest.mark.timeout(90)
def test_a_dataloader_worker_the_containers_oom_killer_ends_is_named_with_the_evidence(nodes):
    """A DataLoader worker grows by 64 MiB a sample in a container limited to 1.5 GB: the OOM killer
    ends it, and its rank raises, as torch finds it gone or in the middle of handing over a batch.
    Before: `RuntimeError: DataLoader worker (pid(s) N) exited unexpectedly`, or a bare
    `ConnectionResetError: [Errno 104] Connection reset by peer` taken for a peer's echo (not published
    as the job's cause), and nothing on why, while the cgroup counted the kill."""
    script = str(Path(__file__).parent / "scripts" / "fit_hungry_loader.py")
    with memory_limited(1_500_000_000) as prefix:
        [ended] = nodes(1, 1, [], script=script, prefix=prefix).finish(timeout=60)
    out = ended.output
    assert ended.returncode == 1 and "trained" not in out, describe([ended])
    headline = re.search(r"ddprun: the job failed: rank 0 \(node 0, \S+\) failed: (.*)\nHINT: (.*)", out)
    assert headline, out
    print(headline[1])
    assert re.fullmatch(r"RuntimeError: DataLoader worker \(pid\(s\) \d+\) exited unexpectedly|its DataLoader worker "
                        r"ended while handing it a batch \((ConnectionResetError|ConnectionRefusedError|EOFError|"
                        r"FileNotFoundError): .*\)", headline[1]), out
    assert re.match(r"the out-of-memory killer ended a DataLoader worker of this rank \(the cgroup's oom_kill count "
                    r"went 0 -> [1-9]\d* while the rank ran\)", headline[2]), out


@pytest.mark.timeout(90)
def test_a_full_dev_shm_is_named_with_its_size_and_what_to_give_the_container(nodes):
    """A container's /dev/shm is 64 MiB unless given more (docker's default); a DataLoader worker
    hands its rank 128 MiB batches through it. Before: a 2,000-character headline of the worker's
    traceback, cut at `RuntimeError: unable to a`, and no HINT."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        unavailable("a private /dev/shm needs root and `unshare` (util-linux)")
    small_shm = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "inner"]
    script = str(Path(__file__).parent / "scripts" / "fit_big_batches.py")
    [ended] = nodes(1, 1, [], script=script, prefix=small_shm).finish(timeout=60)
    out = ended.output
    assert ended.returncode == 1, out
    failed = out[out.index("ddprun: the job failed: "):].splitlines()
    assert re.fullmatch(r"ddprun: the job failed: rank 0 \(node 0, \S+\) failed: RuntimeError: Caught RuntimeError in "
                        r"DataLoader worker process 0: RuntimeError: unable to allocate shared memory\(shm\) for file "
                        r"</torch_\d+_\d+_\d+>: No space left on device \(28\)", failed[0]), failed
    assert failed[1].startswith("HINT: the shared memory DataLoader workers pass batches through is full "
                                "(/dev/shm is 64 MiB): give the container more (docker run --shm-size=8g"), failed
    assert "Original Traceback" not in out.split("ddprun: the job failed: ")[1], out
