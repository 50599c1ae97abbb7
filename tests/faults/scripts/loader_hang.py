"""DDP with a DataLoader of one worker, whose dataset blocks in ``__getitem__`` of rank 1 at its 31st
sample, opening a FIFO nobody writes, as a read from a hung network file system does
(tests/faults/test_stalls.py). ``loader_hang.py FIFO``: a loop of the script's own, its worker started
by fork (torch's default on Linux up to Python 3.13); ``loader_hang.py FIFO fit``: ddprun.fit (a
forkserver worker)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import ddprun


class Stuck(Dataset):
    def __init__(self, fifo: str):
        self.fifo, self.served = fifo, 0  # in each worker process its own count

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        self.served += 1
        if self.served > 30 and os.environ["RANK"] == "1":
            with open(self.fifo) as fp:  # blocks until a writer opens it: never
                fp.read()
        return torch.ones(4)


def own_loop(data: Dataset) -> None:
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x in DataLoader(data, batch_size=2, num_workers=1):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    if sys.argv[2:] == ["fit"]:
        ddprun.fit(torch.nn.Linear(4, 1), Stuck(sys.argv[1]), training_step=lambda model, x: model(x).sum(),
                   batch_size=2, epochs=1, num_workers=1)
    else:
        own_loop(Stuck(sys.argv[1]))
