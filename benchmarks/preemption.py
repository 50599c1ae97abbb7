"""A preemption signal beside the anchors: steps lost and the time from the signal to every node's exit,
``ddprun run`` against plain torchrun, and ``ddprun.fit`` of a LightningModule against a plain
Lightning Trainer under torchrun, on the same job and the same signal.

    python benchmarks/preemption.py [--reps 3] [--signal TERM] [--signal-step 15] [--checkpoint-every 10]
        [--no-lightning]

2 nodes x 1 process on 127.0.0.1 (gloo). tests/multiprocess/scripts/fit_restart.py: ddprun.fit of a
small MLP with a periodic checkpoint; tests/integrations/scripts/lightning_fit.py: a LightningModule
with a ModelCheckpoint every --checkpoint-every steps (SIGTERM only). Rank 1 sends itself the signal
during step --signal-step + 1. Steps lost = the optimizer steps rank 0 had done when the job ended
- the step of the newest checkpoint the run left (what the same command resumes from). Steps done:
fit_restart.py's --timeline (one line per optimizer step of rank 0); ddprun.fit of a LightningModule:
the step its stop line names; a plain Trainer: --signal-step, the steps every rank had done when the
signal came during the next one (a lower bound, so its "lost" is one too). torchrun's agent forwards
SIGTERM and the workers die; Lightning's handler stops the signalled rank at its next batch without
a checkpoint. Either way the work since the last periodic checkpoint is lost. Medians over --reps,
the launchers alternating which goes first.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import DDPRUN, describe, free_port, run_agents  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parents[1] / "tests" / "multiprocess" / "scripts" / "fit_restart.py")
LIGHTNING = str(Path(__file__).resolve().parents[1] / "tests" / "integrations" / "scripts" / "lightning_fit.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PAIRS = (("torchrun", "ddprun"), ("lightning", "ddprun-lightning"))
"""(anchor, ddprun) rows: ddprun run against torchrun; ddprun.fit(lit_module) against a plain Trainer."""


def launch(tmp: Path, launcher: str, job: list[str]) -> list[str]:
    port = free_port()
    if launcher.startswith("ddprun"):
        return [DDPRUN, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "preempt", "--log-dir", str(tmp / "runs"), *job]
    return [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "preempt", *job]


def newest_step(tmp: Path) -> int:
    """The newest checkpoint's optimizer step: ddprun.fit's step-N.pt, or any Lightning .ckpt's global_step."""
    import torch

    steps = [int(m.group(1)) for p in tmp.rglob("step-*.pt") if (m := re.match(r"step-(\d+)\.pt", p.name))]
    steps += [int(torch.load(p, weights_only=True, map_location="cpu")["global_step"]) for p in tmp.rglob("*.ckpt")]
    return max(steps, default=0)


def one_run(tmp: Path, launcher: str, args) -> dict[str, float]:
    out, marker = tmp / "out", tmp / "signalled"
    signal = ["--signal-rank", "1", "--signal-step", str(args.signal_step), "--marker", str(marker)]
    if "lightning" in launcher:
        job = [LIGHTNING, "--out", str(out), "--steps", str(args.steps), "--step-sleep", str(args.step_sleep),
               "--checkpoint-every", str(args.checkpoint_every), *signal]
        if launcher == "lightning":
            job += ["--plain-trainer", str(tmp / "ckpt")]
    else:
        job = [SCRIPT, "--out", str(out), "--steps", str(args.steps), "--step-sleep", str(args.step_sleep),
               "--checkpoint-every", str(args.checkpoint_every), "--send-signal", args.signal, *signal,
               "--timeline", str(tmp / "timeline")]
    cmd = launch(tmp, launcher, job)
    start = time.time()
    try:
        results = run_agents([cmd, cmd], timeout=args.hang_after, cwd=tmp)
    except subprocess.TimeoutExpired:  # a launcher killed, its orphaned workers still hold the pipe
        results = None
    finally:
        kill_leftovers(tmp)
    if not marker.exists():
        raise RuntimeError(f"{launcher}: the signal was never sent:\n" + (describe(results) if results else ""))
    sent = float(marker.read_text().split(" at ")[1])
    newest = newest_step(tmp)
    hung = results is None or any(r.timed_out for r in results)
    done = steps_done(tmp, results, args.signal_step)
    return {"lost": max(0, done - newest), "done": done, "newest": newest, "hung": hung,
            "to_exit": float("inf") if hung else start + max(r.wall_s for r in results) - sent,
            "codes": ("hung",) if results is None else tuple(r.returncode for r in results)}


STOPPED = re.compile(r"every rank stopped after optimizer step (\d+)")


def steps_done(tmp: Path, results, signal_step: int) -> int:
    """Rank 0's optimizer steps when the job ended (see the module's docstring)."""
    timeline = tmp / "timeline"
    if timeline.exists():
        return sum(line.startswith("step ") for line in timeline.read_text().splitlines())
    said = [int(m.group(1)) for r in results or () for m in STOPPED.finditer(r.output)]
    return max(said) if said else signal_step  # rank 1 was in step signal_step + 1: every rank had done these


def kill_leftovers(tmp: Path) -> None:
    """SIGKILL every process whose command line names this run's directory (torchrun leaves its
    workers behind when it is killed)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(tmp).encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--signal", default="TERM")
    p.add_argument("--signal-step", type=int, default=15)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--no-lightning", action="store_true", help="leave out the Lightning pair")
    p.add_argument("--hang-after", type=float, default=90.0,
                   help="seconds after which a run counts as hung and is killed (default 90)")
    args = p.parse_args()
    pairs = PAIRS[:1] if args.no_lightning else PAIRS
    launchers = [name for pair in pairs for name in pair]
    got: dict[str, list[dict]] = {k: [] for k in launchers}
    for i in range(args.reps):
        for launcher in launchers if i % 2 == 0 else launchers[::-1]:  # neither side always first
            with tempfile.TemporaryDirectory() as tmp:
                r = one_run(Path(tmp), launcher, args)
            got[launcher].append(r)
            print(f"run {i + 1} {launcher:16}: exit codes {r['codes']}, {r['done']} steps done, newest checkpoint "
                  f"step {r['newest']}, {r['lost']} step(s) lost, signal -> last exit {r['to_exit']:.1f} s", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("lost", "done", "to_exit")} for k, v in got.items()}
    hung = {k: sum(r["hung"] for r in v) for k, v in got.items()}
    print(f"\n2 x 1, gloo, SIG{args.signal} (Lightning: SIGTERM) to rank 1 after step {args.signal_step}, checkpoint "
          f"every {args.checkpoint_every}, median of {args.reps}:")
    for anchor, ours in pairs:
        for k in (anchor, ours):
            codes = sorted({r["codes"] for r in got[k]})
            exit_s = f"{med[k]['to_exit']:.1f} s" if hung[k] < len(got[k]) / 2 else f"never (killed at {args.hang_after:g} s)"
            print(f"  {k:16}: {med[k]['lost']:.0f} step(s) lost ({med[k]['done']:.0f} done), "
                  f"signal -> last exit {exit_s}, exit codes {codes}, "
                  f"hung {hung[k]} of {len(got[k])}")
        t = med[anchor]["to_exit"]
        if t and t != float("inf") and med[ours]["to_exit"] != float("inf"):
            print(f"  {ours}/{anchor} time to exit: {med[ours]['to_exit'] / t:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
