"""A DDP model freed after ``destroy_process_group`` (as a script's ``main()`` returning frees it), in
a script that makes its process group twice (an evaluation phase, a resize).

Under torch 2.13 the second free deadlocked a gloo rank (src/ddprun/pgkeep.py says why); a ddprun worker
keeps each destroyed group alive to its exit, so every rank prints its lines and exits 0."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def phase(n: int, store: dist.Store) -> None:
    # each phase's keys apart: env:// again would read the last phase's gloo addresses
    dist.init_process_group("gloo", store=dist.PrefixStore(f"phase-{n}", store), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    # a bucket per layer: several gloo works per backward
    model = DDP(nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)]), bucket_cap_mb=0.0001)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    dist.destroy_process_group()
    del model  # the Reducer's reference to the group was the last one
    print(f"rank {os.environ['RANK']} freed its DDP model of phase {n} after destroy_process_group", flush=True)


# a client of the launcher's store (MASTER_ADDR:MASTER_PORT under torchrun and ddprun alike)
STORE = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=timedelta(seconds=30))
for n in range(3):
    phase(n, STORE)
