"""How fast each launcher names what is wrong, ddprun next to plain torchrun, on the same bounded
scenarios (2 nodes on 127.0.0.1, gloo, examples/torchrun_style.py):

  missing node    the second node never starts: seconds until a message names the situation
  stalled rank    rank 3 sleeps before an all-reduce: seconds from the stall to a report naming it
  mismatch        nodes started with --nproc-per-node 2 and 1: named, or "succeeded" on WORLD_SIZE=3?
  second job      a 2-node job started on the endpoint of a shorter one that trains (another run
                  id): refused, or does it run on that job's store and end with it?
  same command    the job's own command started once more while it runs (a retry on one node):
                  refused, or left waiting (torch's redundancy list)?
  late node       an elastic job with room (--nnodes 1:3, 2 running) and a third node of the job
                  arrives: does every node train on and exit 0?

    python benchmarks/detection.py [--bound 60] [--stall-timeout 10] [--only late,same]

Each scenario is cut at --bound seconds; "none within N s" means the launcher said nothing useful
by then (torchrun's own limits: 600 s join, 30 min gloo).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.faults.conftest import processes_in  # noqa: E402
from tests.helpers import DDPRUN, EXAMPLE, TORCHRUN, free_port, job_env  # noqa: E402

JOB = str(Path(__file__).resolve().parents[1] / "tests" / "faults" / "scripts" / "job.py")


class Streamed:
    """A process whose output lines are kept with the time they arrived."""

    def __init__(self, cmd: list[str], cwd: str):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.t0, line.rstrip()))

    def first(self, pattern: str) -> float | None:
        rx = re.compile(pattern)
        return next((t for t, line in list(self.lines) if rx.search(line)), None)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def cleaned(fn, name: str, tmp: str) -> str:
    """``fn(name)``, then every process still in ``tmp`` killed: torch starts workers in their own
    sessions, out of reach of the launcher's group kill, and a stalled or still-waiting job's workers
    would otherwise load the CPUs under the next measurement."""
    try:
        return fn(name)
    finally:
        time.sleep(0.5)  # a worker whose agent just died ends by itself (PR_SET_PDEATHSIG)
        for pid in processes_in(Path(tmp)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def wait_until(cond, bound: float) -> None:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and not cond():
        time.sleep(0.1)


def launcher(name: str, nnodes: int | str, nproc: int, port: int, rdzv_id: str, extra=()) -> list[str]:
    base = [DDPRUN, "run"] if name == "ddprun" else [TORCHRUN]
    return base + ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, *extra]


def missing_node(name: str, bound: float, tmp: str) -> str:
    p = Streamed(launcher(name, 2, 1, free_port(), f"miss-{name}") + [EXAMPLE], tmp)
    pattern = r"nodes joined|did not join|not every node|timed out|Timeout"
    wait_until(lambda: p.first(pattern) is not None or p.proc.poll() is not None, bound)
    t = p.first(pattern)
    p.kill()
    return f"{t:.1f} s" if t is not None else f"none within {bound:.0f} s"


def stalled_rank(name: str, bound: float, stall: float, tmp: str) -> str:
    port, rid = free_port(), f"stall-{name}"
    extra = ["--stall-timeout", str(stall)] if name == "ddprun" else []
    cmd = launcher(name, 2, 2, port, rid, extra) + [EXAMPLE, "--steps", "1000", "--hang-rank", "3"]
    procs = [Streamed(cmd, tmp), Streamed(cmd, tmp)]
    log = Path(tmp, "runs", rid, "logs", "rank-3.log")
    stall_at: list[float] = []

    def stalled() -> bool:  # rank 3 says "hangs" on the console (torchrun) or in its log (ddprun)
        if not stall_at:
            t = next((p.t0 + t for p in procs for t, line in list(p.lines) if "rank 3 hangs" in line), None)
            if t is None and log.exists() and "rank 3 hangs" in log.read_text(errors="replace"):
                t = time.monotonic()
            if t is not None:
                stall_at.append(t)
        return bool(stall_at)

    wait_until(stalled, bound)
    pattern = r"hang report|[Tt]imeout|timed out"
    wait_until(lambda: any(p.first(pattern) for p in procs) or all(p.proc.poll() is not None for p in procs),
               bound + stall)
    hits = [p.t0 + p.first(pattern) for p in procs if p.first(pattern) is not None]
    named = any("rank 3" in line for p in procs for _, line in p.lines if "hang report" in line)
    for p in procs:
        p.kill()
    if not stall_at:
        return "rank 3 never reached its stall"
    if not hits:
        return f"none within {bound + stall:.0f} s of the stall"
    return (f"{min(hits) - stall_at[0]:.1f} s after the stall (threshold {stall:.0f} s)"
            + (", names rank 3" if named else ""))


def mismatch(name: str, bound: float, tmp: str) -> str:
    port = free_port()
    procs = [Streamed(launcher(name, 2, n, port, f"mis-{name}") + [EXAMPLE, "--steps", "10"], tmp) for n in (2, 1)]
    wait_until(lambda: all(p.proc.poll() is not None for p in procs), bound)
    codes = [p.proc.poll() for p in procs]
    named = any("different numbers of processes" in line for p in procs for _, line in p.lines)
    for p in procs:
        p.kill()
    if named:
        return f"named, exit codes {codes}"
    return f"not named; exit codes {codes} (a WORLD_SIZE=3 job ran)" if codes == [0, 0] else f"exit codes {codes}"


def second_job(name: str, bound: float, tmp: str) -> str:
    """Job A (2 nodes, 100 steps of 0.1 s) trains; job B (2 nodes, another run id, 300 steps) is then
    started on A's endpoint. Refused at once, or does B run on A's rendezvous store and end with it?"""
    port, pids_a, pids_b = free_port(), Path(tmp, f"first-{name}"), Path(tmp, f"second-{name}")
    pids_a.mkdir()
    pids_b.mkdir()

    def job(rdzv_id: str, pids: Path, steps: int) -> list[Streamed]:
        cmd = launcher(name, 2, 1, port, rdzv_id) + [JOB, "--pids", str(pids), "--step-s", "0.1", "--steps", str(steps)]
        return [Streamed(cmd, tmp) for _ in range(2)]

    first = job(f"jobA-{name}", pids_a, 100)
    if not training(pids_a, 2, bound):
        for p in first:
            p.kill()
        return "job A did not start"
    second = job(f"jobB-{name}", pids_b, 300)
    wait_until(lambda: all(p.proc.poll() is not None for p in first), bound)
    a_codes, a_end = [p.proc.poll() for p in first], time.monotonic()
    wait_until(lambda: all(p.proc.poll() is not None for p in second), bound)
    b_codes, b_end = [p.proc.poll() for p in second], time.monotonic()
    trained = sum((pids_b / f"rank-{r}.pid").exists() for r in range(2))
    said = [t for t in (p.first("[Rr]efused") for p in second) if t is not None]
    for p in (*first, *second):
        p.kill()
    job_a = f"job A's exit codes {a_codes}"
    if said:
        return f"job B refused in {max(said):.1f} s (exit codes {b_codes}); {job_a}"
    if None in b_codes:
        return f"job B not refused, {trained} of 2 rank(s) trained, still running {bound:.0f} s after job A ended; {job_a}"
    return (f"job B not refused: {trained} of 2 rank(s) trained on job A's store, exit codes {b_codes} "
            f"{b_end - a_end:.1f} s after job A ended ({job_a})")


def training(pids: Path, ranks: int, bound: float) -> bool:
    """Every one of ``ranks`` ranks of JOB has made its first step (its pid file), within ``bound``."""
    def seen() -> bool:
        return all((pids / f"rank-{r}.pid").exists() and (pids / f"rank-{r}.pid").read_text() for r in range(ranks))
    wait_until(seen, bound)
    return seen()


def same_command(name: str, bound: float, tmp: str) -> str:
    port, pids = free_port(), Path(tmp, f"again-{name}")
    pids.mkdir()
    cmd = launcher(name, 2, 1, port, f"again-{name}") + [JOB, "--pids", str(pids), "--step-s", "0.1", "--steps", "3000"]
    job = [Streamed(cmd, tmp), Streamed(cmd, tmp)]
    if not training(pids, 2, bound):
        for p in job:
            p.kill()
        return "the job itself did not start"
    again = Streamed(cmd, tmp)
    wait_until(lambda: again.proc.poll() is not None, bound)
    code, refused, said = again.proc.poll(), again.first("[Rr]efused"), len(again.lines)
    for p in (*job, again):
        p.kill()
    if refused is not None:
        return f"refused in {refused:.1f} s (exit {code})"
    return f"not refused; {'still waiting' if code is None else f'exited {code}'} after {bound:.0f} s, {said} line(s)"


def late_node(name: str, bound: float, tmp: str) -> str:
    port, pids = free_port(), Path(tmp, f"late-{name}")
    pids.mkdir()
    # every rank trains until the world has 3 ranks, then 30 steps more (ended by the restart that takes it in)
    cmd = launcher(name, "1:3", 1, port, f"late-{name}", ["--max-restarts", "3", "--rdzv-conf", "last_call_timeout=2"]) + [
        JOB, "--pids", str(pids), "--step-s", "0.1", "--steps", "30", "--min-world", "3"]
    nodes = [Streamed(cmd, tmp), Streamed(cmd, tmp)]
    if not training(pids, 2, bound):
        for p in nodes:
            p.kill()
        return "the first two nodes did not start"
    t0 = time.monotonic()
    nodes.append(Streamed(cmd, tmp))
    wait_until(lambda: all(p.proc.poll() is not None for p in nodes), bound)
    codes, took = [p.proc.poll() for p in nodes], time.monotonic() - t0
    said = any("waits to join" in line for p in nodes for _, line in p.lines)
    for p in nodes:
        p.kill()
    if codes == [0, 0, 0]:
        return f"all 3 exited 0, {took:.1f} s after the third arrived" + (" (said: a node waits to join)" if said else "")
    running = sum(c is None for c in codes)
    return f"exit codes {codes}" + (f": {running} of 3 still running after {bound:.0f} s" if running else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bound", type=float, default=60)
    p.add_argument("--stall-timeout", type=float, default=10)
    p.add_argument("--only", default="", help="comma-separated: missing,stalled,mismatch,second,same,late")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        scenarios = {"missing": ("missing node", lambda n: missing_node(n, args.bound, tmp)),
                     "stalled": ("stalled rank", lambda n: stalled_rank(n, args.bound, args.stall_timeout, tmp)),
                     "mismatch": ("mismatched --nproc-per-node", lambda n: mismatch(n, args.bound, tmp)),
                     "second": ("second job, same endpoint", lambda n: second_job(n, args.bound, tmp)),
                     "same": ("same command again", lambda n: same_command(n, args.bound, tmp)),
                     "late": ("late node, elastic 1:3", lambda n: late_node(n, args.bound, tmp))}
        only = [k for k in args.only.split(",") if k]
        unknown = sorted(set(only) - set(scenarios))
        if unknown:
            p.error(f"--only: unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(scenarios)}")
        for key in only or scenarios:
            scenario, fn = scenarios[key]
            res = {n: cleaned(fn, n, tmp) for n in ("ddprun", "torchrun")}
            rows.append((scenario, res))
            print(f"{scenario:28s} ddprun: {res['ddprun']:45s} torchrun: {res['torchrun']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
