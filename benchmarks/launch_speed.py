"""Wall time of the same 2 nodes x 2 processes job under ddprun and under plain torchrun, side by
side (alternating, same flags: c10d rendezvous on 127.0.0.1), median over --reps.

    python benchmarks/launch_speed.py [--reps 7] [--steps 20]

Wall time = from starting both node launchers to the last one exiting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.exit_stress import commands  # noqa: E402
from tests.helpers import run_agents  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    walls: dict[str, list[float]] = {"ddprun": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.reps):
            for name in ("torchrun", "ddprun") if i % 2 else ("ddprun", "torchrun"):
                results = run_agents(commands(name, i, args.steps, destroy=False), timeout=120, cwd=tmp)
                if any(r.returncode != 0 for r in results):
                    print(f"{name} run {i} failed: {[r.returncode for r in results]}", file=sys.stderr)
                    continue
                walls[name].append(max(r.wall_s for r in results))
            print(f"rep {i + 1}: ddprun {walls['ddprun'][-1:]} torchrun {walls['torchrun'][-1:]}", flush=True)
    med = {k: statistics.median(v) for k, v in walls.items() if v}
    print(f"\n2 x 2 job, {args.steps} steps, median of {args.reps}: ddprun {med['ddprun']:.2f} s, "
          f"torchrun {med['torchrun']:.2f} s, ratio ddprun/torchrun = {med['ddprun'] / med['torchrun']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
