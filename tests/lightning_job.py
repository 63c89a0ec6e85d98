"""A Lightning 2.x training job for tests/test_lightning.py (also run under torchrun).

``python lightning_job.py OUT --loader unbroken|torch [--workers N] [--kill-at STEP]
[--signal-at STEP] [--datamodule]``: trains a small MLP with dropout on data with random augmentation
(drawn from torch's global generator in ``__getitem__``), validating twice an epoch and saving
``last.ckpt`` every 5 steps, and resumes from it (``ckpt_path="last"``) when there is one. It
appends the sample indices of every training step to ``OUT/samples-rank<r>.txt`` and writes the
final weights to ``OUT/final.pt``. ``--kill-at`` SIGKILLs rank ``--kill-rank`` at the end of
that step; ``--signal-at`` sends SIGTERM to the whole process group, as a scheduler does.
With ``--loader torch`` it is plain Lightning: torch's DataLoader, no unbroken callback.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import unbroken
from unbroken.lightning import ExactResume


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i], i  # a random augmentation


def make_loader(args, train: bool):
    dataset = Noisy(96 if train else 32)
    if args.loader == "torch":
        return torch.utils.data.DataLoader(
            dataset, batch_size=8, shuffle=train, num_workers=args.workers
        )
    return unbroken.DataLoader(dataset, batch_size=8, shuffle=train, num_workers=args.workers)


class Loaders:
    """Lightning's loader hooks, for the model or a LightningDataModule."""

    args: argparse.Namespace

    def train_dataloader(self):
        return make_loader(self.args, True)

    def val_dataloader(self):
        return make_loader(self.args, False)


class Data(Loaders, L.LightningDataModule):
    """The loaders from a LightningDataModule (``--datamodule``) instead of the model."""

    def __init__(self, args) -> None:
        super().__init__()
        self.args = args


class Model(L.LightningModule):
    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 2)
        )

    def setup(self, stage: str) -> None:
        # After Lightning's DDP set-up re-seeded every rank alike: each rank's generators in
        # another state, so its dropout masks differ (a checkpoint needs every rank's states)
        # and so do the loaders' default seeds (rank 0's must be broadcast).
        torch.rand(self.global_rank)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        with open(Path(self.args.out) / f"samples-rank{self.global_rank}.txt", "a") as log:
            log.write(f"{self.trainer.global_step} {' '.join(map(str, index.tolist()))}\n")
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ModelWithData(Loaders, Model):
    """The loaders from the model's own hooks (the default)."""


class Interrupt(L.Callback):
    """Kills or signals this process at the end of a given step (a deterministic cut point)."""

    def __init__(self, args) -> None:
        self.args = args

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step, rank = trainer.global_step, trainer.global_rank
        if step == self.args.kill_at and rank == self.args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.args.signal_at and rank == 0:
            # From another process, as a scheduler's: a worker takes a SIGTERM sent by the
            # training process itself as torch's request to stop.
            group = os.getpgid(0)
            subprocess.run(["kill", "-s", "TERM", "--", f"-{group}"], start_new_session=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--loader", choices=["unbroken", "torch"], default="unbroken")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--datamodule", action="store_true")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    torch.use_deterministic_algorithms(True)

    callbacks: list = [Interrupt(args)]
    if args.loader == "unbroken":
        callbacks.insert(0, ExactResume())
    callbacks.append(
        ModelCheckpoint(
            dirpath=Path(args.out) / "ckpt", every_n_train_steps=5, save_top_k=0, save_last=True
        )
    )
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        callbacks=callbacks,
        val_check_interval=0.5,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    if args.datamodule:
        model = Model(args)
        trainer.fit(model, datamodule=Data(args), ckpt_path="last")
    else:
        model = ModelWithData(args)
        trainer.fit(model, ckpt_path="last")
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), Path(args.out) / "final.pt")


if __name__ == "__main__":
    sys.exit(main())
