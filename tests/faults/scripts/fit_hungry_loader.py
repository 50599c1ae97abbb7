"""ddprun.fit with one DataLoader worker whose dataset keeps 64 MiB more at every sample it loads, as
a dataset that caches what it decodes does: in a container with a memory limit the out-of-memory
killer ends that worker, the largest process (tests/faults/test_containers.py)."""

import torch
from torch.utils.data import Dataset

import ddprun

KEPT: list[bytearray] = []


class Caching(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        KEPT.append(bytearray(64 << 20))  # zeroed, so resident
        return torch.ones(4), torch.tensor(1.0)


if __name__ == "__main__":
    model = torch.nn.Linear(4, 1)
    ddprun.fit(model, Caching(), loss_fn=lambda out, y: torch.nn.functional.mse_loss(out.squeeze(1), y),
               batch_size=2, epochs=1, num_workers=1)
    print("trained", flush=True)
