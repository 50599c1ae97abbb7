"""What the tools ddprun replaces do in the situations the README compares, measured here, ddprun
beside them where ddprun has an answer:

  spawn        a function defined in ``__main__`` of ``python -c`` (as in a notebook), started on 2
               processes by torch.multiprocessing.spawn, and by ddprun.launch
  devices-1    Lightning's Trainer(devices=1) under plain torchrun 1 x 2 (and under ddprun run):
               how many ranks each process trains with, and whether it exits 0
  restart      a worker SIGKILLed at step 4 of 12 under --max-restarts 1, 2 nodes x 1 on 127.0.0.1
               (ddprun.fit with checkpoints, tests/multiprocess/scripts/fit_restart.py): does the
               restarted group finish, under torchrun and under ddprun run?
  outlives     a DDP model freed after destroy_process_group, 1 x 2, gloo, five runs a launcher
               (tests/multiprocess/scripts/ddp_outlives_group.py): do the ranks exit, or hang?

    python benchmarks/anchors.py [--only spawn,devices-1,restart,outlives] [--bound 90]

Each run is cut at --bound seconds. Nothing here is timed for a ratio: it records behaviour.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.faults.conftest import processes_in  # noqa: E402
from tests.helpers import TORCHRUN, ddprun_nodes, free_port, job_env  # noqa: E402

TESTS = Path(__file__).resolve().parents[1] / "tests"
BORING = str(TESTS / "integrations" / "scripts" / "boring_unmodified.py")
FIT_RESTART = str(TESTS / "multiprocess" / "scripts" / "fit_restart.py")
OUTLIVES = str(TESTS / "multiprocess" / "scripts" / "ddp_outlives_group.py")

SPAWN = """
import torch.multiprocessing as mp
def train(rank):
    print(f"rank {rank} trains", flush=True)
mp.spawn(train, nprocs=2)
"""
LAUNCH = """
import ddprun
def train():
    return ddprun.rank_info().rank
print("ranks", sorted(ddprun.launch(train, nproc_per_node=2, return_all=True).values()), flush=True)
"""


def run_all(cmds: list[list[str]], bound: float, cwd: Path) -> tuple[list[int | None], str]:
    """Start every command at once, each in its own session, output to a file (a worker that
    outlives its launcher must not hold a pipe); after ``bound`` s kill what still runs, also
    processes that left the launcher's group (torchrun starts each worker in a session of its own):
    every process whose working directory is ``cwd``. (exit codes, None: killed at the bound; the
    outputs joined)."""
    outs = [cwd / f"out-{i}.txt" for i in range(len(cmds))]
    procs = [subprocess.Popen(c, cwd=cwd, env=job_env(), stdout=open(o, "w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for c, o in zip(cmds, outs)]
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    for pid in [p.pid for p in procs if p.poll() is None] + processes_in(cwd):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait(10)
    return codes, "\n".join(o.read_text(errors="replace") for o in outs)


def last_line(text: str, needle: str) -> str:
    """The last output line containing ``needle`` (shortened), or a note that none did."""
    hits = [line.strip() for line in text.splitlines() if needle in line]
    return hits[-1][:110] if hits else f"(no line with {needle!r})"


def spawn(bound: float, tmp: Path) -> dict[str, str]:
    got = {}
    for name, code, needle in (("torch mp.spawn", SPAWN, "Error"), ("ddprun.launch", LAUNCH, "ranks")):
        try:
            r = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=job_env(), capture_output=True,
                               text=True, timeout=bound)
            got[name] = f"exit {r.returncode}: {last_line(r.stdout + r.stderr, needle)}"
        except subprocess.TimeoutExpired:
            got[name] = f"still running after {bound:.0f} s"
    return got


def devices_1(bound: float, tmp: Path) -> dict[str, str]:
    got = {}
    trainer = ["--devices", "1", "--num-nodes", "1", "--strategy", "auto", "--max-steps", "5"]
    for name in ("torchrun", "ddprun"):
        # each process that trains as global rank 0 appends a line to the stamp file at its first batch
        out, stamp = tmp / f"facts-{name}", tmp / f"stamp-{name}"
        script = [BORING, *trainer, "--out", str(out), "--stamp", str(stamp)]
        cmd = ([TORCHRUN, "--standalone", "--nproc-per-node", "2", *script]
               if name == "torchrun" else ddprun_nodes(1, 2, script, rdzv_id="dev1")[0])
        (code,), output = run_all([cmd], bound, tmp)
        as_rank_0 = len(stamp.read_text().splitlines()) if stamp.exists() else 0
        worlds = sorted({json.loads(p.read_text())["world_size"] for p in out.glob("rank-*.json")}) if out.exists() else []
        said = last_line(output, "Trainer devices=1") if name == "ddprun" else ""
        got[name] = (f"exit {code}; processes that trained as global rank 0: {as_rank_0} of 2, "
                     f"world sizes they saw: {worlds or 'none'}" + (f"; {said}" if said else ""))
    return got


def restart(bound: float, tmp: Path) -> dict[str, str]:
    got = {}
    for name in ("torchrun", "ddprun"):
        out, marker = tmp / f"restart-{name}", tmp / f"killed-{name}"
        job = [FIT_RESTART, "--out", str(out), "--steps", "12", "--checkpoint-every", "3", "--kill-rank", "1",
               "--kill-step", "4", "--marker", str(marker), "--step-sleep", "0.1"]
        if name == "ddprun":
            cmds = ddprun_nodes(2, 1, job, rdzv_id="anchor-restart", extra=["--max-restarts", "1"])
        else:
            port = free_port()
            cmds = [[TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend",
                     "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "anchor-restart", *job]] * 2
        codes, both = run_all(cmds, bound, tmp)
        finished = sorted(p.name for p in out.glob("params-*.pt")) if out.exists() else []
        why = next((w for w in ("connectFullMesh", "Connection refused", "Connection reset", "timed out", "Timeout")
                    if w in both), "")
        got[name] = (f"exit codes {codes} (None: still running at {bound:.0f} s); ranks that finished: "
                     f"{len(finished)} of 2" + (f"; the output says {why!r}" if why else ""))
    return got


def outlives(bound: float, tmp: Path) -> dict[str, str]:
    got = {}
    for name in ("torchrun", "ddprun"):
        cmd = ([TORCHRUN, "--standalone", "--nproc-per-node", "2", OUTLIVES] if name == "torchrun"
               else ddprun_nodes(1, 2, [OUTLIVES], rdzv_id="anchor-outlives")[0])
        codes = []
        for i in range(5):
            run = tmp / f"{name}-{i}"
            run.mkdir()
            (code,), _ = run_all([cmd], min(bound, 30), run)
            codes.append(code)
        got[name] = (f"exit codes of 5 runs {codes} (None: hung, killed at {min(bound, 30):.0f} s)")
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated: spawn,devices-1,restart,outlives")
    p.add_argument("--bound", type=float, default=90)
    args = p.parse_args()
    scenarios = {"spawn": spawn, "devices-1": devices_1, "restart": restart, "outlives": outlives}
    only = [k for k in args.only.split(",") if k]
    unknown = sorted(set(only) - set(scenarios))
    if unknown:
        p.error(f"--only: unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(scenarios)}")
    with tempfile.TemporaryDirectory() as tmp:
        for key in only or scenarios:
            scratch = Path(tmp, key)
            scratch.mkdir()
            for name, seen in scenarios[key](args.bound, scratch).items():
                print(f"{key:10s} {name:15s} {seen}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
