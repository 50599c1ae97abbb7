"""A plain DDP training script written against torchrun's environment contract only.

Runs unmodified under both launchers:
    torchrun   --nnodes 1 --nproc-per-node 2 examples/torchrun_style.py --steps 50
    ddprun run --nnodes 1 --nproc-per-node 2 examples/torchrun_style.py --steps 50

With --out DIR every rank writes DIR/rank-<RANK>.json (what it saw) and DIR/params-<RANK>.pt
(its final parameters), which the tests compare across ranks and launchers.
"""

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--fail-rank", type=int, default=None, help="this rank raises at step 3 (tests)")
    p.add_argument("--hang-rank", type=int, default=None, help="this rank sleeps forever at step 3 (tests)")
    p.add_argument("--destroy", action="store_true", help="call destroy_process_group at the end")
    args = p.parse_args()

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")

    torch.manual_seed(0)  # identical initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(2048, 1, generator=g))
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if args.fail_rank == rank and step == 3:
                raise RuntimeError(f"injected failure on rank {rank}")
            if args.hang_rank == rank and step == 3:
                print(f"rank {rank} hangs at step {step}", flush=True)
                time.sleep(10**6)
            xb, yb = xb.to(device), yb.to(device)
            loss = nn.functional.mse_loss(ddp(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and (step % 10 == 0 or step == args.steps):
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
        epoch += 1

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        facts = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                                                "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS",
                                                "GLOO_SOCKET_IFNAME")}
        facts.update(host=socket.gethostname(), pid=os.getpid(), device=str(device), steps=step)
        with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
            json.dump(facts, f)
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()},
                   os.path.join(args.out, f"params-{rank}.pt"))
    if args.destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
