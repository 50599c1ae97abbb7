"""ddprun.fit on nodes that run different numbers of processes (--allow-uneven-nodes).

    ddprun run --allow-uneven-nodes ... uneven_fit.py --out DIR

Every rank writes DIR/rank-<RANK>.json: its place as ddprun.rank_info() and torch's agent see it, the
training sample indices fit's sampler gave it (one epoch exactly), and fit's validation metric.
"""

import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import Dataset

import ddprun

TRAIN, VAL, BATCH = 96, 30, 8


class Recorded(Dataset):
    """x = the index; every index read is kept (num_workers=0: in this process)."""

    def __init__(self, n):
        self.n, self.seen = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.seen.append(int(i))
        x = torch.tensor([float(i)])
        return x, x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    info = ddprun.init()
    train, val = Recorded(TRAIN), Recorded(VAL)
    torch.manual_seed(0)
    steps = TRAIN // (BATCH * info.world_size)  # exactly one epoch
    result = ddprun.fit(nn.Linear(1, 1), train, val_data=val, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=1e-4), batch_size=BATCH, max_steps=steps,
                        num_workers=0, val_metrics={"x": lambda out, y: y.squeeze(1)}, seed=0, log_every=1)
    os.makedirs(args.out, exist_ok=True)
    facts = {"rank": info.rank, "node_rank": info.node_rank, "local_rank": info.local_rank,
             "world_size": info.world_size, "local_world_size": info.local_world_size,
             "env": {k: os.environ.get(k) for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                      "WORLD_SIZE")},
             "train_seen": train.seen, "steps": result.steps, "val_x": result.val_metrics["val_x"]}
    with open(os.path.join(args.out, f"rank-{info.rank}.json"), "w") as fp:
        json.dump(facts, fp)


if __name__ == "__main__":
    main()
