"""A rank that leaves a ``multiprocessing.Pool`` block (fork, Linux's default up to Python 3.13)
while its workers still work: ``Pool.__exit__`` terminates them (SIGTERM), then joins them
(tests/faults/test_exits.py)."""

import multiprocessing
import time

import torch.distributed as dist


def slow(x: int) -> int:
    time.sleep(30)
    return x


if __name__ == "__main__":
    dist.init_process_group("gloo")
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map_async(slow, range(4))
        time.sleep(1)
    print(f"rank {dist.get_rank()} done", flush=True)
