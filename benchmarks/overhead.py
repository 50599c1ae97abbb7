"""Per-step cost of ddprun.fit against the hand-written DDP loop: same model, data and launch.

    python benchmarks/overhead.py [--blocks 20] [--steps 150] [--warmup 20] [--shape 1x2]
    python benchmarks/overhead.py --widths 64,256,256,10 --batch-size 64 --shape 2x1   (#18's MLP)
    python benchmarks/overhead.py --widths 64,256,256,10 --batch-size 64 --in-process  (fit's own cost)

The interleaved launch runs under ``ddprun run`` (gloo, CPU): ``--shape 1x2`` is one node of two processes,
``2x1`` two nodes (agents on 127.0.0.1) of one. The default model, data and batch are
examples/torchrun_style.py's (MLP 16-64-1, 2048 samples, batch 16 per rank, SGD, MSE); ``--widths``
gives another MLP (a last width over 1: classification with cross-entropy on fixed labels).

Step time: one launch whose two ranks alternate blocks of --steps steps of each loop (fit, raw,
raw, fit, ...; --blocks of each), so that the noise of a shared 2-core machine falls on both alike.
The step time is the interval between two ``optimizer.step()`` calls of rank 0, taken by the same
optimizer subclass in both loops; each block's first --warmup steps are left out (the first DDP
forward imports torch._dynamo). Reported: the median over all steps of each loop, the median of the
per-block-pair ratios, and the 10th percentiles (the least disturbed steps). Wall time on a machine
whose cores other jobs share is noisy, so the training thread's CPU time per step
(``time.thread_time``; the gloo all-reduce waits without CPU) is reported too: the loop's own cost.
Goal: fit / hand-written <= 1.01. A third loop, fit with ``step_timing=False``, gives the cost of
the step timing and telemetry (goal <= 1%). The loops must do the same work: every block of each
loop, on every rank, ends with bitwise-equal parameters, and so does every separate launch below
(checked; the script exits 1 otherwise).

Against plain torchrun: --launch-reps separate launches of each of three arms, alternating: the
hand-written loop under torchrun (the anchor), the same loop under ``ddprun run``, and ddprun.fit;
the median step of each (every rank's steps after --warmup) and the peak RSS (``ru_maxrss`` of each
rank at its end, max over ranks), as ratios to the anchor. These launches are apart, so their
ratios carry more of a shared machine's noise than the interleaved ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

LR = 0.05


def _timed_sgd(params, times: list[tuple[float, float]]):
    """SGD that records (wall clock, this thread's CPU time) at every step() call."""
    import torch

    class TimedSGD(torch.optim.SGD):
        def step(self, closure=None):
            times.append((time.perf_counter(), time.thread_time()))
            return super().step(closure)

    return TimedSGD(params, lr=LR)


WIDTHS = (16, 64, 1)
"""The MLP's layer widths (``--widths``; set in the worker before any loop runs)."""


def _setup():
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, WIDTHS[0], generator=g)
    if WIDTHS[-1] == 1:
        y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(2048, 1, generator=g)
    else:
        y = (x @ torch.randn(WIDTHS[0], WIDTHS[-1], generator=g)).argmax(dim=1)
    return model, TensorDataset(x, y)


def _loss_fn():
    from torch import nn

    return nn.functional.mse_loss if WIDTHS[-1] == 1 else nn.functional.cross_entropy


def digest(model) -> str:
    """SHA-256 of the parameters' bytes, in model order: equal only when bitwise equal."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_fit(steps: int, batch: int, times: list, step_timing: bool = True) -> tuple[int, str]:
    """ddprun.fit; (rank, digest of the trained parameters)."""
    import ddprun

    model, data = _setup()
    ddprun.fit(model, data, loss_fn=_loss_fn(), optimizer=lambda p: _timed_sgd(p, times),
               batch_size=batch, max_steps=steps, seed=0, step_timing=step_timing)
    return ddprun.rank_info().rank, digest(model)


def run_fit_untimed(steps: int, batch: int, times: list) -> tuple[int, str]:
    return run_fit(steps, batch, times, step_timing=False)


def _hand_written(net, data, rank: int, world: int, steps: int, batch: int, times: list) -> None:
    """The hand-written loop over ``net`` (DDP, or the plain module in one process): a
    DistributedSampler with seed 0, SGD timed at every step, rank 0 printing every 50 steps."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    opt = _timed_sgd(net.parameters(), times)
    loss_fn = _loss_fn()
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = loss_fn(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 50 == 0:  # what a hand-written loop prints; fit logs every 50 too
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step >= steps:
                break
        epoch += 1


def run_raw(steps: int, batch: int, times: list) -> tuple[int, str]:
    """The hand-written DDP loop; (rank, digest of the trained parameters)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():  # in the interleaved launch fit's ddprun.init() made the group
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, data = _setup()
    _hand_written(DDP(model), data, rank, world, steps, batch, times)
    return rank, digest(model)


def run_plain(steps: int, batch: int, times: list) -> tuple[int, str]:
    """The hand-written loop in one process (no process group, no DDP: what fit does with one
    process), over the same sampler order; (0, digest of the trained parameters)."""
    model, data = _setup()
    _hand_written(model, data, 0, 1, steps, batch, times)
    return 0, digest(model)


def in_process(args: argparse.Namespace) -> int:
    """--in-process: fit's own cost per step, without a launch, a process group or a second rank
    (whose waits are most of the noise of the launched comparison): ddprun.fit in one process and the
    same hand-written loop, alternating --blocks times in this process. Reported: the training
    thread's CPU time per step (median of each block), fit minus the loop in microseconds, and the
    ratio. One process has no DDP, so the step timing's two gradient hooks are not in it."""
    import contextlib
    import io

    import torch

    global WIDTHS
    WIDTHS = tuple(int(w) for w in args.widths.split(","))
    torch.set_num_threads(1)  # as in a launched rank (OMP_NUM_THREADS=1): no OpenMP spin-wait on this thread's clock
    cpu: dict[str, list[float]] = {"fit": [], "plain": []}
    digests = set()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # fit's run directory (and its last checkpoint) go here
        for i in range(args.blocks):
            for mode in (("fit", "plain") if i % 2 == 0 else ("plain", "fit")):
                times: list[tuple[float, float]] = []
                with contextlib.redirect_stdout(io.StringIO()):
                    _, params = (run_fit if mode == "fit" else run_plain)(args.steps, args.batch_size, times)
                pairs = list(zip(times, times[1:]))[args.warmup:]
                cpu[mode].append(statistics.median(b[1] - a[1] for a, b in pairs) * 1e6)
                digests.add((mode, params))
    fit, plain = statistics.median(cpu["fit"]), statistics.median(cpu["plain"])
    print(f"one process, MLP {args.widths.replace(',', '-')}, batch {args.batch_size}; {args.blocks} blocks of "
          f"{args.steps} steps of each loop, alternating; training thread's CPU time per step (us), block medians:")
    for mode in cpu:
        print(f"  {mode:>5}: " + " ".join(f"{t:.1f}" for t in cpu[mode]))
    print(f"  median: ddprun.fit {fit:.1f} us, hand-written loop {plain:.1f} us: fit's own cost {fit - plain:+.1f} us "
          f"a step, ratio {fit / plain:.3f}")
    return say_params(digests, "in this process")


def worker(args: argparse.Namespace) -> None:
    import resource

    global WIDTHS
    WIDTHS = tuple(int(w) for w in args.widths.split(","))
    loops = {"fit": run_fit, "raw": run_raw, "untimed": run_fit_untimed}
    if args.mode == "interleaved":
        order = [("fit", "raw", "untimed") if i % 2 == 0 else ("untimed", "raw", "fit") for i in range(args.blocks)]
        blocks = []
        for pair in order:
            for mode in pair:
                times: list[tuple[float, float]] = []
                rank, params = loops[mode](args.steps, args.batch_size, times)
                pairs = list(zip(times, times[1:]))[args.warmup:]
                blocks.append({"mode": mode, "intervals": [b[0] - a[0] for a, b in pairs],
                               "cpu": [b[1] - a[1] for a, b in pairs], "params": params})
        result = {"rank": rank, "blocks": blocks}
    else:
        times = []
        rank, params = loops[args.mode](args.steps, args.batch_size, times)
        pairs = list(zip(times, times[1:]))[args.warmup:]
        result = {"rank": rank, "intervals": [b[0] - a[0] for a, b in pairs], "params": params}
    result["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(os.path.join(args.out, f"{args.mode}-{rank}.json"), "w") as f:
        json.dump(result, f)
    if "DDPRUN_RUN_DIR" not in os.environ:  # plain torchrun: no interpreter teardown, where torch 2.13's
        sys.stdout.flush()  # gloo group can abort ("terminate called without an active exception", seen
        os._exit(0)  # once here) and end the whole benchmark; the exit is exit_stress.py's to compare


def launch(args: argparse.Namespace, mode: str, tmp: str, steps: int, launcher: str = "ddprun") -> list[dict]:
    """One job of --shape (one agent per node) under ``ddprun run`` or plain torchrun; each rank's JSON."""
    from tests.helpers import DDPRUN, TORCHRUN, describe, free_port, run_agents

    nnodes, nproc = (int(v) for v in args.shape.split("x"))
    out = tempfile.mkdtemp(prefix=f"{launcher}-{mode}-", dir=tmp)
    base = [DDPRUN, "run", "--log-dir", os.path.join(tmp, "runs")] if launcher == "ddprun" else \
        [TORCHRUN, "--rdzv-backend", "c10d"]
    cmd = [*base, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--rdzv-id", f"overhead-{os.path.basename(out)}",
           os.path.abspath(__file__), "--worker", "--mode", mode, "--out", out, "--steps", str(steps),
           "--warmup", str(args.warmup), "--blocks", str(args.blocks), "--batch-size", str(args.batch_size),
           "--widths", args.widths]
    results = run_agents([cmd] * nnodes, timeout=600, cwd=tmp)
    if any(r.returncode != 0 for r in results):
        raise SystemExit(describe(results))
    return [json.load(open(os.path.join(out, f"{mode}-{r}.json"))) for r in range(nnodes * nproc)]


def driver(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch(args, "interleaved", tmp, args.steps)
        alone, alone_params = separate_launches(args, tmp)
    blocks = ranks[0]["blocks"]
    pooled = {m: [t for b in blocks if b["mode"] == m for t in b["intervals"]] for m in ("fit", "raw")}
    cpu = {m: statistics.median([t for b in blocks if b["mode"] == m for t in b["cpu"]]) * 1e3 for m in ("fit", "raw")}
    block_median = {m: [statistics.median(b["intervals"]) for b in blocks if b["mode"] == m] for m in ("fit", "raw")}
    pair_ratios = [f / r for f, r in zip(block_median["fit"], block_median["raw"])]
    fit_ms, raw_ms = statistics.median(pooled["fit"]) * 1e3, statistics.median(pooled["raw"]) * 1e3
    nnodes, nproc = args.shape.split("x")
    print(f"{nnodes} node(s) x {nproc} process(es) under `ddprun run` (gloo, CPU), MLP {args.widths.replace(',', '-')}"
          f", batch {args.batch_size} per rank; {args.blocks} blocks of {args.steps} steps of each loop, "
          f"alternating in one launch; first {args.warmup} steps of each block left out")
    print("  block medians (ms): fit " + " ".join(f"{t * 1e3:.3f}" for t in block_median["fit"]))
    print("                      raw " + " ".join(f"{t * 1e3:.3f}" for t in block_median["raw"]))
    print(f"  median step: ddprun.fit {fit_ms:.3f} ms, hand-written DDP loop {raw_ms:.3f} ms")
    best = {m: min(block_median[m]) * 1e3 for m in block_median}
    print(f"  least disturbed block (lowest block median): ddprun.fit {best['fit']:.3f} ms, hand-written "
          f"{best['raw']:.3f} ms, ratio {best['fit'] / best['raw']:.3f}")
    p10 = {m: statistics.quantiles(pooled[m], n=10)[0] * 1e3 for m in pooled}
    print(f"  10th percentile step: ddprun.fit {p10['fit']:.3f} ms, hand-written {p10['raw']:.3f} ms")
    print(f"  ratio fit / hand-written = {fit_ms / raw_ms:.3f} (median, all steps), "
          f"{statistics.median(pair_ratios):.3f} (median of block pairs), {p10['fit'] / p10['raw']:.3f} "
          f"(10th percentiles); goal <= 1.01")
    print(f"  training thread's CPU time per step (median): ddprun.fit {cpu['fit']:.3f} ms, hand-written "
          f"{cpu['raw']:.3f} ms, ratio {cpu['fit'] / cpu['raw']:.3f} (the loop's own cost, whatever the load)")
    untimed = statistics.median([t for b in blocks if b["mode"] == "untimed" for t in b["intervals"]]) * 1e3
    untimed_cpu = statistics.median([t for b in blocks if b["mode"] == "untimed" for t in b["cpu"]]) * 1e3
    print(f"  step timing and telemetry (fit with step_timing=True vs False): {fit_ms:.3f} vs {untimed:.3f} ms, "
          f"ratio {fit_ms / untimed:.3f}; CPU time {cpu['fit']:.3f} vs {untimed_cpu:.3f} ms, ratio "
          f"{cpu['fit'] / untimed_cpu:.3f}; goal <= 1.01")
    say_separate(alone, args.launch_reps)
    return say_params({(b["mode"], b["params"]) for r in ranks for b in r["blocks"]}, "in the interleaved launch") \
        + say_params(alone_params, "in the separate launches")


def say_params(seen: set[tuple[str, str]], where: str) -> int:
    """The loops must train the same parameters bit for bit (same data order, same arithmetic):
    otherwise the step times compare different work. ``seen``: (loop, digest) of every block and rank.
    Non-zero when any differs."""
    digests = {d for _, d in seen}
    if len(digests) <= 1:
        print(f"  parameters {where}: bitwise equal on every rank for " + ", ".join(sorted({m for m, _ in seen}))
              + (f" (sha256 {digests.pop()[:16]})" if digests else ""))
        return 0
    print(f"  parameters {where} differ (the comparison is not of the same work):")
    for mode, d in sorted(seen):
        print(f"    {mode}: sha256 {d[:16]}")
    return 1


ARMS = (("torchrun", "raw"), ("ddprun", "raw"), ("ddprun", "fit"))
"""The separate launches: the anchor (the hand-written loop under plain torchrun), the same loop
under ``ddprun run`` (what ddprun's worker side costs a script it launches), and ddprun.fit."""


def separate_launches(args: argparse.Namespace, tmp: str) -> tuple[dict[tuple[str, str], list[tuple[float, float]]],
                                                                    set[tuple[str, str]]]:
    """Per arm, per launch: (median step in ms over every rank's steps, peak RSS in MiB, max over ranks);
    --launch-reps launches of each, the order reversed every other round. Also every (arm, parameter
    digest) seen on any rank."""
    got: dict[tuple[str, str], list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    digests: set[tuple[str, str]] = set()
    for i in range(args.launch_reps):
        for launcher, mode in ARMS if i % 2 == 0 else ARMS[::-1]:
            ranks = launch(args, mode, tmp, 2 * args.steps, launcher)
            steps = [t for r in ranks for t in r["intervals"]]
            got[(launcher, mode)].append((statistics.median(steps) * 1e3, max(r["maxrss_mib"] for r in ranks)))
            digests |= {(f"{mode} under {launcher}", r["params"]) for r in ranks}
    return got, digests


def say_separate(got: dict[tuple[str, str], list[tuple[float, float]]], reps: int) -> None:
    step = {arm: statistics.median(v[0] for v in got[arm]) for arm in ARMS}
    rss = {arm: statistics.median(v[1] for v in got[arm]) for arm in ARMS}
    anchor = ("torchrun", "raw")
    print(f"  separate launches ({reps} of each, alternating; medians): the hand-written loop under torchrun "
          f"{step[anchor]:.3f} ms a step, {rss[anchor]:.0f} MiB peak RSS (the anchor)")
    for arm, name in ((("ddprun", "raw"), "the same loop under ddprun run"), (("ddprun", "fit"), "ddprun.fit")):
        print(f"    {name}: {step[arm]:.3f} ms ({step[arm] / step[anchor]:.3f}x), {rss[arm]:.0f} MiB "
              f"({rss[arm] / rss[anchor]:.3f}x)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=20, help="blocks of each loop in the interleaved launch")
    p.add_argument("--steps", type=int, default=150, help="steps per block")
    p.add_argument("--warmup", type=int, default=20, help="steps left out at the start of each block")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--widths", default="16,64,1", help="the MLP's layer widths, comma-separated")
    p.add_argument("--shape", default="1x2", help="NNODESxNPROC: 1x2 (default) or 2x1")
    p.add_argument("--launch-reps", type=int, default=3,
                   help="separate launches of each arm against the hand-written loop under plain torchrun")
    p.add_argument("--in-process", action="store_true",
                   help="fit's own cost per step in one process (no launch): CPU time against the hand-written loop")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["fit", "raw", "untimed", "interleaved"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if not 0 <= args.warmup < args.steps - 1 or args.blocks < 1:
        p.error(f"each block needs steps measured after its warm-up: --steps {args.steps} --warmup {args.warmup} "
                f"--blocks {args.blocks} (use --steps > --warmup + 1 and --blocks >= 1)")
    return in_process(args) if args.in_process else driver(args)


if __name__ == "__main__":
    sys.exit(main())
