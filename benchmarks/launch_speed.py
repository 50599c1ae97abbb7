"""Start-up and short-job wall time of one plain DDP script under ddprun and under torchrun, side by
side: 2 nodes x 1 process and 1 node x 2 processes, the launchers alternating, medians over --reps.

    python benchmarks/launch_speed.py [--reps 7] [--steps 200] [--shapes 2x1,1x2] [--ddprun-args '--warm-start on']

The job is a hand-written DDP loop on an MLP 64-256-256-10, batch 64 per rank, gloo, --steps steps;
both launchers get the same flags (c10d rendezvous on 127.0.0.1, one command per node). Times are
taken from one wall clock (every process runs on this host) relative to the moment the harness
starts the node commands:
  first line  - the worker script's first statement runs (latest rank),
  first step  - every rank has finished its first optimizer step (latest rank),
  last step   - every rank has finished its loop,
  wall        - the last node command has exited.
Goals (#18): first step <= 0.95x torchrun, wall <= 0.85x torchrun.
"""

from __future__ import annotations

import time

T_FIRST_LINE = time.time()  # before anything else: the worker's first line

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402


def worker(steps: int, out: str) -> None:
    """The job: what a user's torchrun script does; at its end it writes OUT/rank-RANK.txt."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    first_step = None
    for _ in range(steps):
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        first_step = first_step or time.time()
    with open(os.path.join(out, f"rank-{os.environ['RANK']}.txt"), "w") as f:
        f.write(f"first_line={T_FIRST_LINE:.4f} first_step={first_step:.4f} last_step={time.time():.4f}\n")


DDPRUN_ARGS: list[str] = []
"""``--ddprun-args``: more flags for ``ddprun run`` (e.g. ``--warm-start on``)."""


def commands(launcher: str, shape: str, run: str, steps: int, out: str) -> list[list[str]]:
    from tests.helpers import DDPRUN, TORCHRUN, free_port

    nnodes, nproc = (int(v) for v in shape.split("x"))
    # ddprun shows only rank 0 on the console by default; --tee 3 shows every rank, as torchrun does
    base = [DDPRUN, "run", "--tee", "3", *DDPRUN_ARGS] if launcher == "ddprun" else [TORCHRUN]
    flags = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run]
    return [base + flags + [os.path.abspath(__file__), "--worker", "--steps", str(steps), "--out", out] for _ in range(nnodes)]


def one_run(launcher: str, shape: str, run: str, steps: int, cwd: str) -> dict[str, float] | None:
    """Seconds from starting the node commands to: the first line, the first step, the last exit."""
    from tests.helpers import run_agents

    out = os.path.join(cwd, run)
    os.makedirs(out)
    t0 = time.time()
    results = run_agents(commands(launcher, shape, run, steps, out), timeout=120, cwd=cwd)
    marks = [dict(re.findall(r"(\w+)=([\d.]+)", f.read_text())) for f in Path(out).glob("rank-*.txt")]
    world = int(shape.split("x")[0]) * int(shape.split("x")[1])
    if any(r.returncode != 0 for r in results) or len(marks) != world:
        print(f"{launcher} {shape} {run} failed: exit codes {[r.returncode for r in results]} (None: still running "
              f"at 120 s, killed), {len(marks)} of {world} ranks reported", file=sys.stderr)
        for node, r in enumerate(results):  # why it failed: the anchor fails too, now and then
            tail = [line for line in r.output.splitlines() if line.strip()][-4:]
            print("\n".join(f"    node {node}: {line[:200]}" for line in tail), file=sys.stderr)
        return None
    return {"first line": max(float(m["first_line"]) for m in marks) - t0,
            "first step": max(float(m["first_step"]) for m in marks) - t0,
            "last step": max(float(m["last_step"]) for m in marks) - t0, "wall": max(r.wall_s for r in results)}


def bench(shape: str, reps: int, steps: int, tmp: str) -> None:
    runs: dict[str, list[dict[str, float]]] = {"ddprun": [], "torchrun": []}
    for i in range(reps):
        for name in ("torchrun", "ddprun") if i % 2 else ("ddprun", "torchrun"):
            got = one_run(name, shape, f"speed-{name}-{shape}-{i}", steps, tmp)
            if got:
                runs[name].append(got)
        print(f"  {shape} rep {i + 1}: " + "; ".join(
            f"{n} " + " ".join(f"{v:.2f}" for v in r[-1].values()) for n, r in runs.items() if r), flush=True)
    if not runs["ddprun"] or not runs["torchrun"]:
        raise SystemExit(f"{shape}: no successful run of one launcher")
    print(f"{shape} ({steps} steps), medians of {len(runs['ddprun'])} ddprun and {len(runs['torchrun'])} "
          "torchrun runs, seconds from launch:")
    for what, goal in (("first line", None), ("first step", 0.95), ("last step", None), ("wall", 0.85)):
        d, t = (statistics.median(r[what] for r in runs[n]) for n in ("ddprun", "torchrun"))
        print(f"  {what:10s}: ddprun {d:5.2f}  torchrun {t:5.2f}  ratio {d / t:.3f}"
              + (f"  (goal <= {goal})" if goal else ""), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--shapes", default="2x1,1x2", help="comma-separated NNODESxNPROC")
    p.add_argument("--ddprun-args", default="", help="more flags for ddprun run, e.g. '--warm-start on'")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.steps, args.out)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    DDPRUN_ARGS.extend(args.ddprun_args.split())
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            bench(shape, args.reps, args.steps, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
