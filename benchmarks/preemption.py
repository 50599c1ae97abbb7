"""A preemption signal beside the anchor: steps lost and the time from the signal to every node's exit,
``ddprun run`` against plain torchrun on the same job and the same signal.

    python benchmarks/preemption.py [--reps 3] [--signal TERM] [--signal-step 15] [--checkpoint-every 10]

2 nodes x 1 process on 127.0.0.1 (gloo), tests/multiprocess/scripts/fit_restart.py: ddprun.fit of a
small MLP with a periodic checkpoint; rank 1 sends itself the signal during step --signal-step + 1.
Steps lost = the steps done when the signal came - the step of the newest checkpoint the run left
(what the same command resumes from; 0 when the job checkpointed at or after the signal). torchrun's
agent forwards SIGTERM and the workers die: the work since the last periodic checkpoint is lost.
Medians over --reps, both launchers alternating.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import DDPRUN, describe, free_port, run_agents  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parents[1] / "tests" / "multiprocess" / "scripts" / "fit_restart.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def one_run(tmp: Path, launcher: str, args) -> dict[str, float]:
    out, marker = tmp / "out", tmp / "signalled"
    port = free_port()
    job = [SCRIPT, "--out", str(out), "--steps", str(args.steps), "--step-sleep", str(args.step_sleep),
           "--checkpoint-every", str(args.checkpoint_every), "--signal-rank", "1", "--signal-step",
           str(args.signal_step), "--send-signal", args.signal, "--marker", str(marker)]
    if launcher == "ddprun":
        cmd = [DDPRUN, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "preempt", "--log-dir", str(tmp / "runs"), *job]
    else:
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "preempt", *job]
    start = time.time()
    results = run_agents([cmd, cmd], timeout=180, cwd=tmp)
    if not marker.exists():
        raise RuntimeError(f"{launcher}: the signal was never sent:\n" + describe(results))
    sent = float(marker.read_text().split(" at ")[1])
    steps = [int(m.group(1)) for p in tmp.rglob("step-*.pt") if (m := re.match(r"step-(\d+)\.pt", p.name))]
    newest = max(steps, default=0)
    return {"lost": max(0, args.signal_step - newest), "newest": newest,
            "to_exit": start + max(r.wall_s for r in results) - sent, "codes": tuple(r.returncode for r in results)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--signal", default="TERM")
    p.add_argument("--signal-step", type=int, default=15)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    args = p.parse_args()
    got: dict[str, list[dict]] = {"torchrun": [], "ddprun": []}
    for i in range(args.reps):
        for launcher in ("torchrun", "ddprun"):
            with tempfile.TemporaryDirectory() as tmp:
                r = one_run(Path(tmp), launcher, args)
            got[launcher].append(r)
            print(f"run {i + 1} {launcher:8}: exit codes {r['codes']}, newest checkpoint step {r['newest']}, "
                  f"{r['lost']} step(s) lost, signal -> last exit {r['to_exit']:.1f} s", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("lost", "to_exit")} for k, v in got.items()}
    print(f"\n2 x 1, gloo, SIG{args.signal} to rank 1 after step {args.signal_step}, checkpoint every "
          f"{args.checkpoint_every}, median of {args.reps}:")
    for k in ("torchrun", "ddprun"):
        print(f"  {k:8}: {med[k]['lost']:.0f} step(s) lost, signal -> last exit {med[k]['to_exit']:.1f} s")
    t = med["torchrun"]["to_exit"]
    print(f"  ddprun/torchrun time to exit: {med['ddprun']['to_exit'] / t:.2f}x" if t else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
