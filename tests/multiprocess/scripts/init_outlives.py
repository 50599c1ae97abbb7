"""A script that calls ddprun.init() under a launcher other than ``ddprun run`` (here torchrun) and
frees its DDP model after ``destroy_process_group``, as ddp_outlives_group.py does under ddprun run.

Without ddprun's exit handling (pgkeep.py, runtime._destroy_at_exit) a rank aborted with SIGABRT at
exit in 3 of 4 runs here, after its training was done. Prints one line a rank before exiting.
``--plain``: the same script with torch's own ``init_process_group`` in place of ddprun.init(), the
anchor of ``benchmarks/exit_stress.py --library``."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddprun

if "--plain" in sys.argv:
    dist.init_process_group("gloo")
    info = ddprun.rank_info()
else:
    info = ddprun.init()
# a bucket per layer: several gloo works per backward
model = DDP(nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)]), bucket_cap_mb=0.0001)
for _ in range(3):
    model(torch.randn(4, 8)).sum().backward()
dist.destroy_process_group()
del model  # the Reducer's reference to the group
print(f"rank {info.rank} of {info.world_size} (pid {os.getpid()}) freed its DDP model after destroy_process_group",
      flush=True)
