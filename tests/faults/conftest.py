"""The fault tier's harness: simulated nodes (one ``ddprun run`` agent each on 127.0.0.1) that a test
can hurt while they train, then every node's output, exit code and exit time, and a check that no
process of the job is left (every process whose working directory is the test's)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import DDPRUN, free_port, job_env, parent_of

JOB = str(Path(__file__).parent / "scripts" / "job.py")


def processes_in(directory: Path) -> list[int]:
    """pids of the processes whose working directory is ``directory`` or below it."""
    out, root = [], str(directory.resolve())
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (cwd == root or cwd.startswith(root + "/")):
            out.append(int(entry))
    return out


@dataclass
class Ended:
    node: int
    returncode: int | None
    output: str
    ended_at: float
    """time.monotonic() when the agent's exit was seen."""


class Nodes:
    """``n`` agents of one job; :meth:`finish` waits (bounded) and kills what is left."""

    def __init__(self, tmp_path: Path, n: int, nproc: int, job_args: list[str], extra: list[str] | None = None,
                 rdzv_id: str | None = "fault", env: dict[str, str] | None = None, nnodes: str | None = None,
                 script: str = JOB, port: int | None = None, name: str = "node", gate: Path | None = None,
                 prefix: list[str] | None = None):
        """``rdzv_id=None``: no --rdzv-id (the nodes agree on a new run id); ``port``: join the
        endpoint of another Nodes; ``script``: another job than scripts/job.py (no --pids then);
        ``gate``: each process starts now (its pid is taken) but execs ``ddprun run`` only once that
        file exists (at most 60 s later); ``prefix``: a command that execs ``ddprun run`` (its pid
        stays the agent's), e.g. ``prlimit --nofile=40:40``."""
        self.dir, self.port = tmp_path, port or free_port()
        self.pids_dir = tmp_path / "pids"
        self.pids_dir.mkdir(exist_ok=True)
        ident = ["--rdzv-id", rdzv_id] if rdzv_id is not None else []
        job = [JOB, "--pids", str(self.pids_dir)] if script == JOB else [script]
        self.cmd = [DDPRUN, "run", "--nnodes", nnodes or str(n), "--nproc-per-node", str(nproc), "--rdzv-endpoint",
                    f"127.0.0.1:{self.port}", *ident, *(extra or []), *job, *job_args]
        self.cmd = [*(prefix or []), *self.cmd]
        self.env = env or job_env()
        if gate is not None:  # exec keeps the pid: the agent has this early pid, and arrives late
            self.cmd = ["sh", "-c", 'i=0; while [ ! -e "$0" ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; '
                        'exec "$@"', str(gate), *self.cmd]
        self.outs = [tmp_path / f"{name}-{i}.out" for i in range(n)]
        self.procs = [self._start(i) for i in range(n)]
        self.ended: dict[int, float] = {}

    def _start(self, i: int) -> subprocess.Popen:
        with open(self.outs[i], "w") as out:
            return subprocess.Popen(self.cmd, cwd=self.dir, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def worker_pids(self, ranks: range, timeout: float = 60) -> dict[int, int]:
        """rank -> pid, once every rank has made its first step."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            files = {r: self.pids_dir / f"rank-{r}.pid" for r in ranks}
            if all(f.exists() and f.read_text() for f in files.values()):
                return {r: int(f.read_text()) for r, f in files.items()}
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.1)
        raise AssertionError("the job did not start training:\n" + self.describe())

    def agent_of(self, worker_pid: int) -> int:
        """The node index whose agent is the worker's parent."""
        ppid = parent_of(worker_pid)
        return next(i for i, p in enumerate(self.procs) if p.pid == ppid)

    def store_host(self) -> int:
        """The node index whose agent listens on the rendezvous port (it hosts the store)."""
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{self.port}"], capture_output=True, text=True).stdout
        for i, p in enumerate(self.procs):
            if f"pid={p.pid}," in out:
                return i
        raise AssertionError(f"no agent listens on {self.port}: {out!r}")

    def signal(self, node: int, sig: int) -> float:
        os.kill(self.procs[node].pid, sig)
        return time.monotonic()

    def finish_one(self, node: int, timeout: float) -> Ended:
        """Wait (at most ``timeout``) for one node's agent to exit, the others left running."""
        p, deadline = self.procs[node], time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.poll() is not None:
            self.ended.setdefault(node, time.monotonic())
        return Ended(node, p.poll(), self.outs[node].read_text(errors="replace"), self.ended.get(node, float("inf")))

    def finish(self, timeout: float) -> list[Ended]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            for i, p in enumerate(self.procs):
                if p.poll() is not None and i not in self.ended:
                    self.ended[i] = time.monotonic()
            time.sleep(0.05)
        for i, p in enumerate(self.procs):
            if p.poll() is not None and i not in self.ended:
                self.ended[i] = time.monotonic()
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        return [Ended(i, p.returncode if i in self.ended else None, self.outs[i].read_text(errors="replace"),
                      self.ended.get(i, float("inf"))) for i, p in enumerate(self.procs)]

    def describe(self) -> str:
        return "\n".join(f"--- node {i} (rc={p.poll()})\n{self.outs[i].read_text(errors='replace')}"
                         for i, p in enumerate(self.procs))


def describe(ended: list[Ended]) -> str:
    return "\n".join(f"--- node {e.node} -> rc={e.returncode}\n{e.output}" for e in ended)


def assert_nothing_left(directory: Path, within_s: float = 5.0) -> None:
    """No process of the job is left (orphaned workers included), within ``within_s``."""
    deadline = time.monotonic() + within_s
    while (left := processes_in(directory)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # never leave them to the next test
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def nodes(tmp_path):
    """Start nodes with ``nodes(n, nproc, job_args, ...)``; afterwards nothing of them may be left."""
    started: list[Nodes] = []

    def start(n: int, nproc: int, job_args: list[str], **kw) -> Nodes:
        started.append(Nodes(tmp_path, n, nproc, job_args, **kw))
        return started[-1]

    yield start
    for s in started:
        for p in s.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert_nothing_left(tmp_path)
