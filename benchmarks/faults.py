"""The fault matrix, ddprun next to plain torchrun: for each fault, the seconds from the fault to the
last node's exit, whether every node named the right cause, and the processes left behind.

2 nodes x 1 process on 127.0.0.1 (c10d, gloo), tests/faults/scripts/job.py training slowly; each
scenario is cut at --bound seconds (then the launcher is killed: "> N s").

    python benchmarks/faults.py [--bound 60] [--only worker-kill-0,agent-term]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.faults.conftest import parent_of, processes_in  # noqa: E402
from tests.helpers import DDPRUN, TORCHRUN, free_port, job_env  # noqa: E402

JOB = str(Path(__file__).resolve().parents[1] / "tests" / "faults" / "scripts" / "job.py")
SCENARIOS = {
    "worker-kill-0": "SIGKILL of rank 0's worker (its node hosts the workers' store)",
    "worker-kill-1": "SIGKILL of rank 1's worker",
    "agent-kill-0": "SIGKILL of rank 0's agent",
    "agent-kill-1": "SIGKILL of rank 1's agent",
    "agent-term-1": "SIGTERM to rank 1's agent",
    "raise-0": "rank 0 raises (its node ends first)",
}


def command(launcher: str, port: int, pids: Path, extra: list[str]) -> list[str]:
    job = [JOB, "--pids", str(pids), "--step-s", "0.1", "--steps", "3000", *extra]
    head = [DDPRUN, "run"] if launcher == "ddprun" else [TORCHRUN]
    return [*head, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench", *job]


def wait_pids(pids: Path, procs: list[subprocess.Popen], bound: float) -> dict[int, int] | None:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        files = [pids / f"rank-{r}.pid" for r in (0, 1)]
        if all(f.exists() and f.read_text() for f in files):
            return {r: int(f.read_text()) for r, f in enumerate(files)}
        if any(p.poll() is not None for p in procs):
            return None
        time.sleep(0.1)
    return None


def hurt(scenario: str, pids: dict[int, int], procs: list[subprocess.Popen]) -> None:
    rank = int(scenario[-1])
    agent = next(p for p in procs if p.pid == parent_of(pids[rank]))
    if scenario.startswith("worker-kill"):
        os.kill(pids[rank], signal.SIGKILL)
    elif scenario.startswith("agent-kill"):
        os.kill(agent.pid, signal.SIGKILL)
    elif scenario.startswith("agent-term"):
        os.kill(agent.pid, signal.SIGTERM)


def named(scenario: str, outputs: list[str], survivors: list[int]) -> bool:
    """Does every surviving node's output name the cause (the rank or the node of the fault)?"""
    rank = scenario[-1]
    texts = [outputs[i] for i in survivors]
    if scenario.startswith("worker-kill"):
        return all(re.search(rf"rank\s*:?\s*{rank}\b", t) and re.search("SIGKILL|Signal 9", t) for t in texts)
    if scenario == "raise-0":
        return all("injected failure on rank 0" in t for t in texts)
    return all(re.search(r"was lost|stopped answering|stopped by SIGTERM", t) for t in texts)


def run(launcher: str, scenario: str, bound: float) -> tuple[float | None, bool, int]:
    with tempfile.TemporaryDirectory() as tmp:
        cwd, pids = Path(tmp), Path(tmp) / "pids"
        pids.mkdir()
        extra = ["--raise-rank", "0", "--step-s", "0.3"] if scenario == "raise-0" else []
        outs = [cwd / f"node-{i}.out" for i in (0, 1)]
        cmd = command(launcher, free_port(), pids, extra)
        procs = [subprocess.Popen(cmd, cwd=cwd, env=job_env(), stdout=open(out, "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True) for out in outs]
        t0 = time.monotonic()
        if scenario != "raise-0":
            found = wait_pids(pids, procs, 60)
            if found is None:
                return None, False, 0
            hurt(scenario, found, procs)
            t0 = time.monotonic()
        deadline = t0 + bound
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        elapsed = time.monotonic() - t0 if all(p.poll() is not None for p in procs) else None
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        time.sleep(1)
        left = processes_in(cwd)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        texts = [o.read_text(errors="replace") for o in outs]
        survivors = [i for i, p in enumerate(procs) if p.returncode != -signal.SIGKILL]
        return elapsed, named(scenario, texts, survivors), len(left)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bound", type=float, default=60.0)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args()
    chosen = [s for s in SCENARIOS if not args.only or s in args.only.split(",")]
    print(f"{'scenario':16} {'ddprun: last exit':>18} {'named':>6} {'left':>5}   {'torchrun: last exit':>20} "
          f"{'named':>6} {'left':>5}")
    for scenario in chosen:
        row = []
        for launcher in ("ddprun", "torchrun"):
            elapsed, ok, left = run(launcher, scenario, args.bound)
            row.append((f"{elapsed:.1f} s" if elapsed is not None else f"> {args.bound:.0f} s", ok, left))
        (d, dn, dl), (t, tn, tl) = row
        print(f"{scenario:16} {d:>18} {'yes' if dn else 'no':>6} {dl:>5}   {t:>20} {'yes' if tn else 'no':>6} {tl:>5}"
              f"   {SCENARIOS[scenario]}")


if __name__ == "__main__":
    main()
