"""The workloads the benchmarks train on: random rows, random CIFAR-sized images, their models.

Everything is built from fixed seeds, so every system in a comparison sees the same data and
starts from the same weights. The datasets are precomputed tensors: a few MB, built in
milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


class RowDataset(torch.utils.data.Dataset):
    """BoringModel's RandomDataset: a precomputed tensor of random rows."""

    def __init__(self, rows: int, size: int = 32) -> None:
        self.data = torch.randn(rows, size, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class ImageDataset(torch.utils.data.Dataset):
    """Random CIFAR-sized images with labels in [0, 10). ``augment``: uint8 images with a random
    crop (pad 4) and flip drawn from the global torch RNG; else precomputed float images."""

    def __init__(self, n: int, augment: bool = True) -> None:
        g = torch.Generator().manual_seed(2)
        self.augment = augment
        if augment:
            self.images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
        else:
            self.images = torch.randn(n, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        if not self.augment:
            return self.images[i], self.labels[i]
        img = F.pad(self.images[i], (4, 4, 4, 4))
        top, left = torch.randint(0, 9, (2,)).tolist()
        img = img[:, top : top + 32, left : left + 32]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        return img.float().div_(255.0), self.labels[i]


def tiny_model() -> torch.nn.Module:
    return torch.nn.Linear(32, 2)


def tiny_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    out = model(batch)
    return F.mse_loss(out, torch.ones_like(out))


def cnn_model() -> torch.nn.Module:
    """2 conv + linear, 10 classes, for 3x32x32 images."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 10),
    )


def cnn_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss: Any = tiny_loss
) -> None:
    """One SGD step: ``loss(model, batch)``, backward, step."""
    value = loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    value.backward()
    optimizer.step()


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter in one flat copy, to compare two runs' results with ``torch.equal``."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def weights_equal(a: Path, b: Path, key: str | None = None) -> bool:
    """Whether two saved state dicts (``torch.load(path)[key]`` with a key) are bit-equal."""
    x, y = torch.load(a, weights_only=key is None), torch.load(b, weights_only=key is None)
    if key is not None:
        x, y = x[key], y[key]
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
