"""Launch -> first training step of the same Lightning script under ddprun and under plain torchrun.

    python benchmarks/lightning_first_step.py [--reps 5] [--steps 5]

2 nodes x 2 processes on 127.0.0.1, the same flags for both (c10d rendezvous, --nnodes 2
--nproc-per-node 2), alternating which launcher goes first, median over --reps. The script is
tests/integrations/scripts/boring_unmodified.py (Lightning's BoringModel, its own Trainer, no ddprun
import); rank 0 stamps time.time() at its first on_train_batch_start. Launch = just before both
launcher processes are started. Also printed: the wall time of the whole job (both launchers exited).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import DDPRUN, REPO, TORCHRUN, describe, free_port, run_agents  # noqa: E402

SCRIPT = str(REPO / "tests" / "integrations" / "scripts" / "boring_unmodified.py")


def commands(launcher: str, run: str, steps: int, stamp: Path) -> list[list[str]]:
    port = free_port()
    base = [DDPRUN, "run"] if launcher == "ddprun" else [TORCHRUN]
    return [base + ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run,
                    SCRIPT, "--devices", "2", "--num-nodes", "2", "--max-steps", str(steps), "--stamp", str(stamp)]
            for _ in range(2)]


def one(launcher: str, i: int, steps: int, tmp: str) -> tuple[float, float] | None:
    """(seconds from launch to rank 0's first step, seconds until both launchers exited), or None."""
    stamp = Path(tmp) / f"{launcher}-{i}.stamp"
    t0 = time.time()
    results = run_agents(commands(launcher, f"first-{launcher}-{i}", steps, stamp), timeout=120, cwd=tmp)
    if any(r.returncode != 0 for r in results) or not stamp.exists():
        print(f"{launcher} run {i} failed:\n{describe(results)}", file=sys.stderr)
        return None
    return float(stamp.read_text().split()[0]) - t0, max(r.wall_s for r in results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    first: dict[str, list[float]] = {"ddprun": [], "torchrun": []}
    whole: dict[str, list[float]] = {"ddprun": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.reps):
            this: dict[str, str] = {}
            for name in ("torchrun", "ddprun") if i % 2 else ("ddprun", "torchrun"):
                got = one(name, i, args.steps, tmp)
                this[name] = "failed" if got is None else f"{got[0]:.2f} s"
                if got is not None:
                    first[name].append(got[0])
                    whole[name].append(got[1])
            print(f"rep {i + 1}: first step  ddprun {this['ddprun']}  torchrun {this['torchrun']}", flush=True)
    if not all(first.values()):
        print("no successful runs of one launcher", file=sys.stderr)
        return 1
    med = {k: statistics.median(v) for k, v in first.items()}
    wmed = {k: statistics.median(v) for k, v in whole.items()}
    counts = ", ".join(f"{k} {len(v)} of {args.reps} runs" for k, v in first.items())
    print(f"\nLightning BoringModel, 2 x 2 on 127.0.0.1, c10d, medians of the successful runs ({counts}):")
    print(f"  launch -> first training step: ddprun {med['ddprun']:.2f} s, torchrun {med['torchrun']:.2f} s, "
          f"ratio ddprun/torchrun = {med['ddprun'] / med['torchrun']:.3f}")
    print(f"  whole job ({args.steps} steps):        ddprun {wmed['ddprun']:.2f} s, torchrun {wmed['torchrun']:.2f} s, "
          f"ratio = {wmed['ddprun'] / wmed['torchrun']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
