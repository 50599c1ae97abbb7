"""Started by the cluster's own launcher, one process per rank (mpirun, or srun tasks; no ddprun
run): ddprun.init() reads the ranks from that launcher's variables, joins a gloo group, trains a
tiny DDP model a few steps, and writes OUT/rank-<R>.json (what init returned, the launcher's own
variables, the host) and OUT/params-<R>.pt. A bad allocation makes ddprun.init() raise first."""

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddprun

LAUNCHER_KEYS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID",
                 "SLURM_NODEID", "SLURM_NTASKS", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")

def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    info = ddprun.init()
    torch.manual_seed(0)  # the same initial weights everywhere; DDP checks it too
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + info.rank)  # different data on every rank
    for _ in range(args.steps):
        x = torch.randn(32, 8, generator=g)
        loss = nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    os.makedirs(args.out, exist_ok=True)
    facts = {"rank": info.rank, "local_rank": info.local_rank, "node_rank": info.node_rank,
             "world_size": info.world_size, "local_world_size": info.local_world_size,
             "device": str(info.device), "is_main": info.is_main, "distributed": info.distributed,
             "backend": info.backend, "group_rank": dist.get_rank(), "group_size": dist.get_world_size(),
             "host": socket.gethostname(), "steps": args.steps,
             **{k: os.environ.get(k) for k in LAUNCHER_KEYS}}
    with open(os.path.join(args.out, f"rank-{info.rank}.json"), "w") as f:
        json.dump(facts, f)
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, os.path.join(args.out, f"params-{info.rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
