"""A loop of the script's own that leaves its DataLoader early (a ``break``, as an evaluation that
stops after a few batches does) while its one worker is blocked in ``__getitem__`` of the second
sample, opening a FIFO nobody writes (tests/faults/test_exits.py). torch's shutdown of the iterator
joins the worker for 5 s, then terminates it (SIGTERM). ``loader_dropped.py FIFO PIDFILE [safe]``:
the worker started by fork (torch's default on Linux up to Python 3.13), with ``safe``
``ddprun.safe_worker_init()`` as its ``worker_init_fn``. Prints the worker's fate."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import ddprun


class Stuck(Dataset):
    def __init__(self, fifo: str, pidfile: str):
        self.fifo, self.pidfile = fifo, pidfile

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 1:
            with open(self.pidfile, "w") as fp:
                fp.write(str(os.getpid()))
            with open(self.fifo) as fp:  # blocks until a writer opens it: never
                fp.read()
        return torch.ones(4)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    fifo, pidfile = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    init = ddprun.safe_worker_init() if sys.argv[3:] == ["safe"] else None
    loader = DataLoader(Stuck(fifo, pidfile), batch_size=1, num_workers=1, prefetch_factor=2,
                        worker_init_fn=init)
    for _batch in loader:  # the worker took samples 0 and 1 at once; it blocks in 1
        deadline = time.monotonic() + 30
        while not os.path.exists(pidfile) and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        break  # torch's shutdown of the iterator runs here
    pid = int(open(pidfile).read())
    while alive(pid) and time.monotonic() - started < 10:
        time.sleep(0.1)
    print(f"rank {dist.get_rank()}: the blocked worker {'is still alive' if alive(pid) else 'ended'} "
          f"{time.monotonic() - started:.1f} s after the loop left its DataLoader", flush=True)
