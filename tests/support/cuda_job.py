"""A small CUDA training job for tests/jobs/test_cuda.py and benchmarks/gpu.py: a CNN on augmented
images, a pinned multi-worker loader, mixed precision, deterministic kernels; optionally SIGKILLs
itself (as a crash would) after a given number of optimizer steps (``kill_after``) or inside a
step, after its forward (``kill_in_step``), leaving whatever checkpoints it wrote. ``device``:
"cpu" runs the same job without a GPU (no pinned memory), for a dry run.

    python tests/support/cuda_job.py DIR '{"precision": "bf16", "kill_after": 7}'
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import unbroken


class Images(torch.utils.data.Dataset):
    """Random 3x16x16 images with a random flip and noise from torch's global generator."""

    def __init__(self, n: int = 96) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=generator)
        self.y = torch.randint(0, 4, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x + 0.05 * torch.randn_like(x), self.y[index]


class KillAfter:
    """SIGKILL this process once the run has made `steps` optimizer steps in this process."""

    def __init__(self, steps: int) -> None:
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, trainer, logs) -> None:
        self.seen += 1
        if self.seen >= self.steps:
            os.kill(os.getpid(), signal.SIGKILL)


def run(
    directory: Path,
    precision: str = "bf16",
    kill_after: int | None = None,
    kill_in_step: int | None = None,
    device: str = "cuda",
) -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Conv2d(16, 16, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = unbroken.DataLoader(
        Images(),
        batch_size=8,
        shuffle=True,
        num_workers=2,
        pin_memory=device == "cuda",
        seed=5,
        persistent_workers=True,
    )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    steps = 0

    def step(model, batch):
        nonlocal steps
        x, y = (t.to(device, non_blocking=True) for t in batch)
        assert device != "cuda" or batch[0].is_pinned(), "pin_memory=True must give pinned batches"
        with torch.autocast(device, dtype=dtype):
            output = model(x)
            steps += 1
            if steps == kill_in_step:  # mid-step: the batch drawn, its forward run, no backward
                os.kill(os.getpid(), signal.SIGKILL)
            return nn.functional.cross_entropy(output, y)

    trainer = unbroken.Trainer(
        directory,
        max_epochs=3,
        seed=0,
        checkpoint_every_steps=2,
        deterministic=True,
        progress_bar=False,
        tensorboard=False,
        callbacks=[KillAfter(kill_after)] if kill_after else [],
    )
    trainer.fit(model, optimizer, loader, scaler=scaler, training_step=step)
    return model


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    model = run(directory, **json.loads(sys.argv[2]))
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, directory / "final.pt")
