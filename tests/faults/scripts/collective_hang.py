"""One all_reduce per step (gloo, ddprun.init), then a scripted hang whose collective the hang report
must name (worker/collectives.py):

    ddprun run ... collective_hang.py --mode sleep|extra|mismatch [--at K] [--steps N]

    sleep     rank 1 sleeps before its all_reduce of step K: the others wait in it
    extra     rank 0 issues one all_reduce more in step K; every rank goes on, so rank 0 waits in its
              last all_reduce while rank 1, done with its steps, waits outside any collective
    mismatch  rank 0 calls all_gather in step K where the others call all_reduce
"""

import argparse
import time

import torch
import torch.distributed as dist

import ddprun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["sleep", "extra", "mismatch"], required=True)
    p.add_argument("--at", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    info = ddprun.init()
    t = torch.ones(1)
    for step in range(args.steps):
        if step == args.at and args.mode == "sleep" and info.rank == 1:
            time.sleep(300)
        if step == args.at and args.mode == "extra" and info.rank == 0:
            dist.all_reduce(t)
        if step == args.at and args.mode == "mismatch" and info.rank == 0:
            dist.all_gather([torch.zeros(1) for _ in range(info.world_size)], t)
            continue
        dist.all_reduce(t)
        time.sleep(0.05)
    print(f"rank {info.rank} done with its steps", flush=True)
    time.sleep(300)  # outside any collective


if __name__ == "__main__":
    main()
