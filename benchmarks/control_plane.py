"""ddprun's control plane at scale: simulated nodes and ranks of one job against one TCPStore.

    python benchmarks/control_plane.py [--ranks 64,256,1024,4096,8192] [--nproc-per-node 8]
                                       [--procs 4] [--seconds 6] [--no-node-store]

Each simulated rank is the real worker side: a JobChannel (worker/channel.py: preflight's announce
and verdict) and a Monitor thread (worker/monitor.py: failures, preemption, progress, stall answers,
timing, and on rank 0 and the last rank the stall observer), with its own two clients of the job's
store, as in a worker. Each simulated node is the real agent side: an AgentFailures thread
(agent/failures.py: the alarm, records, heartbeat, neighbour watch) with its NodeRelay
(agent/noderelay.py). They run as threads of ``--procs`` processes, whole nodes to a process; the
job's store is a TCPStore server in one more process (the agent's own, agent/endpoint.py), every
simulated rank and agent with its own clients. What is replaced, and why:
- a node's store: a dict in its process (LocalStore), not a TCPStore on 127.0.0.1: its calls stay on
  their node and cost microseconds there, where 8,192 ranks' local round trips, serialized on 2
  cores here, would be most of the simulation (they are counted, as node-store calls);
- the timing a rank publishes: telemetry is per process, so every simulated rank publishes the same
  fixed window summary (the writes and the reads are the real ones);
- stack dumps and a rank's place at a stall (a dump of a process holding a thousand simulated ranks
  starves the GIL for seconds): every rank answers the same place, in an all-reduce;
- a node's facts for preflight: computed once and the same for every node;
- an agent never signals processes (its simulated workers are threads);
- store clients are all connected before the ranks start (a start-up cost, not the steady one);
- what a rank does once it has seen another's failure: it records that it stopped, as a worker does
  (through its agent, which forwards its node's in one batch, or itself without a node store), then
  notes the time and ends its thread (where a worker's process ends: no other call).
Every call to the job's store is counted (one call = one round trip; multi_get is one), the agents'
included; calls to the node stores are counted apart.

Printed per N ranks: job-store calls per second in total and per rank while training (progress
bumped 20 times a second), the same to the node stores, rank 0's time per telemetry window
(reading every node's timing record, the straggler check), preflight (announce to every rank's
verdict) and rank 0's gather, an injected stall to the hang report past the threshold (3 s), a
failure record to every rank having seen it, and the job-store calls per rank that preflight, the
stall and the failure cost (what the store must serve whatever runs the ranks: the protocol's share,
where the times above also hold the simulator's; a stall's are counted from the stall to STALL_TAIL_S
after its report, its end included, less the job's steady calls over that time; a failure's until
FORWARD_S after every rank saw it, less the agents' steady calls over that time). ``--no-node-store``: ranks talk to the job store
themselves, as before the node store (each agent still reads the alarm first).
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch loads: no connect warnings per client

STALL_S = 3.0
WINDOW = {"n": 20.0, "data_s": 0.001, "compute_s": 0.05, "comm_s": 0.01, "opt_s": 0.002, "step_s": 0.063}
SERVER = (f"import sys\nsys.path.insert(0, {SRC!r})\n"
          "from ddprun.agent.endpoint import bound_server\n"  # the agent's own store server, on one IPv4 address
          "s = bound_server('127.0.0.1', 0, 600)\nprint(s.port, flush=True)\nsys.stdin.read()\n")

ANSWER_S = 900.0
"""The most one simulation step may take (the largest sizes start thousands of threads on 2 cores)."""


def answer(p: subprocess.Popen, what: str) -> str:
    """One line from a child that answers each command with exactly one line, within ANSWER_S."""
    ready, _, _ = select.select([p.stdout], [], [], ANSWER_S)
    if not ready:
        p.kill()
        raise RuntimeError(f"a simulation process gave no answer to {what} within {ANSWER_S:.0f} s")
    return p.stdout.readline()


class Exited(BaseException):
    """A simulated rank's os._exit: it unwinds its monitor thread past every handler."""


class Ops:
    """Counts of store calls, and of the keys their multi_gets read (the GIL makes += on an int
    attribute close enough for a benchmark)."""

    def __init__(self) -> None:
        self.n = self.keys = 0


class Counted:
    """A store client whose every call is counted in ``ops``, and the keys each multi_get reads."""

    def __init__(self, store, ops: Ops):
        self._store, self._ops = store, ops

    def __getattr__(self, name: str):
        fn = getattr(self._store, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            self._ops.n += 1
            if name == "multi_get":
                self._ops.keys += len(args[0])
            return fn(*args, **kwargs)

        return call


class LocalStore:
    """A node store in this process (a dict under a lock): the node-local channel costs microseconds on
    a real node, where its TCP round trips, serialized here on 2 cores, would be most of the simulation."""

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value) -> None:
        with self._lock:
            self._d[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._d[key]

    def check(self, keys) -> bool:
        with self._lock:
            return all(k in self._d for k in keys)

    def multi_get(self, keys) -> list[bytes]:
        with self._lock:
            return [self._d[k] for k in keys]

    def multi_set(self, keys, values) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        """TCPStore's: ``desired`` where the value is ``expected`` (or absent and ``expected`` empty);
        else the value as it is, or ``expected`` where there is none (nothing is created)."""
        def raw(v) -> bytes:
            return v.encode() if isinstance(v, str) else bytes(v)

        with self._lock:
            now = self._d.get(key)
            if (now is None and raw(expected) == b"") or (now is not None and now == raw(expected)):
                self._d[key] = raw(desired)
                return raw(desired)
            return raw(expected) if now is None else now

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._d.get(key, b"0")) + amount
            self._d[key] = str(value).encode()
            return value


def environ(rank: int, n: int, per_node: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
            "GROUP_WORLD_SIZE": str(n // per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": f"bench{n}", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def replace(module, name: str, value) -> None:
    """Set ``module.name`` to ``value``; an error where ddprun has no such name any more (a rename
    would leave the stand-in unused and the simulation doing the real, costly thing)."""
    if not hasattr(module, name):
        raise RuntimeError(f"the simulation no longer matches ddprun: {module.__name__} has no {name}")
    setattr(module, name, value)


def timed(obj, name: str, into: list[float]) -> None:
    """Wrap ``obj.name`` so that each call's seconds are appended to ``into``."""
    fn = getattr(obj, name)

    def call(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.monotonic() - t0)

    setattr(obj, name, call)


def run_all(fns, timeout: float) -> None:
    threads = [threading.Thread(target=f, daemon=True) for f in fns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"not every simulated rank finished within {timeout:.0f} s")


def wait_until(what, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got is not None:
            return got
        time.sleep(0.02)
    return None


# -- one simulation process: whole nodes ------------------------------------------------------------
def sim_agent_class() -> type:
    """The real agent side (agent/failures.py), less its signals: its workers are threads."""
    from ddprun.agent.failures import AgentFailures

    class SimAgent(AgentFailures):
        beats = 0
        gave_up = False

        def _tick(self, beat, seen_at):
            self.beats += 1
            return super()._tick(beat, seen_at)

        def _enforce_end(self, keys):  # its workers are threads of this process: no signals
            pass

        def _stop_workers(self, lost, pids):  # the same; and a job store given up breaks the simulation
            self.gave_up = True

    return SimAgent


def sim_monitor_class(go: threading.Event) -> type:
    """The real worker monitor (worker/monitor.py), whose threads start at ``go``; seeing a failure ends
    the thread (not the process)."""
    from ddprun.worker import monitor as monitor_mod

    class SimMonitor(monitor_mod.Monitor):
        seen_at: float | None = None
        reported_at: float | None = None
        polls = 0

        def _tick(self, store):
            self.polls += 1
            super()._tick(store)

        def _loop(self):
            go.wait()  # every thread started first: a start waits for the GIL behind every running poll
            try:
                super()._loop()
            except Exited:
                pass

        def _stopped_by(self, cause, store):
            self._record_stopped(self.ch.stopped(cause), store)  # the real path: its agent's batch, or itself
            self.seen_at = time.time()
            self._stop.set()
            raise Exited  # where the real monitor's process ends (os._exit): no further store call

        def _write_report(self, report):
            self.reported_at = time.time()

    return SimMonitor


def override_faults(cls: type) -> list[str]:
    """Where ``cls`` overrides a method its base does not have, or with other parameters: a rename in
    ddprun would leave the override dead and the simulation doing what it must not (signalling its
    process group, say)."""
    base, faults = cls.__mro__[1], []
    for name, fn in vars(cls).items():
        if not callable(fn) or name.startswith("__"):
            continue
        real = getattr(base, name, None)
        if not callable(real):
            faults.append(f"{cls.__name__}.{name} overrides nothing of {base.__name__}")
        elif list(inspect.signature(fn).parameters) != list(inspect.signature(real).parameters):
            faults.append(f"{cls.__name__}.{name}{inspect.signature(fn)} does not match "
                          f"{base.__name__}.{name}{inspect.signature(real)}")
    return faults


def check_overrides() -> list[str]:
    """What :func:`override_faults` finds in the simulated agent and monitor."""
    return override_faults(sim_agent_class()) + override_faults(sim_monitor_class(threading.Event()))


class Sim:
    """The simulated nodes ``nodes`` of a job of ``n`` ranks, in this process (module docstring)."""

    def __init__(self, n: int, per_node: int, port: int, nodes: range, run_dir: str, node_store: bool):
        from torch.distributed import TCPStore

        from ddprun.protocol.env import WorkerEnv
        from ddprun.worker.channel import JobChannel

        self._patch()
        self.ops, self.agent_ops, self.local_ops, self.n = Ops(), Ops(), Ops(), n
        ranks = [r for node in nodes for r in range(node * per_node, (node + 1) * per_node)]
        self.has0, self.has_last = 0 in ranks, n - 1 in ranks

        def job_client(ops=self.ops):
            # about one connect in 50 takes 5.0 s here, the resolver's timeout ("The hostname of the client
            # socket cannot be retrieved"): a long timeout, though an agent's own client has 5 s
            return Counted(TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=120)), ops)

        # every client made before the ranks start, 64 at a time: connecting is a start-up cost
        with ThreadPoolExecutor(64) as connect:
            pool = list(connect.map(lambda _: job_client(), range(2 * len(ranks))))
            agent_clients = list(connect.map(lambda _: job_client(self.agent_ops), nodes))  # (a 5 s one may time out connecting)
        node_client = {node: Counted(LocalStore(), self.local_ops) for node in nodes}
        wenv = WorkerEnv(run_dir=run_dir, stall_timeout=STALL_S, stall_end=3600.0, join_timeout=120.0,
                         node_store="127.0.0.1:1" if node_store else "")
        self.channels = [JobChannel(environ(r, n, per_node, port), wenv, script=None, connect=pool.pop,
                                    connect_node=lambda node=r // per_node: node_client[node]) for r in ranks]
        self.agents = [self._agent(node, per_node, port, run_dir, agent_clients[i], node_client[node] if node_store
                                   else None) for i, node in enumerate(nodes)]
        self.monitors: list = []

    @staticmethod
    def _patch() -> None:
        from ddprun.worker import monitor as monitor_mod
        from ddprun.worker import preflight, stacks

        replace(monitor_mod, "summarize", lambda records: dict(WINDOW))  # every simulated rank has a window to publish
        replace(stacks, "dump_stacks", lambda path: None)
        replace(stacks, "main_thread_place", lambda: {"where": "in all_reduce", "user_frame": "train.py:40 in step",
                                                      "frames": ["train.py:40 in step"]})
        # a node's facts (package hash, addresses, ...) are computed once per node, in parallel on real
        # nodes; serialized here they would be most of preflight's time: computed once, the same on every node
        # simulated CPU nodes: the GPUs of the machine running the simulation are not theirs (on a
        # one-GPU host every node of 8 ranks would fail preflight's "processes share GPUs")
        facts = {**preflight.node_facts({}, None), "gpus": 0}
        replace(preflight, "node_facts", lambda environ, script: {
            **facts, "node_rank": int(environ["GROUP_RANK"]), "nproc": int(environ["LOCAL_WORLD_SIZE"]),
            "host": f"node{environ['GROUP_RANK']}", "run_id": environ["TORCHELASTIC_RUN_ID"]})

    def _agent(self, node: int, per_node: int, port: int, run_dir: str, client, local):
        from ddprun.agent.noderelay import NodeRelay
        from ddprun.protocol.rundir import RunDir

        a = sim_agent_class()(RunDir(run_dir), f"node{node}", "127.0.0.1", port, f"bench{self.n}", io.StringIO(),
                              connect=lambda: client, relay=NodeRelay(local) if local is not None else None)
        a.workers = {r: (r % per_node, 0, "") for r in range(node * per_node, (node + 1) * per_node)}
        a.node, a.nnodes = node, self.n // per_node
        return a

    def preflight(self) -> dict:
        from ddprun.worker import preflight

        checks: list[float] = []
        real = preflight.run_checks
        timed(preflight, "run_checks", checks)  # announce() calls it by its module-global name
        t0 = time.time()
        try:
            run_all([ch.start for ch in self.channels], timeout=600)
        finally:
            preflight.run_checks = real
        out = {"done": time.time(), "t0": t0}
        if self.has0:
            out["gather_s"] = checks[0]
            verdict = self.channels[0].store.get(self.channels[0].keys.preflight).decode(errors="replace")
            out["verdict"] = verdict
        return out

    def train(self) -> dict:
        from ddprun.telemetry import PROGRESS

        go = threading.Event()
        SimMonitor = sim_monitor_class(go)
        for a in self.agents:
            a.on_workers_started("c0", a.node, a.nnodes, a.workers, world_size=self.n)
        self.monitors = [SimMonitor(ch) for ch in self.channels]
        self.window: list[float] = []
        if self.has0:
            timed(self.monitors[0], "_timings", self.window)
            timed(self.monitors[0].stragglers, "update", self.window)
        for m in self.monitors:
            m.start()
        go.set()
        self.training = threading.Event()
        self.training.set()

        def drive():
            while self.training.is_set():
                PROGRESS.stepped(time.monotonic())  # a step as the optimizer hook counts it (arms the stall watch)
                time.sleep(0.05)

        self.driver = threading.Thread(target=drive, daemon=True)
        self.driver.start()
        self._progress = PROGRESS
        return {}

    def mark(self) -> dict:
        broken = [f"node {a.node}: {what}" for a in self.agents for what in
                  (["gave the job store up as lost"] if a.gave_up else []) + sorted(a._faults_said)]
        return {"ops": self.ops.n + self.agent_ops.n, "agent_ops": self.agent_ops.n, "local": self.local_ops.n,
                "t": time.time(), "broken": broken,
                "polls": sum(m.polls for m in self.monitors), "beats": sum(a.beats for a in self.agents)}

    def stall(self) -> dict:
        self.training.clear()
        self.driver.join()
        t = time.time()
        reported = wait_until(lambda: next((m.reported_at for m in self.monitors if m.reported_at), None),
                              timeout=STALL_S * 2 + 30) if self.has0 else None  # rank 0 reports first
        self._progress.stepped(time.monotonic())  # progress again: the observers re-arm
        ch = self.channels[0]
        return {"stalled": t, "reported": reported, "window_s": sum(self.window) / max(1, len(self.window) // 2),
                "direct": int(ch.store.add(ch.keys.directs, 0))}

    def fail(self) -> dict:
        from ddprun.protocol import failure as fr

        t = time.time()
        if self.has_last:
            failing = self.channels[-1]
            threading.Thread(target=failing.record_failure, daemon=True,
                             args=(failing.me(fr.ERROR, "RuntimeError: injected"),)).start()
        others = [m for m in self.monitors if m.ch.rank != self.n - 1]
        seen = wait_until(lambda: max(m.seen_at for m in others) if all(m.seen_at for m in others) else None,
                          timeout=60) if others else t
        return {"failed": t, "seen": seen}

    def end(self) -> dict:
        for m in self.monitors:
            m.stop()
        for a in self.agents:
            a._stop.set()
        for m in self.monitors:  # each ends within a poll; the server must outlive every call in flight
            m._thread.join(timeout=5)
        return {}


def child_main(args: argparse.Namespace) -> int:
    """A simulation process: builds its Sim, then answers one command a line on stdin with JSON."""
    nodes = range(args.first_node, args.last_node)
    sink = io.StringIO()
    real_out = sys.stdout
    sys.stdout = sys.stderr = sink  # the ranks' and agents' console lines: not the benchmark's
    sim = Sim(args.n, args.nproc_per_node, args.port, nodes, args.run_dir, not args.no_node_store)
    print(json.dumps({"ready": True}), file=real_out, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        result = getattr(sim, cmd)()
        print(json.dumps(result), file=real_out, flush=True)
        sink.seek(0)
        sink.truncate()
        if cmd == "end":
            break
    os._exit(0)  # the simulated ranks' threads and clients go with the process


# -- the driver -------------------------------------------------------------------------------------
class Children:
    """The simulation processes of one job size, told the same command at once."""

    def __init__(self, n: int, per_node: int, procs: int, port: int, run_dir: str, no_node_store: bool):
        nnodes = n // per_node
        cuts = [nnodes * i // procs for i in range(procs + 1)]
        self.procs = []
        for a, b in zip(cuts, cuts[1:]):
            if a == b:
                continue
            cmd = [sys.executable, __file__, "--child", "--n", str(n), "--nproc-per-node", str(per_node),
                   "--port", str(port), "--first-node", str(a), "--last-node", str(b), "--run-dir", run_dir]
            self.procs.append(subprocess.Popen(cmd + (["--no-node-store"] if no_node_store else []),
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        self.all("")  # every one ready

    def all(self, cmd: str) -> list[dict]:
        t0 = time.monotonic()
        try:
            return self._all(cmd)
        finally:
            if os.environ.get("CP_DEBUG"):
                print(f"  {cmd or 'start'}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)

    def _all(self, cmd: str) -> list[dict]:
        if cmd:
            for p in self.procs:
                p.stdin.write(cmd + "\n")
                p.stdin.flush()
        out = []
        for p in self.procs:
            line = answer(p, cmd or "its start")
            if not line:
                raise RuntimeError(f"a simulation process ended during {cmd or 'its start'} (exit {p.wait()})")
            out.append(json.loads(line))
        broken = [b for r in out for b in r.get("broken", [])]
        if broken:  # its figures would be a broken simulation's, not the protocol's
            raise RuntimeError("the simulation is broken (fix benchmarks/control_plane.py): " + "; ".join(broken))
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


FORWARD_S = 1.5
"""After every rank has seen the failure: the agents' beats in this time forward their ranks' records."""


def failure_calls(m0: list[dict], m1: list[dict], m2: list[dict], m3: list[dict]) -> float:
    """Job-store calls from the failure to FORWARD_S after every rank saw it (m2 -> m3), less the
    agents' steady calls over that time (their rate while training, m0 -> m1): what the failure cost."""
    def took(a: list[dict], b: list[dict]) -> float:
        return max(r["t"] for r in b) - max(r["t"] for r in a)

    steady = sum(b["agent_ops"] - a["agent_ops"] for a, b in zip(m0, m1)) / took(m0, m1)
    return sum(b["ops"] - a["ops"] for a, b in zip(m2, m3)) - steady * took(m2, m3)


STALL_TAIL_S = 2.0
"""After the hang report: its summary, and the end of the stall (progress again), are in the count."""


def stall_calls(m0: list[dict], m1: list[dict], m2: list[dict]) -> float:
    """Job-store calls from the injected stall to STALL_TAIL_S after its report (m1 -> m2), less every
    steady call over that time (the job's rate while training, m0 -> m1): what a reported stall that
    ends costs (the ranks' answers, the agents' reads of each move of the alarm, the claimant's reads,
    writes and deletes)."""
    def took(a: list[dict], b: list[dict]) -> float:
        return max(r["t"] for r in b) - max(r["t"] for r in a)

    steady = sum(b["ops"] - a["ops"] for a, b in zip(m0, m1)) / took(m0, m1)
    return sum(b["ops"] - a["ops"] for a, b in zip(m1, m2)) - steady * took(m1, m2)


def one_size(n: int, per_node: int, procs: int, port: int, seconds: float, run_dir: str,
             no_node_store: bool) -> dict[str, float]:
    kids = Children(n, per_node, procs, port, run_dir, no_node_store)
    try:
        p0 = kids.all("mark")
        pre = kids.all("preflight")
        p1 = kids.all("mark")
        verdict = next(r["verdict"] for r in pre if "verdict" in r)
        if verdict != "ok":
            raise RuntimeError(f"the simulated job's preflight failed: {verdict}")
        preflight_s = max(r["done"] for r in pre) - min(r["t0"] for r in pre)
        gather_s = next(r["gather_s"] for r in pre if "gather_s" in r)
        kids.all("train")
        time.sleep(3.0)  # every monitor and agent is in its loop
        m0 = kids.all("mark")
        time.sleep(seconds)
        m1 = kids.all("mark")
        took = max(b["t"] for b in m1) - max(a["t"] for a in m0)
        ops = sum(b["ops"] - a["ops"] for a, b in zip(m0, m1)) / took
        local = sum(b["local"] - a["local"] for a, b in zip(m0, m1)) / took
        polls = sum(b["polls"] - a["polls"] for a, b in zip(m0, m1)) / took / n
        beats = sum(b["beats"] - a["beats"] for a, b in zip(m0, m1)) / took / (n // per_node)
        st = kids.all("stall")
        stalled = max(r["stalled"] for r in st)
        reported = min((r["reported"] for r in st if r["reported"]), default=None)
        window_s = next((r["window_s"] for r in st if r["window_s"]), 0.0)
        if os.environ.get("CP_DEBUG"):
            print(f"  ranks that went direct: {st[0]['direct']}", file=sys.stderr, flush=True)
        time.sleep(STALL_TAIL_S)  # the report's summary, and the observers see the progress again (its end)
        m2 = kids.all("mark")
        fl = kids.all("fail")
        failed, seen = min(r["failed"] for r in fl), [r["seen"] for r in fl]
        time.sleep(FORWARD_S)  # the agents' next beats forward their stopped ranks' records
        m3 = kids.all("mark")
        kids.all("end")
    finally:
        kids.close()
    return {"ops": ops, "ops_rank": ops / n, "local_rank": local / n, "window_ms": 1000 * window_s,
            "polls": polls, "beats": beats,
            "preflight_s": preflight_s, "gather_s": gather_s,
            "stall_s": (reported - stalled) if reported else float("nan"),
            "failure_s": (max(seen) - failed) if all(seen) else float("nan"),
            "failure_calls": failure_calls(m0, m1, m2, m3) / n,
            "stall_calls": stall_calls(m0, m1, m2) / n,
            "preflight_calls": sum(b["ops"] - a["ops"] for a, b in zip(p0, p1)) / n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="64,256,1024", help="simulated job sizes (from 2,048 on, 2 cores do not keep "
                   "up with the simulation: see the polls column)")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds of steady training measured per size")
    p.add_argument("--nproc-per-node", type=int, default=8)
    p.add_argument("--procs", type=int, default=4, help="simulation processes (whole nodes each)")
    p.add_argument("--no-node-store", action="store_true", help="ranks talk to the job store themselves")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--n", "--port", "--first-node", "--last-node"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * max(sizes if not args.child else [args.n])
                                                                   + 4096)), hard))
    if args.child:
        return child_main(args)
    faults = check_overrides()
    if faults:
        print("control_plane.py: the simulation no longer matches ddprun: " + "; ".join(faults), file=sys.stderr)
        return 2
    mode = "ranks talk to the job store themselves" if args.no_node_store else "with the node store"
    print(f"# {mode}; {args.procs} simulation processes, {args.nproc_per_node} ranks a node", flush=True)
    print(f"{'ranks':>6} {'job ops/s':>9} {'/rank':>6} {'node ops/s/rank':>15} {'polls':>5} {'beats':>5} "
          f"{'rank0 window':>12} "
          f"{'preflight':>9} {'gather':>7} {'stall->report':>13} {'failure->all':>12} "
          f"{'calls/rank: preflight':>21} {'stall':>5} {'failure':>7}", flush=True)
    for n in sizes:
        per_node = min(args.nproc_per_node, n)
        server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        try:
            port = int(answer(server, "the store server's start"))
            with tempfile.TemporaryDirectory() as run_dir:
                os.makedirs(os.path.join(run_dir, "logs"))
                r = one_size(n, per_node, min(args.procs, n // per_node), port, args.seconds, run_dir,
                             args.no_node_store)
        finally:
            server.kill()
            server.wait()
        print(f"{n:>6} {r['ops']:>9.0f} {r['ops_rank']:>6.2f} {r['local_rank']:>15.2f} {r['polls']:>5.2f} "
              f"{r['beats']:>5.2f} {r['window_ms']:>10.1f}ms "
              f"{r['preflight_s']:>8.2f}s {r['gather_s']:>6.2f}s {r['stall_s'] - STALL_S:>+11.2f}s* "
              f"{r['failure_s']:>11.2f}s {r['preflight_calls']:>21.1f} {r['stall_calls']:>5.1f} "
              f"{r['failure_calls']:>7.1f}", flush=True)
    print(f"* seconds past the {STALL_S:g} s stall threshold. One run per size; job ops count the agents' calls.\n"
          "polls: monitor polls a rank a second, beats: agent beats a node a second (both 2 by design; fewer: the "
          "simulation itself is short of CPU, and its times are the simulator's)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
