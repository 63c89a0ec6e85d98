"""Subprocess jobs for the streaming tests: ``read`` reads a whole sharded dataset through the
loader and prints its ids and downloads; ``hang-in-download`` writes half of its first shard's
download and hangs there, to be SIGKILLed; ``train RUN KILL_AT`` trains a small model with the
Trainer from the dataset (2 workers, augmentation, dropout) and SIGKILLs itself after training
batch KILL_AT (-1: never), saving the final weights to RUN/final.pt when it completes."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

import unbroken
from unbroken.streaming import StreamingDataset
from unbroken.streaming.remote import Remote


def features(row: dict) -> tuple[torch.Tensor, int]:
    x = torch.frombuffer(bytearray(row["x"]), dtype=torch.uint8)[:8].float() / 255
    x = x + 0.05 * torch.randn(8) * random.uniform(0.5, 1.5)  # torch and `random` draws
    return x, row["label"]


class KillAt:
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer, logs) -> None:
        if trainer.progress.batches == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


def train(url: str, cache: str, options: dict, run: str, kill_at: int) -> None:
    trainer = unbroken.Trainer(
        run, max_epochs=2, seed=0, checkpoint_every_steps=4, progress_bar=False,
        callbacks=[KillAt(kill_at)],
    )  # fmt: skip
    ds = StreamingDataset(url, cache_dir=cache, storage_options=options, window_shards=2)
    loader = unbroken.DataLoader(
        ds.map(features), batch_size=16, shuffle=True, num_workers=2, seed=3
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 7)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    trainer.fit(model, optimizer, loader, training_step=step)
    torch.save(model.state_dict(), Path(run) / "final.pt")


def main() -> None:
    mode, url, cache, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    if mode == "train":
        train(url, cache, options, sys.argv[5], int(sys.argv[6]))
        return
    if mode == "hang-in-download":
        real = Remote.download

        def hang(self, name, local):
            real(self, name, local)
            with open(local, "r+b") as file:
                file.truncate(file.seek(0, 2) // 2)
            print("downloading", flush=True)
            time.sleep(600)

        Remote.download = hang  # type: ignore[method-assign]
    ds = StreamingDataset(url, cache_dir=cache, storage_options=options)
    loader = unbroken.DataLoader(ds, batch_size=32, num_workers=0)
    ids = torch.cat([batch["id"] for batch in loader]).tolist()
    print(json.dumps({"ids": ids, "downloads": ds.cache.downloads}), flush=True)


if __name__ == "__main__":
    main()
