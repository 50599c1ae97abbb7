"""ddprun.fit whose validation pass takes ``--val-s`` seconds (slow samples, no collective inside),
longer than the stall threshold the test sets: that is a healthy job, never a stall."""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import ddprun


class Slow(Dataset):
    def __init__(self, n: int, each_s: float):
        g = torch.Generator().manual_seed(2)
        self.x, self.each_s = torch.randn(n, 8, generator=g), each_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.each_s)
        return self.x[i], self.x[i, :1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--val-s", type=float, required=True)
    args = p.parse_args()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    n_val = 16  # per rank 8 samples (2 ranks): each sleeps val_s / 8
    res = ddprun.fit(nn.Linear(8, 1), TensorDataset(x, x[:, :1]), val_data=Slow(n_val, args.val_s / (n_val // 2)),
                     batch_size=8, epochs=1, loss_fn=nn.functional.mse_loss, log_every=100,
                     num_workers=0,  # the pass is the slow batch alone, not the DataLoader workers' start too
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    print(f"validated: val_loss {res.val_metrics['val_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
