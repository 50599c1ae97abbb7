"""A small DDP job for the fault tests, torchrun-style (plain torch.distributed, no ddprun import).

Every rank writes ``<pids>/rank-N.pid`` after its first optimizer step, so a test knows when training
runs and which process is which rank, and ``<pids>/rank-N.env.json``, its environment then.
Options shape one fault each (see the tests).
"""

import argparse
import atexit
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-s", type=float, default=0.05, help="sleep per step (a slow, killable job)")
    p.add_argument("--pids", required=True)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--atexit-hang", action="store_true", help="an atexit handler that never returns")
    p.add_argument("--raise-rank", type=int, default=None)
    p.add_argument("--eval-s", type=float, default=0.0, help="after step 3: all_reduce only for this long")
    p.add_argument("--beat-s", type=float, default=0.0, help="after step 3: ddprun.heartbeat() only for this long")
    p.add_argument("--manual-sgd", action="store_true", help="update parameters by hand (no torch.optim)")
    p.add_argument("--write-mb", type=float, default=0.0, help="each step, print this many MB (a full disk)")
    p.add_argument("--hog-rank", type=int, default=None,
                   help="at step 3, this rank keeps 64 MiB more at a time, up to 16 GiB, in one tight loop")
    p.add_argument("--until", default=None, help="after --steps, go on until this file exists (on any rank)")
    p.add_argument("--min-world", type=int, default=0,
                   help="count steps only while WORLD_SIZE is at least this (a job that waits for a late node)")
    p.add_argument("--hold-gil-rank", type=int, default=None,
                   help="after step 3 this rank calls into C with the GIL held (ctypes.PyDLL: libc sleep)")
    p.add_argument("--hold-gil-s", type=int, default=60)
    p.add_argument("--short-rank", type=int, default=None,
                   help="this rank ends its script after --short-steps steps (uneven data: the others go on)")
    p.add_argument("--short-steps", type=int, default=5)
    return p.parse_args()


def phase(args: argparse.Namespace, rank: int) -> None:
    """A phase without optimizer steps: evaluation (collectives) or a user phase with heartbeats."""
    end = time.monotonic() + max(args.eval_s, args.beat_s)
    n = 0
    while True:
        if args.eval_s:  # the collective carries the decision: every rank stops after the same one
            go = torch.tensor([1.0 if time.monotonic() < end else 0.0])
            dist.all_reduce(go, op=dist.ReduceOp.MIN)
            if not go.item():
                break
        elif time.monotonic() < end:
            import ddprun

            ddprun.heartbeat("user phase")
        else:
            break
        time.sleep(0.2)
        n += 1
    print(f"rank {rank}: phase of {n} iterations done", flush=True)


def done(step: int, steps: int, until: str | None) -> bool:
    """Past ``steps`` and, with ``until``, that file seen by some rank (agreed by a collective: every
    rank stops after the same step)."""
    if step < steps or until is None:
        return step >= steps
    seen = torch.tensor([1.0 if os.path.exists(until) else 0.0])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


def main() -> None:
    args = parse()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.atexit_hang:
        atexit.register(lambda: time.sleep(10**6))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = args.steps if dist.get_world_size() >= args.min_world else 10**9  # ended by a restart or the test
    steps = args.short_steps if rank == args.short_rank else steps
    step, hog = 0, []
    while not done(step, steps, args.until):
        step += 1
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        if args.manual_sgd:
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
        else:
            opt.step()
            opt.zero_grad()
        if step == 1:
            with open(os.path.join(args.pids, f"rank-{rank}.env.json"), "w") as fp:
                json.dump(dict(os.environ), fp)  # what /proc/PID/environ shows is the interpreter's start
            with open(os.path.join(args.pids, f"rank-{rank}.pid"), "w") as fp:
                fp.write(str(os.getpid()))
        if step == 3 and args.raise_rank == rank:
            raise RuntimeError(f"injected failure on rank {rank}")
        if step == 3 and args.hold_gil_rank == rank:
            import ctypes

            ctypes.PyDLL(None).sleep(args.hold_gil_s)  # PyDLL keeps the GIL: no other thread of it runs
        if step == 3 and (args.eval_s or args.beat_s):
            phase(args, rank)
        if step == 3 and args.hog_rank == rank:
            # zeroed, so resident: the out-of-memory killer's pick. One tight loop, not a step each: a
            # cgroup whose limit also holds the page cache its processes read (torch's libraries, on a
            # cold cache) reclaims that first, and a rank that runs its steps out of evicted code
            # pages would reach the limit only after a minute of refaults
            for _ in range(256):
                hog.append(bytearray(64 << 20))
        if args.write_mb:  # log lines that fill the disk under the run directory
            for _ in range(int(args.write_mb * 2**20) // 100):
                print("x" * 99)
            sys.stdout.flush()
        time.sleep(args.step_s)
    print(f"rank {rank}: done after {step} steps", flush=True)


if __name__ == "__main__":
    main()
