"""A torchrun-style DDP loop (no ddprun.fit) that registers ddprun.on_preempt: the callback writes
the step it was called at to OUT/callback-<rank>.txt. Rank R sends itself SIGTERM during step S+1.

    python preempt_loop.py --out DIR [--signal-rank R --signal-step S] [--steps N] [--catch]

OUT/after-loop-<rank>.txt is written only if the loop runs to its end (it must not after a stop).
--catch: the script catches ddprun.Preempted, writes OUT/caught-<rank>.txt and returns normally.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import ddprun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--signal-rank", type=int)
    p.add_argument("--signal-step", type=int)
    p.add_argument("--catch", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)

    @ddprun.on_preempt
    def save(step: int) -> None:
        with open(os.path.join(args.out, f"callback-{rank}.txt"), "w") as f:
            f.write(str(step))

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        for step in range(args.steps):
            if rank == args.signal_rank and step == args.signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.05)
    except ddprun.Preempted:
        if not args.catch:
            raise
        with open(os.path.join(args.out, f"caught-{rank}.txt"), "w") as f:
            f.write("caught")
        return
    with open(os.path.join(args.out, f"after-loop-{rank}.txt"), "w") as f:
        f.write("done")


if __name__ == "__main__":
    main()
