"""Lightning's BoringModel with ``Trainer(**ddprun.lightning.trainer_kwargs(), max_steps=...)``, run by
``srun ddprun run`` (one task per node). With --out every rank writes OUT/rank-<global rank>.json (what
its Trainer saw, the steps it ran, its host) and OUT/params-<global rank>.pt at the end of fit."""

import argparse
import json
import os
import socket

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from ddprun.lightning import trainer_kwargs


class Facts(Callback):
    def __init__(self, out):
        self.out, self.steps = out, 0

    def on_train_batch_end(self, trainer, *args):
        self.steps += 1

    def on_fit_end(self, trainer, pl_module):
        os.makedirs(self.out, exist_ok=True)
        env = trainer.strategy.cluster_environment
        facts = {"global_rank": trainer.global_rank, "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
                 "world_size": trainer.world_size, "num_nodes": trainer.num_nodes,
                 "devices": trainer.num_devices, "steps": self.steps, "global_step": trainer.global_step,
                 "cluster_environment": type(env).__name__ if env is not None else None,
                 "host": socket.gethostname(), "SLURM_NODEID": os.environ.get("SLURM_NODEID")}
        with open(os.path.join(self.out, f"rank-{trainer.global_rank}.json"), "w") as fp:
            json.dump(facts, fp)
        torch.save({k: v.detach().cpu() for k, v in pl_module.state_dict().items()},
                   os.path.join(self.out, f"params-{trainer.global_rank}.pt"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    trainer = Trainer(**trainer_kwargs(), max_steps=args.max_steps, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Facts(args.out)])
    trainer.fit(BoringModel())


if __name__ == "__main__":
    main()
