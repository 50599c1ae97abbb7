"""A plain Lightning script: Lightning's own BoringModel, a Trainer built by hand, no ddprun import.

    torchrun|ddprun run ... boring_unmodified.py --devices 2 --num-nodes 2 [--strategy ddp] [--out DIR]

--out: each rank writes rank-<global rank>.json (what its Trainer saw, steps it ran) at the end of
fit, so a test can count the ranks that trained. --stamp FILE: rank 0 appends time.time() at its first
training batch (benchmarks/lightning_first_step.py). --sigterm-rank R --sigterm-batch B: rank R sends
itself SIGTERM at its training batch B (a preemption of one rank: Lightning's own handler is the
script's). --first-batch-s S: every rank's first training item takes S seconds (a lazily opened
dataset). --hang-rank R --hang-batch B: rank R sleeps 120 s at its training batch B. Otherwise
arguments only choose the Trainer's settings.
"""

import argparse
import json
import os
import signal
import time

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader


class SlowFirst(RandomDataset):
    def __init__(self, first_s):
        super().__init__(32, 64)
        self.first_s = first_s

    def __getitem__(self, index):
        if self.first_s:
            print(f"first training item: {self.first_s} s", flush=True)
            time.sleep(self.first_s)
            self.first_s = 0
        return super().__getitem__(index)


class Boring(BoringModel):
    def __init__(self, first_s):
        super().__init__()
        self.first_s = first_s

    def train_dataloader(self):
        return DataLoader(SlowFirst(self.first_s))


class Facts(Callback):
    def __init__(self, out, stamp, sigterm=(None, None), hang=(None, None)):
        self.out, self.stamp, self.steps, self.sigterm, self.hang = out, stamp, 0, sigterm, hang

    def on_train_batch_start(self, trainer, *args):
        if self.steps == 0 and self.stamp and trainer.global_rank == 0:
            with open(self.stamp, "a") as fp:
                fp.write(f"{time.time()}\n")
        if self.sigterm == (trainer.global_rank, self.steps):
            print(f"rank {trainer.global_rank}: SIGTERM to itself at batch {self.steps}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        if self.hang == (trainer.global_rank, self.steps):
            print(f"rank {trainer.global_rank}: hangs at batch {self.steps}", flush=True)
            time.sleep(120)
        self.steps += 1

    def on_fit_end(self, trainer, pl_module):
        if self.out:
            os.makedirs(self.out, exist_ok=True)
            facts = {"global_rank": trainer.global_rank, "local_rank": trainer.local_rank,
                     "node_rank": trainer.node_rank, "world_size": trainer.world_size, "steps": self.steps,
                     "global_step": trainer.global_step, "strategy": type(trainer.strategy).__name__}
            with open(os.path.join(self.out, f"rank-{trainer.global_rank}.json"), "w") as fp:
                json.dump(facts, fp)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=2)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--out")
    p.add_argument("--stamp")
    p.add_argument("--sigterm-rank", type=int)
    p.add_argument("--sigterm-batch", type=int)
    p.add_argument("--first-batch-s", type=float, default=0.0)
    p.add_argument("--hang-rank", type=int)
    p.add_argument("--hang-batch", type=int)
    args = p.parse_args()
    facts = Facts(args.out, args.stamp, (args.sigterm_rank, args.sigterm_batch), (args.hang_rank, args.hang_batch))
    trainer = Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=args.strategy,
                      max_steps=args.max_steps, limit_val_batches=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[facts])
    trainer.fit(Boring(args.first_batch_s))


if __name__ == "__main__":
    main()
