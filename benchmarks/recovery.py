"""Recovery from a SIGKILLed worker under ``ddprun run --max-restarts``: the time from the kill to the
first optimizer step after the restart, and the steps lost (taken again from the last checkpoint).

    python benchmarks/recovery.py [--reps 3] [--kill-step 7] [--checkpoint-every 3] [--step-sleep 0.05]

2 nodes x 2 processes on 127.0.0.1 (gloo), tests/multiprocess/scripts/fit_restart.py: ddprun.fit of
a small MLP; rank 3 SIGKILLs itself after --kill-step steps of the first attempt. Printed per run:
kill -> the restarted workers' first training_step call (torch's agent noticing, a new rendezvous
round, worker start-up: imports, process group, preflight, checkpoint load) -> the first step done.
Steps lost = steps done before the kill - the step of the checkpoint resumed from. For scale, the
first attempt's launch -> first training_step: most of a recovery is the same worker start-up
(interpreter, torch import, process group, DDP). Median over --reps.
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
from tests.helpers import ddprun_nodes, describe, run_agents  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parents[1] / "tests" / "multiprocess" / "scripts" / "fit_restart.py")


def one_run(tmp: Path, i: int, args) -> dict[str, float]:
    out, marker, timeline = tmp / f"out{i}", tmp / f"killed{i}", tmp / f"timeline{i}"
    cmds = ddprun_nodes(2, 2, [SCRIPT, "--out", str(out), "--steps", str(args.steps), "--checkpoint-every",
                               str(args.checkpoint_every), "--kill-rank", "3", "--kill-step", str(args.kill_step),
                               "--marker", str(marker), "--timeline", str(timeline), "--step-sleep",
                               str(args.step_sleep)],
                        rdzv_id=f"recovery{i}", extra=["--max-restarts", "1", "--log-dir", str(tmp / "runs")])
    started = time.time()
    results = run_agents(cmds, timeout=240, cwd=tmp)
    if any(r.returncode != 0 for r in results):
        raise RuntimeError("the job did not recover:\n" + describe(results))
    killed_at = float(marker.read_text().split()[-1])
    events = [(e, int(pid), float(t)) for e, pid, t in (line.split() for line in timeline.read_text().splitlines())]
    before = {pid for e, pid, t in events if t < killed_at}
    after = [(e, t) for e, pid, t in events if pid not in before]
    launch_to_call = min(t for e, pid, t in events) - started  # the first attempt's start-up, for scale
    first_call = next(t for e, t in after if e == "call")  # the resumed fit's one throw-away forward (DDP buckets)
    first_step = next(t for e, t in after if e == "step")
    both = "\n".join(r.output for r in results)
    resumed = int(re.search(r"ddprun: resuming from \S+: step (\d+)", both).group(1))
    return {"launch_to_first_call": launch_to_call, "to_first_call": first_call - killed_at,
            "to_first_step": first_step - killed_at,
            "lost": args.kill_step - resumed, "resumed": resumed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--kill-step", type=int, default=7)
    p.add_argument("--checkpoint-every", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.05)
    args = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.reps):
            r = one_run(Path(tmp), i, args)
            runs.append(r)
            print(f"run {i + 1}: SIGKILL -> restarted worker's first training_step {r['to_first_call']:.2f} s, "
                  f"-> first step done {r['to_first_step']:.2f} s; resumed from step {r['resumed']}, "
                  f"{r['lost']} step(s) lost (first attempt: launch -> first training_step "
                  f"{r['launch_to_first_call']:.2f} s)", flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"\n2 x 2, gloo, kill after step {args.kill_step}, checkpoint every {args.checkpoint_every}, median of "
          f"{len(runs)}: SIGKILL -> first step after the restart {med['to_first_step']:.2f} s "
          f"(to the first training_step {med['to_first_call']:.2f} s; a first start takes "
          f"{med['launch_to_first_call']:.2f} s from launch); steps lost {med['lost']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
