"""Train one small regression model with ddprun.fit and/or a hand-written DDP loop; save the params.

    python fit_params.py --out DIR [--mode fit|raw|both] [--batch-size B] [--steps N]

Runs under `ddprun run`, torchrun or plain python. Every rank writes DIR/<mode>-<RANK>.pt (its final
parameters) and DIR/<mode>-<RANK>.json (world size, steps, run dir). Both loops use the same data
order (DistributedSampler, shuffle, seed 0), model init (seed 0), SGD and MSE, so their results can
be compared bit for bit.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddprun

LR = 0.05


def data(n=256):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))


def with_fit(args):
    res = ddprun.fit(model(), data(), loss_fn=nn.functional.mse_loss,
                     optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                     batch_size=args.batch_size, max_steps=args.steps, seed=0, log_every=5)
    return res.model, {"steps": res.steps, "run_dir": res.run_dir, "checkpoint": res.checkpoint,
                       "train_loss": res.train_loss}


def by_hand(args):
    """The minimum DDP loop (nanoGPT's shape), with fit's settings."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    ddp = nn.parallel.DistributedDataParallel(net)
    ds = data()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=False)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    return net, {"steps": step}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["fit", "raw", "both"], default="fit")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for mode in (["fit", "raw"] if args.mode == "both" else [args.mode]):
        net, facts = (with_fit if mode == "fit" else by_hand)(args)
        rank = dist.get_rank() if dist.is_initialized() else 0
        facts.update(rank=rank, world_size=dist.get_world_size() if dist.is_initialized() else 1)
        torch.save({k: v.detach().cpu() for k, v in net.state_dict().items()},
                   os.path.join(args.out, f"{mode}-{rank}.pt"))
        with open(os.path.join(args.out, f"{mode}-{rank}.json"), "w") as f:
            json.dump(facts, f)


if __name__ == "__main__":
    main()
