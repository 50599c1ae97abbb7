"""boring_unmodified.py for the standalone pytorch_lightning package: its BoringModel, a Trainer built
by hand, no ddprun import.

    ddprun run ... pl_boring_unmodified.py --devices 1 --num-nodes 1 --strategy auto
"""

import argparse

from pytorch_lightning import Trainer
from pytorch_lightning.demos.boring_classes import BoringModel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--max-steps", type=int, default=4)
    args = p.parse_args()
    trainer = Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=args.strategy,
                      max_steps=args.max_steps, limit_val_batches=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(BoringModel())


if __name__ == "__main__":
    main()
