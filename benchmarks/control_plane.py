"""ddprun's control plane at scale: simulated ranks of one job against one TCPStore.

    python benchmarks/control_plane.py [--ranks 64,256,1024] [--seconds 6] [--nproc-per-node 8]

Each simulated rank is the real worker side: a JobChannel (worker/channel.py: preflight's announce
and verdict) and a Monitor thread (worker/monitor.py: failures, preemption, progress, stall answers,
timing, and on rank 0 and the last rank the stall observer), each with its own two store clients,
as in a worker. They run as threads of this process; the store is a TCPStore server in a child
process. What is replaced, and why:
- the timing a rank publishes: telemetry is per process, so every simulated rank publishes the same
  fixed window summary (the write and rank 0's read are the real ones);
- stack dumps and a rank's place at a stall (a faulthandler dump, or sys._current_frames(), of this
  process would hold every simulated rank's thread: 1,024 of them at once starve the GIL for
  seconds); every rank answers the same place, in an all-reduce;
- a node's facts for preflight: computed once and the same for every node (real nodes compute
  theirs in parallel; here they would be serialized on one CPU);
- store clients are all connected before the ranks start (see one_size);
- what a rank does once it has seen another's failure: it records its echo and acknowledges, as a
  worker does, then notes the time and stops its thread instead of ending the process.
Every store call of every simulated rank is counted (one call = one round trip; multi_get is one).

Printed per N ranks: store operations per second in total and per rank while training (progress
bumped 20 times a second), monitor polls per rank per second (the design: 2), rank 0's time per
telemetry window (reading every rank's timing, the straggler check), preflight (announce to every
rank's verdict; rank 0's gather and checks), an injected stall to the hang report (threshold 3 s),
and a failure record to every rank having seen it. The agents' own store calls (one per node, each
monitor interval) are not simulated.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch loads: no connect warnings per client

from torch.distributed import TCPStore  # noqa: E402

from ddprun.protocol import failure as fr  # noqa: E402
from ddprun.protocol.env import WorkerEnv  # noqa: E402
from ddprun.telemetry import PROGRESS  # noqa: E402
from ddprun.worker import monitor as monitor_mod  # noqa: E402
from ddprun.worker import preflight, stacks  # noqa: E402
from ddprun.worker.channel import JobChannel  # noqa: E402

STALL_S = 3.0
WINDOW = {"n": 20.0, "data_s": 0.001, "compute_s": 0.05, "comm_s": 0.01, "opt_s": 0.002, "step_s": 0.063}
SERVER = (f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'src')!r})\n"
          "from ddprun.agent.endpoint import bound_server\n"  # the agent's own store server, on one IPv4 address
          "s = bound_server('127.0.0.1', 0, 600)\nprint(s.port, flush=True)\nsys.stdin.read()\n")


class Ops:
    """The count of store calls (the GIL makes += on an int attribute close enough for a benchmark)."""

    def __init__(self) -> None:
        self.n = 0


class Counted:
    """A store client whose every call is counted in ``ops``."""

    def __init__(self, store: TCPStore, ops: Ops):
        self._store, self._ops = store, ops

    def __getattr__(self, name: str):
        fn = getattr(self._store, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            self._ops.n += 1
            return fn(*args, **kwargs)

        return call


class SimMonitor(monitor_mod.Monitor):
    """The real monitor; seeing a failure ends the thread (not the process), polls are counted."""

    seen_at: float | None = None
    reported_at: float | None = None
    polls = 0

    def _tick(self, store):
        self.polls += 1
        super()._tick(store)

    def _stopped_by(self, cause, store):
        self.ch.record_failure(self.ch.stopped(cause))
        self.ch.ack_failure(store)
        self.seen_at = time.monotonic()
        self._stop.set()

    def _write_report(self, report):
        self.reported_at = time.monotonic()


def environ(rank: int, n: int, per_node: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"bench{n}", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0"}


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


def wait_until(what, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got is not None:
            return got
        time.sleep(0.02)
    return None


def one_size(n: int, per_node: int, port: int, seconds: float, run_dir: str) -> dict[str, float]:
    ops = Ops()
    wenv = WorkerEnv(run_dir=run_dir, stall_timeout=STALL_S, stall_end=3600.0, join_timeout=120.0)

    def new_client():
        return Counted(TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                timeout=timedelta(seconds=120)), ops)

    # every client made before the ranks start, 64 at a time: connecting is a start-up cost, not the
    # steady one measured. (Here about one TCPStore connect in 50 takes 5.0 s, the resolver's timeout
    # on this machine: "The hostname of the client socket cannot be retrieved. err=-3".)
    with ThreadPoolExecutor(64) as connect:
        pool = list(connect.map(lambda _: new_client(), range(2 * n)))
    channels = [JobChannel(environ(r, n, per_node, port), wenv, script=None, connect=pool.pop) for r in range(n)]
    checks: list[float] = []
    real_checks = preflight.run_checks
    timed(preflight, "run_checks", checks)  # announce() calls it by its module-global name
    t0 = time.monotonic()
    try:
        run_all([ch.start for ch in channels], timeout=300)
    finally:
        preflight.run_checks = real_checks
    preflight_s, gather_s = time.monotonic() - t0, checks[0]
    verdict = channels[0].store.get(channels[0].keys.preflight).decode(errors="replace")
    if verdict != "ok":
        raise RuntimeError(f"the simulated job's preflight failed: {verdict}")
    monitors = [SimMonitor(ch) for ch in channels]
    window: list[float] = []
    timed(monitors[0], "_timings", window)
    timed(monitors[0].stragglers, "update", window)
    for m in monitors:
        m.start()
    training = threading.Event()
    training.set()

    def train():
        while training.is_set():
            PROGRESS.steps += 1
            time.sleep(0.05)

    driver = threading.Thread(target=train, daemon=True)
    driver.start()
    time.sleep(2.0)  # every monitor is in its loop
    ops0, polls0, t0 = ops.n, sum(m.polls for m in monitors), time.monotonic()
    time.sleep(seconds)
    took = time.monotonic() - t0
    steady_ops, polls = (ops.n - ops0) / took, (sum(m.polls for m in monitors) - polls0) / took / n
    rank0_window = sum(window) / max(1, len(window) // 2)  # a window = one read of the timings + one check
    training.clear()
    driver.join()
    stalled = time.monotonic()
    reported = wait_until(lambda: next((m.reported_at for m in monitors if m.reported_at), None),
                          timeout=STALL_S * 2 + 30)
    PROGRESS.steps += 1  # progress again: the observers re-arm
    failing = channels[-1]
    t_fail = time.monotonic()
    failer = threading.Thread(target=failing.record_failure, args=(failing.me(fr.ERROR, "RuntimeError: injected"),),
                              daemon=True)
    failer.start()
    others = monitors[:-1]
    seen = wait_until(lambda: max(m.seen_at for m in others) if all(m.seen_at for m in others) else None,
                      timeout=60)
    for m in monitors:
        m.stop()
    for m in monitors:  # each ends within a poll; the server must outlive every call in flight
        m._thread.join(timeout=5)
    failer.join(timeout=10)
    return {"ops": steady_ops, "ops_rank": steady_ops / n, "polls": polls, "window_ms": 1000 * rank0_window,
            "preflight_s": preflight_s, "gather_s": gather_s,
            "stall_s": (reported - stalled) if reported else float("nan"),
            "failure_s": (seen - t_fail) if seen else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 4,096 and 8,192 are the goal; with today's protocol their preflight alone takes many minutes
    # here (every waiting rank polls the verdict key every 20 ms), so they are not run by default
    p.add_argument("--ranks", default="64,256,1024", help="simulated job sizes (default 64,256,1024)")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds of steady training measured per size")
    p.add_argument("--nproc-per-node", type=int, default=8)
    args = p.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * max(sizes) + 1024)), hard))
    monitor_mod.summarize = lambda records: dict(WINDOW)  # every simulated rank has a window to publish
    stacks.dump_stacks = lambda path: None
    stacks.main_thread_place = lambda: {"where": "in all_reduce", "user_frame": "train.py:40 in step",
                                        "frames": ["train.py:40 in step"]}
    # a node's facts (package hash, addresses, ...) are computed once per node, in parallel on real
    # nodes; serialized here they would be most of preflight's time: computed once, the same on every node
    facts = preflight.node_facts({}, None)
    preflight.node_facts = lambda environ, script: {
        **facts, "node_rank": int(environ["GROUP_RANK"]), "nproc": int(environ["LOCAL_WORLD_SIZE"]),
        "host": f"node{environ['GROUP_RANK']}", "run_id": environ["TORCHELASTIC_RUN_ID"]}
    print(f"{'ranks':>6} {'ops/s':>8} {'ops/s/rank':>10} {'polls/s/rank':>12} {'rank0 window':>12} "
          f"{'preflight':>9} {'gather':>7} {'stall->report':>13} {'failure->all':>12}", flush=True)
    for n in sizes:
        server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        try:
            port = int(server.stdout.readline())
            with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                os.makedirs(os.path.join(run_dir, "logs"))
                r = one_size(n, min(args.nproc_per_node, n), port, args.seconds, run_dir)
        finally:
            server.kill()
            server.wait()
        print(f"{n:>6} {r['ops']:>8.0f} {r['ops_rank']:>10.2f} {r['polls']:>12.2f} {r['window_ms']:>10.1f}ms "
              f"{r['preflight_s']:>8.2f}s {r['gather_s']:>6.2f}s {r['stall_s'] - STALL_S:>+11.2f}s* "
              f"{r['failure_s']:>11.2f}s", flush=True)
    print(f"* seconds past the {STALL_S:g} s stall threshold. One run per size.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
