"""Wall time of one ddprun.fit job on 1 node x 2 processes: under `ddprun run`, from Python with
ddprun.launch, and under Ray Train (ddprun.ray.fit, a local Ray started by the job), side by side,
each once (--reps for more).

    python benchmarks/ray_vs_run.py [--reps 1] [--steps 40]

Wall time = from starting the command to its exit (Python start, imports, Ray's start and shutdown
included); the Ray job also prints its ray.init and fit times. Same model, data, steps, batch size.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))


def job(steps: int):
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 32, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :4].sum(1, keepdim=True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    kwargs = dict(loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), batch_size=16,
                  max_steps=steps, log_every=10)
    return model, data, kwargs


def run_ddprun_job(steps: int) -> None:
    import ddprun

    model, data, kwargs = job(steps)
    ddprun.fit(model, data, **kwargs)


def fit_job(steps: int) -> int:
    """What ddprun.launch runs on every rank (module level: sent by reference, imported by the workers)."""
    import ddprun

    model, data, kwargs = job(steps)
    return ddprun.fit(model, data, **kwargs).steps


def run_launch_job(steps: int) -> None:
    import ddprun

    t0 = time.monotonic()
    done = ddprun.launch(fit_job, steps, nproc_per_node=2)
    print(f"LAUNCHTIMES launch={time.monotonic() - t0:.2f} steps={done}", flush=True)


def run_ray_job(steps: int, storage: str) -> None:
    import ray

    import ddprun.ray

    t0 = time.monotonic()
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    t1 = time.monotonic()
    model, data, kwargs = job(steps)
    result = ddprun.ray.fit(model, data, num_workers=2, use_gpu=False, storage_path=storage, name="bench", **kwargs)
    t2 = time.monotonic()
    ray.shutdown()
    print(f"RAYTIMES init={t1 - t0:.2f} fit={t2 - t1:.2f} shutdown={time.monotonic() - t2:.2f} "
          f"steps={result.metrics['step']}", flush=True)


def timed(cmd: list[str], cwd: str) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPRUN_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return wall, proc.stdout + proc.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--mode", choices=["compare", "ddprun-job", "launch-job", "ray-job"], default="compare")
    p.add_argument("--storage", default=None)
    args = p.parse_args()
    if args.mode == "ddprun-job":
        run_ddprun_job(args.steps)
        return 0
    if args.mode == "ray-job":
        run_ray_job(args.steps, args.storage)
        return 0
    if args.mode == "launch-job":
        run_launch_job(args.steps)
        return 0
    ddprun_bin = str(Path(sys.executable).parent / "ddprun")
    walls: dict[str, list[float]] = {"ddprun run": [], "ddprun.agent.run": [], "ray": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.reps):
            order = list(walls) if i % 2 == 0 else list(reversed(walls))
            for name in order:
                if name == "ddprun run":
                    cmd = [ddprun_bin, "run", "--nproc-per-node", "2", "--log-dir", os.path.join(tmp, "runs"),
                           str(HERE), "--mode", "ddprun-job", "--steps", str(args.steps)]
                elif name == "ddprun.agent.run":
                    cmd = [sys.executable, str(HERE), "--mode", "launch-job", "--steps", str(args.steps)]
                else:
                    cmd = [sys.executable, str(HERE), "--mode", "ray-job", "--steps", str(args.steps),
                           "--storage", os.path.join(tmp, f"ray-{i}")]
                wall, out = timed(cmd, tmp)
                walls[name].append(wall)
                extra = re.search(r"(RAYTIMES|LAUNCHTIMES) .*", out)
                print(f"rep {i + 1}: {name}: {wall:.2f} s" + (f"  ({extra.group(0)})" if extra else ""), flush=True)
    med = {k: statistics.median(v) for k, v in walls.items()}
    base = med["ddprun run"]
    print(f"\n1 x 2 job, {args.steps} steps, median of {args.reps}: ddprun run {base:.2f} s, ddprun.launch "
          f"{med['ddprun.agent.run']:.2f} s ({med['ddprun.agent.run'] / base:.2f}x), ddprun.ray.fit {med['ray']:.2f} s "
          f"({med['ray'] / base:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
