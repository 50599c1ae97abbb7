"""The demo's training script: an MLP learns handwritten digits with :func:`ddprun.fit`.

    ddprun run --nnodes 1 --nproc-per-node 2 -m ddprun.demo_train [--steps N]
    python -m ddprun.demo_train                 # one process, no process group

Data: the UCI optical handwritten digits (8x8 images, 1797 samples, CC BY 4.0) shipped in
``ddprun/data/digits.csv.gz`` (see the README there); nothing is downloaded. A fixed permutation
splits it 80/20 into train and validation. Rank 0 ends with a line ``val_accuracy=0.9xx``.
"""

from __future__ import annotations

import argparse
import gzip
from importlib import resources

DEFAULT_STEPS = 150
VAL_FRACTION = 0.2
SPLIT_SEED = 0


def load_digits():
    """(features float32 [1797, 64] scaled to 0..1, labels int64 [1797]) from the packaged CSV."""
    import torch

    raw = resources.files("ddprun").joinpath("data", "digits.csv.gz").read_bytes()
    rows = [line.split(",") for line in gzip.decompress(raw).decode().splitlines() if line]
    values = torch.tensor([[int(v) for v in row] for row in rows])
    return values[:, :64].float() / 16.0, values[:, 64].long()


def split(x, y, val_fraction: float = VAL_FRACTION, seed: int = SPLIT_SEED):
    """Deterministic train/val split: the same on every rank and every run."""
    import torch
    from torch.utils.data import TensorDataset

    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def accuracy(outputs, targets):
    """Per-sample correctness (1.0/0.0): fit averages it over every rank's samples."""
    return (outputs.argmax(dim=1) == targets).float()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddprun.demo_train", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default {DEFAULT_STEPS})")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)

    import torch
    from torch import nn

    import ddprun

    info = ddprun.init()
    train, val = split(*load_digits())
    torch.manual_seed(0)  # the same initial weights on every rank (DDP would copy rank 0's anyway)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    result = ddprun.fit(
        model, train, val_data=val, loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
        max_steps=args.steps, batch_size=args.batch_size, val_metrics={"accuracy": accuracy}, log_every=25,
    )
    if info.is_main:
        print(f"trained {result.steps} steps on {info.world_size} process(es), {len(train)} train / {len(val)} val "
              f"samples; run dir {result.run_dir}")
        print(f"val_loss={result.val_metrics['val_loss']:.4f}")
        print(f"val_accuracy={result.val_metrics['val_accuracy']:.3f}", flush=True)


if __name__ == "__main__":
    main()
