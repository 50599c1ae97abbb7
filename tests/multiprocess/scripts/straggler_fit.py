"""ddprun.fit on a tiny regression; with --slow-rank R that rank's data loading sleeps --delay-ms
per batch (an injected straggler). Rank 0 prints how many steps ran."""

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import ddprun


class Regression(Dataset):
    def __init__(self, n: int, delay_s: float):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.delay_s = delay_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.delay_s and i % 8 == 0:  # once per batch of 8
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--delay-ms", type=float, default=30)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    delay = args.delay_ms / 1000 if rank == args.slow_rank else 0.0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    result = ddprun.fit(model, Regression(4096, delay), loss_fn=nn.functional.mse_loss, batch_size=8,
                        max_steps=args.steps, num_workers=0, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
                        log_every=100)
    if rank == 0:
        print(f"steps={result.steps}", flush=True)


if __name__ == "__main__":
    main()
