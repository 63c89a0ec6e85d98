"""Datasets shared by the tests: small, deterministic, and random in every way users are."""

from __future__ import annotations

import random

import numpy as np
import torch

import unbroken


class Augmented(torch.utils.data.Dataset):
    """Each sample draws from torch's, numpy's and random's global RNGs and sample_rng()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        return {
            "index": torch.tensor(index),
            "torch": torch.rand(2),
            "numpy": torch.from_numpy(np.random.rand(2)),
            "random": torch.tensor([random.random()]),
            "own": torch.randint(0, 1 << 30, (2,), generator=unbroken.sample_rng()),
        }


class Counting(torch.utils.data.Dataset):
    """Counts fetches (in this process), to prove that resuming reads nothing it skips."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        self.fetched.append(index)
        return torch.tensor(index)


class Stateless(torch.utils.data.Sampler):
    """A sampler whose order depends on its epoch, with no state_dict: resumed by skipping."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())


class Positioned(torch.utils.data.IterableDataset):
    """torch's Stateful protocol: its state, a position, is the user's. ``__iter__`` continues
    from the state, so each fresh epoch must start from the state as constructed."""

    def __init__(self, n, start=0):
        self.n, self.position = n, start

    def __iter__(self):
        while self.position < self.n:
            self.position += 1
            yield self.position - 1

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]
