"""Start launcher processes (ddprun or torchrun agents) for tests: free ports, bounded waits,
process-group kills on timeout, and their output attached to any failure; store servers and
clients made as ddprun makes them, and a client that records its calls."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DDPRUN = str(BIN / "ddprun")
TORCHRUN = str(BIN / "torchrun")
EXAMPLE = str(REPO / "examples" / "torchrun_style.py")


def extra(module: str):
    """``module``, an optional extra (lightning, pytorch_lightning, ray): skipped when it is not
    installed, unless DDPRUN_TESTS_NEED_EXTRAS is set (scripts/test.sh sets it: its setup installs
    every extra), where any import failure fails the test instead of hiding it as a skip."""
    import importlib

    import pytest

    if os.environ.get("DDPRUN_TESTS_NEED_EXTRAS"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free now, below the kernel's ephemeral range: a job binds it seconds later (after
    its imports), and meanwhile no connecting socket can autobind it (a port 0 pick could be)."""
    import random

    low = _ephemeral_low()
    rng = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(500 if low > 20000 else 0):  # a machine whose ephemeral range starts low: the kernel's pick
        port = rng.randrange(20000, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every pick taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store_server(port: int = 0, timeout_s: float = 5.0, **kw):
    """A TCPStore server on 127.0.0.1 (``kw``: TCPStore's own), made as ddprun makes its own
    (agent/endpoint.py): its calls wait up to ``timeout_s``, its first connect to itself up to
    SELF_CONNECT_S, for torch's connect looks up the address's name and a DNS server that drops a
    packet holds that lookup for the resolver's 5 s."""
    from ddprun.agent.endpoint import store_server as server

    return server("127.0.0.1", port, timeout_s, **kw)


def store_client(port: int, timeout_s: float = 5.0, host: str = "127.0.0.1"):
    """A client of the store at host:port made as ddprun's agent makes its own: calls wait up to
    ``timeout_s``, its connect up to SELF_CONNECT_S (see :func:`store_server`)."""
    from ddprun.agent.endpoint import store_client as client

    return client(host, port, timeout_s)


def fork() -> int:
    """os.fork() of the test process, its garbage collected first: an unreachable TCPStore an earlier
    test left (a server whose threads the child lacks) is otherwise destroyed by a collection in the
    child, which then dies of SIGSEGV (seen in threading's after-fork hook under pytest -n 2)."""
    import gc

    gc.collect()
    return os.fork()


def preconnected(port: int, make=None):
    """A ``connect`` for ddprun's AgentFailures whose first client is made now, outside the agent's
    own bound on a connect (STORE_CALL_S, 5 s): torch's connect looks up the name of
    ``::ffff:127.0.0.1``, and a DNS server that drops that one query holds it the resolver's 5 s
    (CI: ``_connect did not return within 5 s`` on a store in the test's own process). Later
    connects (after a failure the test causes) are made as the agent makes them. ``make(port)``:
    how a client is made (default :func:`store_client`)."""
    make = make or store_client
    first = [make(port)]
    return lambda: first.pop() if first else make(port)


class Counting:
    """A store client that records the name of every call it makes (``calls``)."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            return getattr(self.store, name)(*args)
        return call


OUTER_JOB = ("DDPRUN_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "LSB_", "SM_", "SKYPILOT_", "PET_")
"""Variables of a job the suite itself may run in (an ``salloc``, an mpirun, a SageMaker or Kubernetes
job), and of ddprun's own: ddprun's detection reads them (cluster/), so a test's job would take that
job's ranks (seen: an in-process test run inside an allocation)."""
OUTER_JOB_KEYS = ("KUBERNETES_SERVICE_HOST", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job_env(**extra: str) -> dict[str, str]:
    """The environment for launched jobs, without an outer job's (OUTER_JOB): one OpenMP thread per
    rank (2 cores are shared)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(OUTER_JOB) and k not in OUTER_JOB_KEYS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@dataclass
class Finished:
    cmd: list[str]
    returncode: int | None
    """None when the process was killed at the timeout."""
    output: str
    wall_s: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_agents(cmds: list[list[str]], timeout: float, cwd: str | os.PathLike | None = None,
               env: dict[str, str] | None = None) -> list[Finished]:
    """Start every command at once (each in its own process group), wait at most ``timeout``
    seconds for all, kill the stragglers' whole process trees, return each one's result."""
    env = env or job_env()
    t0 = time.monotonic()
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True, text=True) for c in cmds]
    results: list[Finished | None] = [None] * len(procs)
    deadline = t0 + timeout
    try:
        for i, p in enumerate(procs):
            left = max(0.1, deadline - time.monotonic())
            try:
                out, _ = p.communicate(timeout=left)
                results[i] = Finished(cmds[i], p.returncode, out, time.monotonic() - t0)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for i, p in enumerate(procs):
            if results[i] is None:
                kill_tree(p)
                out, _ = p.communicate(timeout=10)
                results[i] = Finished(cmds[i], None, out, time.monotonic() - t0)
    return results  # type: ignore[return-value]


class Watched:
    """One launcher followed line by line while it runs (its own process group): each line with the
    seconds since its start. ``with`` kills its tree if it is still running at the end."""

    def __init__(self, cmd: list[str], cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env or job_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append((time.monotonic() - self.t0, line))
                self._new_line.notify_all()

    @property
    def output(self) -> str:
        return "".join(line for _, line in list(self.lines))

    def wait_for_line(self, prefix: str, timeout: float) -> float | None:
        """Seconds since the start when a line starting with ``prefix`` came; None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._new_line:
            while True:
                seen = [t for t, line in self.lines if line.startswith(prefix)]
                left = deadline - time.monotonic()
                if seen or left <= 0:
                    return seen[0] if seen else None
                self._new_line.wait(left)

    def finish(self, timeout: float) -> tuple[int | None, float]:
        """Its exit code (None: killed at ``timeout`` s from now) and the seconds from its start to its
        exit; every line read."""
        try:
            rc: int | None = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            rc = None
            self.proc.wait(timeout=10)
        ended = time.monotonic() - self.t0
        self._reader.join(timeout=10)
        return rc, ended

    def __enter__(self) -> Watched:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)
            self.proc.wait(timeout=10)
        self._reader.join(timeout=10)


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL ``p``'s process group and every descendant of ``p``: torch's agent starts each worker
    in a session of its own, which the group does not reach (PR_SET_PDEATHSIG would end it with its
    agent, but only once the worker has set it, its first moment)."""
    below = descendants(p.pid)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def parent_of(pid: int) -> int:
    """``pid``'s parent (/proc; Linux). OSError when it is gone; the name may hold ')' or spaces."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (/proc; Linux), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = parent_of(int(entry))
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo += children.get(child, [])
    return found


def describe(results: list[Finished]) -> str:
    """All outputs, for an assertion message."""
    return "\n".join(f"--- {' '.join(r.cmd)} -> rc={r.returncode} in {r.wall_s:.1f}s\n{r.output}" for r in results)


def ddprun_nodes(nnodes: int, nproc: int, script_and_args: list[str], *, rdzv_id: str, port: int | None = None,
                 extra: list[str] | None = None) -> list[list[str]]:
    """The commands of ``nnodes`` simulated nodes (one ddprun agent each) on 127.0.0.1."""
    port = port or free_port()
    return [[DDPRUN, "run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, *(extra or []), *script_and_args]
            for _ in range(nnodes)]


def gloo_threads() -> int:
    """This process's gloo worker threads (torch names them pt_gloo_runloop): 0 once every gloo
    group it made was freed and its threads joined."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def bounded_calls_in_flight() -> int:
    """Threads of this process inside a call that ddprun._util's ``within`` or ``Bounded`` made (a
    TCPStore call to a frozen store, say): each returns, or throws, when its own deadline comes."""
    from ddprun import _util

    busy = 0
    for frame in sys._current_frames().values():
        while frame is not None and frame.f_code is not _util._call_into.__code__:
            frame = frame.f_back
        busy += frame is not None
    return busy


def await_bounded_calls(timeout_s: float) -> int:
    """Wait (bounded) until no such call is in flight; how many still are. A torch call that throws
    on its helper thread while the interpreter finalizes aborts the process (std::terminate: pytest
    exits 134 after every test passed): a test that leaves one running waits for it here."""
    deadline = time.monotonic() + timeout_s
    while bounded_calls_in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bounded_calls_in_flight()
