"""A torchrun-style DDP loop with a SIGTERM handler of its own, as Megatron's --exit-signal-handler:
the handler only sets a flag; after each step the ranks all_reduce it, and once it is set every rank
"saves" (1 s), writes the step to OUT/saved-<rank>.txt and returns. No ddprun.fit, no on_preempt:
nothing in the job stops at a step, so ddprun leaves the signal to this handler, as torchrun does.

    python own_handler_loop.py --out DIR [--steps N]

OUT/started-<rank> is written after step 3; OUT/after-loop-<rank>.txt only if the loop runs to its end.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    asked = {"stop": False}

    def on_sigterm(signum, frame) -> None:
        asked["stop"] = True

    signal.signal(signal.SIGTERM, on_sigterm)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        stop = torch.tensor([1.0 if asked["stop"] else 0.0])
        dist.all_reduce(stop)  # every rank stops after the same step
        if stop.item() > 0:
            time.sleep(1.0)  # the checkpoint's write
            with open(os.path.join(args.out, f"saved-{rank}.txt"), "w") as f:
                f.write(str(step))
            return
        if step == 3:
            open(os.path.join(args.out, f"started-{rank}"), "w").close()
        time.sleep(0.05)
    with open(os.path.join(args.out, f"after-loop-{rank}.txt"), "w") as f:
        f.write("done")


if __name__ == "__main__":
    main()
