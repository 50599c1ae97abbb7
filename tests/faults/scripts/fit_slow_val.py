"""ddprun.fit whose validation pass takes ``--val-s`` seconds (slow samples, no collective inside),
or whose first training batch takes ``--first-s`` seconds (after fit's setup collectives), or that
prepares its data for ``--prep-s`` seconds after ``ddprun.init()`` (its probe all_reduce), longer
than the stall threshold the test sets: that is a healthy job, never a stall."""

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


class SlowFirst(TensorDataset):
    """Its first sample in each process takes ``first_s``: a dataset that opens its files lazily."""

    def __init__(self, first_s: float, *tensors: torch.Tensor):
        super().__init__(*tensors)
        self.first_s = first_s

    def __getitem__(self, i: int):
        if self.first_s:
            time.sleep(self.first_s)
            self.first_s = 0.0
        return super().__getitem__(i)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--val-s", type=float, default=0.0)
    p.add_argument("--first-s", type=float, default=0.0)
    p.add_argument("--prep-s", type=float, default=0.0)
    args = p.parse_args()
    if args.prep_s:
        ddprun.init()
        time.sleep(args.prep_s)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    n_val = 16  # per rank 8 samples (2 ranks): each sleeps val_s / 8
    res = ddprun.fit(nn.Linear(8, 1), SlowFirst(args.first_s, x, x[:, :1]), val_data=Slow(n_val, args.val_s / (n_val // 2)),
                     batch_size=8, epochs=1, loss_fn=nn.functional.mse_loss, log_every=100,
                     num_workers=0,  # the pass is the slow batch alone, not the DataLoader workers' start too
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    print(f"validated: val_loss {res.val_metrics['val_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
