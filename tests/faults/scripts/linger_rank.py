"""Every rank joins one barrier and writes ``<dir>/rank-N.pid``, then waits (at most 60 s) for
``<dir>/linger``, which names the rank that lingers: the others end their script at once (exit 0);
that one does work of its own, outside any collective, for up to 60 s (the test hurts its node then).

    ddprun run ... linger_rank.py DIR
"""

import os
import sys
import time

import torch.distributed as dist


def main() -> None:
    where = sys.argv[1]
    dist.init_process_group("gloo")
    dist.barrier()
    rank = dist.get_rank()
    with open(os.path.join(where, f"rank-{rank}.pid.tmp"), "w") as fp:
        fp.write(str(os.getpid()))
    os.rename(os.path.join(where, f"rank-{rank}.pid.tmp"), os.path.join(where, f"rank-{rank}.pid"))
    named, deadline = os.path.join(where, "linger"), time.monotonic() + 60
    while not os.path.exists(named) and time.monotonic() < deadline:
        time.sleep(0.05)
    lingers = os.path.exists(named) and open(named).read().strip() == str(rank)
    dist.destroy_process_group()
    if lingers:
        time.sleep(60)


if __name__ == "__main__":
    main()
