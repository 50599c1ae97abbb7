"""A torchrun-style DDP loop (no ddprun.fit) that registers ddprun.on_preempt: the callback writes
the step it was called at to OUT/callback-<rank>.txt. Rank R sends itself SIGTERM during step S+1.

    python preempt_loop.py --out DIR [--signal-rank R --signal-step S] [--steps N] [--catch]
                           [--loader-workers W --send-signal NAME --signal-to self|tree]

--loader-workers: the inputs come from a DataLoader of the script's own with W workers, started by
fork (torch's default on Linux up to Python 3.13), with no worker_init_fn. --signal-to tree: the
signal goes to the agent and every process below it, DataLoader workers included, as SLURM signals
every process of a step (scancel --signal, the SIGTERM before a preemption).

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
from torch.utils.data import DataLoader, Dataset

import ddprun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--signal-rank", type=int)
    p.add_argument("--signal-step", type=int)
    p.add_argument("--catch", action="store_true")
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--send-signal", default="TERM")
    p.add_argument("--signal-to", choices=["self", "tree"], default="self")
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
    inputs = iter(DataLoader(Randn(), batch_size=4, num_workers=args.loader_workers)) if args.loader_workers else None
    try:
        for step in range(args.steps):
            if rank == args.signal_rank and step == args.signal_step:
                send(getattr(signal, f"SIG{args.send_signal}"), args.signal_to)
            loss = model(next(inputs) if inputs else torch.randn(4, 8)).pow(2).mean()
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


class Randn(Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(8)


def send(sig: int, to: str) -> None:
    if to == "self":
        os.kill(os.getpid(), sig)
        return
    tree = [os.getppid()]
    todo = list(tree)
    while todo:  # the agent and every process below it
        parent = todo.pop()
        below = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == parent]
        tree += below
        todo += below
    for pid in tree:
        os.kill(pid, sig)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


if __name__ == "__main__":
    main()
