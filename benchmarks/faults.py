"""The fault matrix, ddprun next to plain torchrun: for each fault, the seconds from the fault to the
last node's exit, whether every node named the cause, each node's exit code, the processes left.

2 nodes x 1 process on 127.0.0.1 (c10d, gloo), tests/faults/scripts/job.py (plain torch.distributed)
under each launcher with the same flags; each scenario is cut at its bound (then every process is
killed: "> N s"). The clock starts at the fault: the signal sent, or for a fault of the job itself
its raise (at step 3: two 0.3 s steps after the first, whose end the job marks), its first step
(an atexit handler that hangs after training), or the launch (a full disk under the run directory:
the first write fails).

    python benchmarks/faults.py [--only worker-kill-0,agent-term] [--bound 60] [--keep DIR]

"named": every node that was not SIGKILLed (or SIGSTOPped) printed the cause (the rank, the node, the signal, the
error); for an elastic job that lost a node that is not the store's host, the survivor exiting 0.
The full-disk scenario mounts a tmpfs (root only; skipped otherwise).
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.faults.conftest import parent_of, processes_in  # noqa: E402
from tests.helpers import DDPRUN, TORCHRUN, free_port, job_env  # noqa: E402

JOB = str(Path(__file__).resolve().parents[1] / "tests" / "faults" / "scripts" / "job.py")
SLOW = ("--step-s", "0.1", "--steps", "3000")
RAISE_STEP_S = 0.3


@dataclass(frozen=True)
class Scenario:
    what: str
    fault: str
    """kill-worker, kill-agent, term-agent, int3-agent (3 SIGINTs 0.3 s apart), stop-agent (SIGSTOP;
    the others' last exit is timed, then it gets SIGCONT), or the clock's start
    for a fault of the job itself: raise (2 x RAISE_STEP_S after the first step), first-step, launch."""
    target: str = "rank1"
    """Whose worker or agent: rank0, rank1 (by rank), host, other (the endpoint store's host or not)."""
    cause: str = ""
    """What every node that was not SIGKILLed prints (a regex); "exit 0": the survivors exit 0."""
    job: tuple[str, ...] = SLOW
    elastic: bool = False
    disk: bool = False
    bound: float | None = None


LOST = r"was lost|stopped answering"
SCENARIOS = {
    "worker-kill-0": Scenario("SIGKILL of rank 0's worker (what the OOM killer does)", "kill-worker", "rank0",
                              r"(?s)(?=.*\brank\s*:?\s*0\b)(?=.*(SIGKILL|Signal 9))"),
    "worker-kill-1": Scenario("SIGKILL of rank 1's worker", "kill-worker", "rank1",
                              r"(?s)(?=.*\brank\s*:?\s*1\b)(?=.*(SIGKILL|Signal 9))"),
    "agent-kill-host": Scenario("SIGKILL of the agent that hosts the endpoint's store", "kill-agent", "host", LOST),
    "agent-kill-other": Scenario("SIGKILL of the other agent", "kill-agent", "other", LOST),
    "agent-stop-host": Scenario("SIGSTOP of the agent that hosts the endpoint's store (timed: the others)",
                                "stop-agent", "host", LOST + "|job store was lost"),
    "agent-term": Scenario("SIGTERM to rank 1's agent", "term-agent", "rank1", r"stopped by SIGTERM"),
    "agent-term-ignored": Scenario("SIGTERM to rank 1's agent, its worker ignores SIGTERM", "term-agent", "rank1",
                                   r"stopped by SIGTERM", job=(*SLOW, "--ignore-sigterm")),
    "agent-int3": Scenario("3 x SIGINT to rank 1's agent, its worker ignores SIGTERM", "int3-agent", "rank1",
                           r"stopped by SIGINT|interrupted", job=(*SLOW, "--ignore-sigterm")),
    "raise-0": Scenario("rank 0 raises (its node hosts the workers' store and ends first)", "raise", "rank0",
                        "injected failure on rank 0", job=("--raise-rank", "0", "--step-s", str(RAISE_STEP_S))),
    "raise-1": Scenario("rank 1 raises", "raise", "rank1", "injected failure on rank 1",
                        job=("--raise-rank", "1", "--step-s", str(RAISE_STEP_S))),
    "atexit-hang": Scenario("every rank's atexit handler never returns (after 3 steps)", "first-step", "rank0",
                            "atexit handler did not return", job=("--steps", "3", "--step-s", "0", "--atexit-hang"),
                            bound=90),
    "full-disk": Scenario("the disk under the run directory (ddprun) / log dir (torchrun) is full", "launch",
                          "rank0", "No space left on device",
                          job=("--steps", "50", "--step-s", "0.01", "--write-mb", "0.1"), disk=True),
    "elastic-lose-host": Scenario("--nnodes 1:2 --max-restarts 2 loses the store host's agent (SIGKILL)",
                                  "kill-agent", "host", LOST, job=("--steps", "100", "--step-s", "0.1"), elastic=True),
    "elastic-lose-other": Scenario("--nnodes 1:2 --max-restarts 2 loses the other agent (SIGKILL); 10 s of "
                                   "training left", "kill-agent", "other", "exit 0",
                                   job=("--steps", "100", "--step-s", "0.1"), elastic=True),
}


def command(launcher: str, port: int, pids: Path, sc: Scenario, disk: Path | None) -> list[str]:
    head = [DDPRUN, "run"] if launcher == "ddprun" else [TORCHRUN]
    nnodes = ["--nnodes", "1:2", "--max-restarts", "2"] if sc.elastic else ["--nnodes", "2"]
    if disk is not None:  # where each launcher writes the workers' output
        head += ["--run-dir", str(disk / "run")] if launcher == "ddprun" else ["--log-dir", str(disk / "logs"),
                                                                             "--redirects", "3"]
    return [*head, *nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "bench", JOB, "--pids", str(pids), *sc.job]


def wait_pids(pids: Path, procs: list[subprocess.Popen], bound: float) -> dict[int, int] | None:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        files = [pids / f"rank-{r}.pid" for r in (0, 1)]
        if all(f.exists() and f.read_text() for f in files):
            return {r: int(f.read_text()) for r, f in enumerate(files)}
        if any(p.poll() is not None for p in procs):
            return None
        time.sleep(0.05)
    return None


def store_host(port: int, procs: list[subprocess.Popen]) -> int:
    """The node whose agent listens on the rendezvous port (it hosts the endpoint's store)."""
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    for i, p in enumerate(procs):
        if f"pid={p.pid}," in out:
            return i
    raise RuntimeError(f"no agent listens on port {port} (ss: {out.strip()!r}): cannot tell the store's host")


def victim(sc: Scenario, port: int, pids: dict[int, int], procs: list[subprocess.Popen]) -> tuple[int, int]:
    """(node index, pid) of what the fault hits: a worker, or a node's agent."""
    if sc.target in ("host", "other"):
        host = store_host(port, procs)
        node = host if sc.target == "host" else 1 - host
        return node, procs[node].pid
    rank = int(sc.target[-1])
    node = next(i for i, p in enumerate(procs) if p.pid == parent_of(pids[rank]))
    return node, pids[rank] if sc.fault == "kill-worker" else procs[node].pid


def inject(sc: Scenario, port: int, pids: dict[int, int], procs: list[subprocess.Popen]) -> tuple[float, int | None]:
    """Hurt the job as ``sc`` says (``pids``: seen at the first step); (when the fault happened, the
    node SIGKILLed or None)."""
    if sc.fault == "raise":
        return time.monotonic() + 2 * RAISE_STEP_S, None
    if sc.fault == "first-step":
        return time.monotonic(), None
    node, pid = victim(sc, port, pids, procs)
    sig = {"kill-worker": signal.SIGKILL, "kill-agent": signal.SIGKILL, "term-agent": signal.SIGTERM,
           "int3-agent": signal.SIGINT, "stop-agent": signal.SIGSTOP}[sc.fault]
    t0 = time.monotonic()
    for _ in range(3 if sc.fault == "int3-agent" else 1):
        os.kill(pid, sig)
        time.sleep(0.3 if sc.fault == "int3-agent" else 0)
    return t0, node if sc.fault in ("kill-agent", "stop-agent") else None


@dataclass
class Result:
    last_exit: float | None
    """Seconds from the fault to the last node's exit; None: cut at the bound."""
    named: bool
    codes: list[int | None]
    left: int
    injected: bool = True
    """False: the job never trained, so nothing was hurt (the time is launch -> exit, not fault -> exit)."""


def judge(sc: Scenario, outs: list[Path], procs: list[subprocess.Popen], killed: int | None) -> bool:
    survivors = [i for i in range(len(procs)) if i != killed]
    if sc.cause == "exit 0":
        return all(procs[i].returncode == 0 for i in survivors)
    texts = [outs[i].read_text(errors="replace") for i in survivors]
    return all(re.search(sc.cause, t) for t in texts)


def run(launcher: str, sc: Scenario, bound: float, cwd: Path, disk: Path | None, keep: Path | None) -> Result:
    pids = cwd / "pids"
    pids.mkdir()
    outs = [cwd / f"node-{i}.out" for i in (0, 1)]
    port = free_port()
    cmd = command(launcher, port, pids, sc, disk)
    procs = [subprocess.Popen(cmd, cwd=cwd, env=job_env(), stdout=open(out, "w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for out in outs]
    t0, killed, injected = time.monotonic(), None, True
    if sc.fault != "launch":
        found = wait_pids(pids, procs, 60)
        injected = found is not None
        if found is not None:
            t0, killed = inject(sc, port, found, procs)
    timed = [p for i, p in enumerate(procs) if not (sc.fault == "stop-agent" and i == killed)]
    deadline = t0 + bound
    while time.monotonic() < deadline and any(p.poll() is None for p in timed):
        time.sleep(0.05)
    last = time.monotonic() - t0 if all(p.poll() is not None for p in timed) else None
    if sc.fault == "stop-agent" and killed is not None:  # thawed: it may end by itself
        os.kill(procs[killed].pid, signal.SIGCONT)
        try:
            procs[killed].wait(20)
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    time.sleep(1)
    left = processes_in(cwd)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    if keep is not None:
        for i, out in enumerate(outs):
            (keep / f"{launcher}-node-{i}.out").write_bytes(out.read_bytes())
    return Result(last, judge(sc, outs, procs, killed), [p.returncode for p in procs], len(left), injected)


def full_disk(under: Path) -> Path | None:
    """A 2 MiB tmpfs with about 64 KiB free (as tests/faults/test_exits.py), or None without root."""
    mnt = under / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                                timeout=30).returncode:
        return None
    with open(mnt / "filler", "wb") as fp:
        fp.write(b"\0" * ((2 << 20) - (64 << 10)))
    return mnt


def measure(launcher: str, sc: Scenario, bound: float, keep: Path | None) -> Result | None:
    with tempfile.TemporaryDirectory() as tmp:
        disk = full_disk(Path(tmp)) if sc.disk else None
        if sc.disk and disk is None:
            return None
        try:
            return run(launcher, sc, bound, Path(tmp), disk, keep)
        finally:
            if disk is not None:
                subprocess.run(["umount", "-l", str(disk)], timeout=30)


def cell(r: Result | None, bound: float) -> str:
    if r is None:
        return f"{'(needs root)':>34}"
    if not r.injected:
        return f"{'(never trained: no fault)':>34}"
    took = f"{r.last_exit:.1f} s" if r.last_exit is not None else f"> {bound:.0f} s"
    codes = ",".join("-" if c is None else str(c) for c in r.codes)
    return f"{took:>8} {'yes' if r.named else 'no':>5} {codes:>9} {r.left:>4}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bound", type=float, default=60.0, help="seconds from the fault (some scenarios set more)")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--keep", type=Path, default=None, help="keep every node's console here (DIR/SCENARIO/)")
    args = ap.parse_args()
    chosen = [s for s in SCENARIOS if not args.only or s in args.only.split(",")]
    head = f"{'last exit':>8} {'named':>5} {'exit codes':>9} {'left':>4}"
    print(f"{'':20} {'ddprun':^29}   {'torchrun':^29}\n{'scenario':20} {head}   {head}")
    for name in chosen:
        sc = SCENARIOS[name]
        bound = sc.bound or args.bound
        keep = args.keep / name if args.keep else None
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
        cells = [cell(measure(launcher, sc, bound, keep), bound) for launcher in ("ddprun", "torchrun")]
        print(f"{name:20} {cells[0]}   {cells[1]}   {sc.what}", flush=True)


if __name__ == "__main__":
    main()
