"""A LightningModule trained on every GPU of every node with ddprun.fit (synthetic data).

On each of 5 nodes with 4 GPUs (ddprun starts one process per visible GPU):

    ddprun run --nnodes=5 --rdzv_id=job1 --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT \\
        examples/lightning_script.py --max-steps 500

On this CPU machine, 2 simulated nodes x 2 processes:

    ddprun run --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29500 examples/lightning_script.py &
    ddprun run --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29500 examples/lightning_script.py

ddprun.fit builds the Trainer from the launch: devices=4 (processes on this node), num_nodes=5, DDP
with nccl (gloo on CPU); checkpoints and a CSV log go to the run directory. --own-trainer does the
same with a Trainer built here from ddprun.lightning.trainer_kwargs().
"""

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddprun


class Classifier(pl.LightningModule):
    def __init__(self, features: int = 32, classes: int = 4, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def synthetic(n: int, seed: int, features: int = 32, classes: int = 4) -> TensorDataset:
    """Gaussian blobs around fixed class centres: learnable, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(1234)) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centres[y] + torch.randn(n, features, generator=g), y)


# Steps count across epochs: an epoch is 8192 / (batch x processes) batches, fewer the more nodes.
VALIDATE_EVERY_100_STEPS = {"val_check_interval": 100, "check_val_every_n_epoch": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--own-trainer", action="store_true", help="build the Trainer here with trainer_kwargs()")
    args = p.parse_args()

    pl.seed_everything(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = Classifier()
    train, val = synthetic(8192, seed=0), synthetic(1024, seed=1)
    if args.own_trainer:
        from torch.utils.data import DataLoader

        from ddprun.lightning import trainer_kwargs

        trainer = pl.Trainer(**trainer_kwargs(), max_steps=args.max_steps, **VALIDATE_EVERY_100_STEPS)
        trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True),
                    DataLoader(val, batch_size=args.batch_size))
        return
    result = ddprun.fit(model, train, val_data=val, batch_size=args.batch_size, max_steps=args.max_steps,
                        trainer_kwargs=VALIDATE_EVERY_100_STEPS)
    if ddprun.rank_info().is_main:
        print(f"steps {result.steps}, val {result.val_metrics}, checkpoint {result.checkpoint}")


if __name__ == "__main__":
    main()
