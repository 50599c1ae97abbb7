"""ddprun.fit with a LightningModule: each rank writes what it did.

    ddprun run ... lightning_fit.py --out DIR [--datamodule] [--steps N] [--step-sleep S]
        [--signal-rank R --signal-step K --marker PATH]   rank R SIGTERMs itself in training step K+1,
                                                          only while PATH does not exist (then written)
        [--checkpoint-every K] [--plain-trainer CKPT_DIR]  a checkpoint every K steps; a plain Lightning
                                                          Trainer (under torchrun: benchmarks/preemption.py)

DIR/rank-<global rank>.json: the rank's place (from its Trainer), training steps it ran, fit's result;
DIR/params-<global rank>.pt: its final state_dict; with --datamodule, DIR/setup-<global rank>.json
written by the LightningDataModule's setup() on that rank.
"""

import argparse
import json
import os
import signal
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddprun


def data(n: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.arange(8.0).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g))


class Regressor(pl.LightningModule):
    def __init__(self, step_sleep: float = 0.0, signal_at: int | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.train_steps = 0
        self.step_sleep, self.signal_at = step_sleep, signal_at

    def training_step(self, batch, batch_idx):
        if self.train_steps == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.step_sleep)
        self.train_steps += 1
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Data(pl.LightningDataModule):
    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def setup(self, stage: str) -> None:
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(self.out, f"setup-{rank}.json"), "w") as fp:
            json.dump({"rank": rank, "stage": stage, "pid": os.getpid()}, fp)
        self.train, self.val = data(256), data(64, seed=1)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=8)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--datamodule", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--signal-rank", type=int)
    p.add_argument("--signal-step", type=int)
    p.add_argument("--marker")
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--plain-trainer", metavar="CKPT_DIR")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    signal_at = None
    if args.signal_rank == int(os.environ.get("RANK", "0")) and not os.path.exists(args.marker):
        signal_at = args.signal_step
        with open(args.marker, "w") as fp:
            fp.write(f"SIGTERM from rank {args.signal_rank} at {time.time()}\n")
    model = Regressor(args.step_sleep, signal_at)
    quiet = {"enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 2}
    if args.plain_trainer:
        plain_trainer(model, args, quiet)
        return
    if args.datamodule:
        result = ddprun.fit(model, datamodule=Data(args.out), max_steps=args.steps, trainer_kwargs=quiet)
    else:
        result = ddprun.fit(model, data(256), val_data=data(64, seed=1), batch_size=8, max_steps=args.steps,
                            log_every=2, checkpoint_every=args.checkpoint_every, trainer_kwargs=quiet)
    t = result.trainer
    facts = {"global_rank": t.global_rank, "local_rank": t.local_rank, "node_rank": t.node_rank,
             "world_size": t.world_size, "train_steps": model.train_steps, "steps": result.steps,
             "checkpoint": result.checkpoint, "run_dir": result.run_dir, "val_metrics": result.val_metrics,
             "strategy": type(t.strategy).__name__, "environment": type(t.strategy.cluster_environment).__name__}
    with open(os.path.join(args.out, f"rank-{t.global_rank}.json"), "w") as fp:
        json.dump(facts, fp)
    torch.save(model.state_dict(), os.path.join(args.out, f"params-{t.global_rank}.pt"))


def plain_trainer(model, args, quiet) -> None:
    """The anchor: Lightning's own DDP under torchrun, a ModelCheckpoint every --checkpoint-every steps."""
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=args.plain_trainer, every_n_train_steps=args.checkpoint_every,
                                        save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=nodes,
                         strategy="ddp", max_steps=args.steps, logger=False, callbacks=[ckpt], **quiet)
    trainer.fit(model, DataLoader(data(256), batch_size=8, shuffle=True), DataLoader(data(64, seed=1), batch_size=8))


if __name__ == "__main__":
    main()
