"""A loop of the script's own whose DataLoader iterator (two workers, started by fork, persistent)
is still alive when the script ends: a module-level ``iter(loader)`` (tests/faults/test_exits.py).
``loader_outlives.py no-memfd``: as a Python without ``os.memfd_create`` (conda's)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

if sys.argv[1:] == ["no-memfd"]:
    del os.memfd_create  # its DataLoader workers, forked below, cannot answer a hang report
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = iter(DataLoader([torch.ones(4)] * 10_000, batch_size=2, num_workers=2, persistent_workers=True))
for _ in range(20):
    model(next(batches)).sum().backward()
    opt.step()
    opt.zero_grad()
print(f"rank {dist.get_rank()} done", flush=True)
