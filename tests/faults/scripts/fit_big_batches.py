"""ddprun.fit with one DataLoader worker per rank and 16 MiB samples in batches of 8: 128 MiB a
batch through shared memory (tests/faults/test_containers.py, a 64 MiB /dev/shm)."""

import torch
from torch.utils.data import Dataset

import ddprun


class Big(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return torch.zeros(4096, 1024), torch.tensor(0.0)


class Mean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1024, 1)

    def forward(self, x):
        return self.linear(x).mean(dim=(1, 2))


if __name__ == "__main__":
    ddprun.fit(Mean(), Big(), loss_fn=torch.nn.functional.mse_loss, batch_size=8, epochs=1, num_workers=1)
    print("trained", flush=True)
