"""ddprun.fit called at the top level of the script, outside ``if __name__ == "__main__":``, with
DataLoader workers (argv[1] per rank; tests/faults/test_bad_input.py). Every process that runs this
file's body says so: a worker started by forkserver or spawn would import it again."""

import os
import sys

import torch
from torch.utils.data import Dataset

import ddprun


class Squares(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        x = torch.tensor([i / 64.0])
        return x, x * x


print(f"the script's body runs in pid {os.getpid()}", flush=True)
result = ddprun.fit(torch.nn.Linear(1, 1), Squares(), loss_fn=torch.nn.functional.mse_loss, batch_size=8, epochs=1,
                    num_workers=int(sys.argv[1]), seed=0)
print(f"rank {ddprun.rank_info().rank}: trained {result.steps} steps", flush=True)
