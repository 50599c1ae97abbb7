"""A real SLURM cluster on this machine: slurmctld, one slurmd per node and munge, each node a network +
UTS + mount namespace with its own address and hostname (node1, node2), set up once per session by
testbed/setup.sh (about 1 s) and removed by testbed/teardown.sh (about 4 s) whatever happened.

Every node advertises 4 CPUs and 2 fake GPUs (gres over /dev/null-like devices): a job that asks for
them (``--gres=gpu:2``, ``--gpus-per-node=2``) sees SLURM_GPUS_ON_NODE=2 and CUDA_VISIBLE_DEVICES=0,1
with no device behind them; a job that doesn't sees no GPU variable. The nodes share this machine's
filesystem, so the repo's venv and pytest's tmp_path are the same path inside jobs.

Every sbatch/srun is bounded: on timeout its job is cancelled by name (a job that asks for more
than exists pends forever), then its process tree is killed. Needs root and Debian's ``slurmctld
slurmd slurm-client munge``; skipped, with the reason, otherwise.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import BIN, Finished, job_env
from tests.system import unavailable

TESTBED = Path(__file__).parent / "testbed"
NNODES = 2
NODE_CPUS = 4
"""Advertised per node (more than the real cores): enough for --ntasks-per-node=3."""
FAKE_GPUS = 2
SUBNETS = [f"10.232.{x}" for x in range(8, 40)]
"""Candidate /24s for the bridge. tests/hosts uses 10.231.7 (inside its namespaces only); the first
one with no address or route on this machine is taken."""
TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "squeue", "scancel", "sinfo",
         "munged", "munge", "mungekey", "ip", "unshare", "nsenter")
APT_HINT = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Job:
    """A finished (or timed-out and cancelled) sbatch/srun."""

    result: Finished
    output: str
    """What the job printed: srun's stdout+stderr, or the batch job's --output file after sbatch's."""
    job_id: int | None
    cwd: Path | None = None
    """Where the job ran: its ddprun run directories are under cwd/runs."""

    @property
    def returncode(self) -> int | None:
        return self.result.returncode

    @property
    def wall_s(self) -> float:
        return self.result.wall_s


@dataclass(frozen=True)
class SlurmCluster:
    base: Path
    tag: str
    net: str
    nodes: tuple[str, ...]
    fake_gpus: int

    @property
    def conf(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    def addr(self, node: str) -> str:
        """The node's address on the test bed (testbed/setup.sh: node i is NET.(10+i))."""
        return f"{self.net}.{10 + self.nodes.index(node) + 1}"

    def env(self, **extra: str) -> dict[str, str]:
        """The submitting environment: no SLURM_*/SBATCH_*/SRUN_* from outside (pytest may itself run
        in a job), SLURM_CONF of this cluster, the venv's bin first on PATH (jobs inherit it all)."""
        env = {k: v for k, v in job_env().items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env.update(SLURM_CONF=str(self.conf), PATH=f"{BIN}:{SYSTEM_PATH}")
        env.update(extra)
        return env

    def srun(self, args: list[str], *, timeout: float, cwd: Path) -> Job:
        """``srun -J <unique> ARGS`` (its own allocation), bounded by ``timeout`` seconds."""
        name = _job_name()
        result = self._bounded(["srun", "-J", name, *args], timeout, cwd, name)
        return Job(result, result.output, _first_job_id(result.output), cwd)

    def sbatch(self, script: Path, args: list[str] = (), *, timeout: float, cwd: Path, as_written: bool = False) -> Job:
        """``sbatch --wait`` of ``script`` with ``args`` from ``cwd``, bounded; the job's output file is read back.

        ``as_written``: the script's own ``--job-name=NAME`` and ``--output=%x-%j.out`` are kept (the
        name cancels it on timeout); otherwise a unique name and output file are given on the command line.
        """
        if as_written:
            m = re.search(r"^#SBATCH --job-name=(\S+)$", script.read_text(), re.M)
            assert m, f"{script} names no job"
            name, opts = m.group(1), []
        else:
            name = _job_name()
            opts = ["-J", name, "-o", str(cwd / f"{name}.out")]
        result = self._bounded(["sbatch", "--wait", "--parsable", *opts, *args, str(script)], timeout, cwd, name)
        first = result.output.strip().splitlines()[:1]
        job_id = int(first[0].split(";")[0]) if first and first[0].split(";")[0].isdigit() else None
        out_file = cwd / (f"{name}-{job_id}.out" if as_written else f"{name}.out")
        text = out_file.read_text(errors="replace") if out_file.exists() else ""
        return Job(result, text, job_id, cwd)

    def _bounded(self, cmd: list[str], timeout: float, cwd: Path, name: str) -> Finished:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, cwd=cwd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
            return Finished(cmd, p.returncode, out, time.monotonic() - t0)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", "--name", name], env=self.env(), timeout=10, capture_output=True)
            try:
                out, _ = p.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate(timeout=10)
            return Finished(cmd, None, out + f"\n[timed out after {timeout:.0f} s: job {name} cancelled]",
                            time.monotonic() - t0)

    def drain(self, timeout: float = 20) -> None:
        """Cancel every job and wait (bounded) until the queue is empty and the nodes idle again."""
        env = self.env()
        def out(*argv: str) -> list[str]:
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=10).stdout.split()

        ids = out("squeue", "-h", "-o", "%i")
        if ids:
            out("scancel", *ids)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not out("squeue", "-h", "-o", "%i") and set(out("sinfo", "-h", "-N", "-o", "%T")) == {"idle"}:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the test bed did not drain in {timeout:.0f} s: squeue {out('squeue', '-h')}, "
                           f"sinfo {out('sinfo', '-h', '-N')}\n{self.logs()}")

    def logs(self, lines: int = 30) -> str:
        """The daemons' log tails, for a failure message."""
        parts = []
        for log in sorted((self.base / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def describe(self, job: Job) -> str:
        """Everything about a job, for an assertion message."""
        r = job.result
        return (f"--- {' '.join(r.cmd)} -> rc={r.returncode} in {r.wall_s:.1f}s (job {job.job_id})\n"
                f"{r.output}\n--- job output\n{job.output}\n{run_logs(job.cwd)}{self.logs(10)}")


def run_logs(cwd: Path | None, lines: int = 12) -> str:
    """The last lines of every agent and rank log of the ddprun runs under ``cwd`` (where a job that
    hangs after its console went quiet says where it is)."""
    if cwd is None:
        return ""
    out = []
    for log in sorted((cwd / "runs").glob("*/logs/*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {log.relative_to(cwd)}\n" + "\n".join(tail))
    return "\n".join(out) + "\n" if out else ""


_counter = itertools.count(1)


def _job_name() -> str:
    return f"ddprun-t{os.getpid()}-{next(_counter)}"


def _first_job_id(text: str) -> int | None:
    """Best effort: srun names its job only when it waits or fails ("job 12 queued ...")."""
    m = re.search(r"job (\d+)", text)
    return int(m.group(1)) if m else None


def _sh(*argv: str, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    for tool in TOOLS:
        if shutil.which(tool, path=SYSTEM_PATH) is None:
            return f"`{tool}` is not installed ({APT_HINT})"
    try:
        probe = _sh("unshare", "--mount", "--uts", "--propagation", "private", "true")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare --mount --uts` is unavailable: {e}"
    if probe.returncode != 0:
        return f"`unshare --mount --uts` is not permitted here (no CAP_SYS_ADMIN?): {probe.stderr.strip()}"
    return None


def _free_subnet() -> str:
    used = _sh("ip", "-4", "-o", "addr", "show").stdout + _sh("ip", "-4", "route", "show").stdout
    for net in SUBNETS:
        if f"{net}." not in used:
            return net
    raise RuntimeError(f"no free /24 among {SUBNETS[0]}.0 .. {SUBNETS[-1]}.0")


@pytest.fixture(scope="session")
def slurm_cluster():
    """The session's :class:`SlurmCluster` (node1..node2, 4 CPUs and 2 fake GPUs each)."""
    reason = _why_not()
    if reason:
        unavailable(reason)
    # Not under pytest's tmp dir: munged wants every directory above its socket searchable, and
    # pytest-of-root is 0700. Short, too: the socket path must stay under ~100 characters.
    tag = f"dsl{os.getpid() % 100000}"
    net = _free_subnet()
    base = Path(tempfile.mkdtemp(prefix="ddprun-slurm-"))
    base.chmod(0o755)
    env = {"PATH": SYSTEM_PATH, "HOME": str(base), "LANG": "C", "BASE": str(base), "TAG": tag, "NET": net,
           "NNODES": str(NNODES), "NODE_CPUS": str(NODE_CPUS), "FAKE_GPUS": str(FAKE_GPUS)}
    cluster = SlurmCluster(base, tag, net, tuple(f"node{i}" for i in range(1, NNODES + 1)), FAKE_GPUS)
    try:
        try:
            setup = subprocess.run(["bash", str(TESTBED / "setup.sh")], env=env, capture_output=True, text=True,
                                   timeout=60)
            failed = f"rc={setup.returncode}\n{setup.stdout}\n{setup.stderr}" if setup.returncode else ""
        except subprocess.TimeoutExpired as e:
            failed = f"timed out after 60 s\n{e.stdout}\n{e.stderr}"
        if failed:
            pytest.fail(f"the SLURM test bed did not come up: {failed}\n{cluster.logs()}", pytrace=False)
        yield cluster
    finally:
        try:
            subprocess.run(["bash", str(TESTBED / "teardown.sh")], env=env, capture_output=True, timeout=60)
        finally:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster):
    """The session's cluster, its queue emptied after the test (a leftover job would hold the nodes)."""
    yield slurm_cluster
    slurm_cluster.drain()
