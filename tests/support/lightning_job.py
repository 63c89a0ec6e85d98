"""A Lightning 2.x training job for tests/test_lightning*.py (also run under torchrun).

``python lightning_job.py OUT [options]`` trains a small MLP with dropout on data with a random
augmentation (drawn from torch's global generator in ``__getitem__``), validating twice an epoch
on an augmented set, and resumes from ``OUT/ckpt/last.ckpt`` (``ckpt_path="last"``) when there
is one. Everything the run does is appended to ``OUT/records-rank<r>.jsonl``, one JSON object a
line: each training batch (epoch, batch, Lightning's epoch counters, optimizer step, sample
indices, a hash of the augmented input, the loss and the learning rate), each validation batch
(the same, no step or counters) and each epoch's start (with the learning rate after
Lightning's epoch-end scheduler steps) and end. The final weights, optimizer and scheduler
states go to ``OUT/final.pt``.

- ``--loader unbroken|torch``: ``unbroken.DataLoader`` with ``ExactResume`` (the README's
  recipe), or plain Lightning (torch's DataLoader, no unbroken callback); ``--val-loader``
  overrides the validation loader's kind.
- ``--checkpoint steps`` (``every_n_train_steps=--every``, the default) or ``epoch`` (Lightning's
  default ``ModelCheckpoint``, once an epoch); both ``save_last=True``.
- ``--accumulate K``, ``--scheduler onecycle|plateau`` (``ReduceLROnPlateau`` on a metric that
  never improves: logged in validation, and in the training step with ``--no-val``),
  ``--no-val``, ``--iterable`` (a training set without ``len()``), ``--epoch-metric`` (the
  training loss logged with ``on_epoch=True``), ``--workers N``, ``--datamodule``, ``--draw``
  (the training step draws from numpy's and ``random``'s global generators), ``--epochs E`` and
  ``--max-steps S`` (Lightning's bounds).
- ``--kill-at B`` SIGKILLs rank ``--kill-rank`` at the end of training batch B (counted from
  1 over the whole run); ``--signal-at B`` sends SIGTERM to the whole process group there, as a
  scheduler does (with ``--signal-rank R``, to rank R's process alone).
- ``--sweep saves``: in this one process, the uninterrupted run (``OUT/whole``) saving a
  checkpoint at every place Lightning can save one (every training batch's end, every validation's
  end, every training epoch's end: ``OUT/whole/cuts/NNN-hook.ckpt``), then a run resumed from each
  of them (``OUT/runs/NNN-hook/resumed``; ``--first kinds``: from the first of each kind of place
  only). ``--sweep signals``: the same with a run sent SIGTERM at the end of each training batch
  (``OUT/runs/signal-BBB/signalled``), then resumed from the ``last.ckpt`` it saved; a signalled
  run that ends without saving (exit 0: it had nothing left to train) is itself
  ``OUT/runs/signal-BBB/resumed``, with ``"finished": true``. ``--resumes R``: each resumed run
  saves everywhere too, numbering on from its checkpoint, and is resumed in turn from the first
  checkpoint of each kind it saved (``OUT/runs/NNN-hook+MMM-hook``), R resumes in a row.
  ``--resume-workers N``: the resumed runs with N workers. Each checkpoint holds the number of
  records written before it; ``OUT/runs/NAME/about.json`` has it, the run it resumed from, the
  step, where ``ExactResume`` says it was saved and the warnings unbroken gave. A resumed run is
  exact if the records of the run it resumed from before the cut followed by its own are that
  run's records, and its final states are that run's.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

import unbroken
from unbroken.lightning import ExactResume

N, BATCH = 96, 8  # the training set: 12 batches an epoch on one process


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234 + n)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i], i  # a random augmentation


class NoisyStream(torch.utils.data.IterableDataset):
    """The training set as a stream without ``len()``: Lightning then prefetches a batch."""

    def __init__(self, n: int) -> None:
        self.data = Noisy(n)

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data.x)))


def make_loader(args, train: bool):
    kind = args.loader if train else (args.val_loader or args.loader)
    dataset = NoisyStream(N) if train and args.iterable else Noisy(N if train else 32)
    shuffle = train and not args.iterable
    if kind == "torch":
        return torch.utils.data.DataLoader(
            dataset, batch_size=BATCH, shuffle=shuffle, num_workers=args.workers
        )
    return unbroken.DataLoader(dataset, batch_size=BATCH, shuffle=shuffle, num_workers=args.workers)


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


def digest(x: torch.Tensor) -> str:
    return hashlib.sha1(x.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


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
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.args.draw:  # the step itself draws from numpy's and random's generators
            loss = loss * (1 + 0.1 * (np.random.rand() + random.random() - 1))
        if self.args.epoch_metric:  # an epoch aggregate Lightning does not save
            self.log("train_loss", loss, on_step=False, on_epoch=True)
        if self.args.no_val and self.args.scheduler == "plateau":
            self.log("flat", 1.0)  # what ReduceLROnPlateau monitors without validation
        return {"loss": loss, "record": {"indices": index.tolist(), "x": digest(x)}}

    def validation_step(self, batch, batch_idx):
        x, y, index = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)
        self.log("flat", 1.0)  # a metric that never improves (ReduceLROnPlateau)
        return {"loss": loss, "record": {"indices": index.tolist(), "x": digest(x)}}

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.args.scheduler == "onecycle":
            # Lightning loads the training loader here, before it restores a checkpoint.
            total = self.trainer.estimated_stepping_batches
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.2, total_steps=total)
            return [optimizer], [{"scheduler": scheduler, "interval": "step"}]
        if self.args.scheduler == "plateau":
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            return [optimizer], [{"scheduler": scheduler, "monitor": "flat"}]
        return optimizer


class ModelWithData(Loaders, Model):
    """The loaders from the model's own hooks (the default)."""


def progress(trainer) -> list[int]:
    """Lightning's epoch progress counters, total then current (ready, started, processed,
    completed): where a checkpoint saved now would resume."""
    counts = trainer.fit_loop.epoch_progress
    fields = ("ready", "started", "processed", "completed")
    return [getattr(c, f) for c in (counts.total, counts.current) for f in fields]


class Recorder(L.Callback):
    """Appends what the run does to ``records-rank<r>.jsonl`` (see the module)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def write(self, trainer, **record) -> None:
        with open(self.out / f"records-rank{trainer.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        step, loss = trainer.global_step, repr(outputs["loss"].item())
        at = {"epoch": trainer.current_epoch, "batch": batch_idx, "progress": progress(trainer)}
        record = outputs["record"]
        self.write(trainer, kind="train", **at, step=step, loss=loss, lr=repr(lr), **record)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, idx=0):
        if trainer.sanity_checking:
            return
        at = {"epoch": trainer.current_epoch, "batch": batch_idx}
        self.write(
            trainer, kind="val", **at, loss=repr(outputs["loss"].item()), **outputs["record"]
        )

    def on_train_epoch_end(self, trainer, pl_module):
        self.write(trainer, kind="epoch_end", epoch=trainer.current_epoch)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        path = self.out / f"records-rank{trainer.global_rank}.jsonl"
        checkpoint["records_before"] = len(path.read_text().splitlines()) if path.exists() else 0

    def on_train_epoch_start(self, trainer, pl_module):
        # With the learning rate after the previous epoch's end (Lightning's epoch-end scheduler
        # steps): a step lost by a resume shows here, and in the final scheduler state.
        lr = repr(trainer.optimizers[0].param_groups[0]["lr"])
        self.write(trainer, kind="epoch", epoch=trainer.current_epoch, lr=lr)


class Interrupt(L.Callback):
    """Kills or signals this process at the end of a given training batch (a deterministic cut
    point; batches counted from 1 over the whole run)."""

    def __init__(self, args) -> None:
        self.args = args

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        per_epoch = trainer.num_training_batches
        if per_epoch == float("inf"):  # a training set without len(): Lightning's own count
            done = trainer.fit_loop.epoch_loop.total_batch_idx + 1
        else:
            done = trainer.current_epoch * per_epoch + batch_idx + 1
        if done == self.args.kill_at and trainer.global_rank == self.args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if done == self.args.signal_at and self.args.signal_rank >= 0:
            if trainer.global_rank == self.args.signal_rank:  # this rank alone
                os.kill(os.getpid(), signal.SIGTERM)
        elif done == self.args.signal_at and trainer.global_rank == 0:
            # From another process, as a scheduler's: a worker takes a SIGTERM sent by the
            # training process itself as torch's request to stop.
            group = os.getpgid(0)
            subprocess.run(["kill", "-s", "TERM", "--", f"-{group}"], start_new_session=True)


class SaveEverywhere(Checkpoint):
    """Saves a checkpoint at every place Lightning can save one (``--sweep saves``). A
    ``Checkpoint``, so that Lightning runs it where it runs ``ModelCheckpoint``: after the other
    callbacks. A run resumed from one of them numbers its own on from it, so that a resumed run's
    checkpoint has the number of the uninterrupted run's at the same place (if it resumed
    exactly)."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.saved = directory, 0
        directory.mkdir(parents=True, exist_ok=True)

    def save(self, trainer, hook: str) -> None:
        if not trainer.sanity_checking:
            self.saved += 1
            trainer.save_checkpoint(self.directory / f"{self.saved:03d}-{hook}.ckpt")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["saves_before"] = self.saved

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.saved = checkpoint.get("saves_before", 0)

    def on_train_batch_end(self, trainer, *args):
        self.save(trainer, "batch")

    def on_validation_end(self, trainer, pl_module):
        self.save(trainer, "val")

    def on_train_epoch_end(self, trainer, pl_module):
        self.save(trainer, "epoch")


def fit(args, out: Path, ckpt_path: str | None, extra: tuple = ()) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    torch.use_deterministic_algorithms(True)
    recorder = Recorder(out)
    callbacks: list = [recorder, Interrupt(args), *extra]
    if args.loader == "unbroken":
        callbacks.insert(1, ExactResume())  # after the Recorder: a save counts the batch's record
    every = {"every_n_train_steps": args.every} if args.checkpoint == "steps" else {}
    # --ckpt-url: the checkpoints in object storage (its endpoint and keys in AWS_* variables).
    dirpath = args.ckpt_url or out / "ckpt"
    callbacks.append(ModelCheckpoint(dirpath=dirpath, save_top_k=0, save_last=True, **every))
    trainer = L.Trainer(
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        callbacks=callbacks,
        val_check_interval=6 if args.iterable else 0.5,  # twice an epoch
        limit_val_batches=0 if args.no_val else None,
        num_sanity_val_steps=0 if args.no_val else 2,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    if args.datamodule:
        model: L.LightningModule = Model(args)
        trainer.fit(model, datamodule=Data(args), ckpt_path=ckpt_path)
    else:
        model = ModelWithData(args)
        trainer.fit(model, ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        final = {"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}
        if trainer.lr_scheduler_configs:
            final["scheduler"] = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        torch.save(final, out / "final.pt")
    return model


def sweep(args, out: Path) -> None:
    """The uninterrupted run, then runs resumed from each cut (``--sweep saves``: the
    checkpoints the uninterrupted run saved, all or the first of each kind (``--first``);
    ``--sweep signals``: a SIGTERM to the process group at the end of every training batch, each
    in a run of its own). With ``--resumes R`` > 1, each resumed run saves everywhere too, and is
    resumed in turn from the first checkpoint of each kind it saved, R resumes in a row."""
    whole = out / "whole"
    saves = args.sweep == "saves"
    whole.mkdir(parents=True)
    fit(args, whole, None, (SaveEverywhere(whole / "cuts"),) if saves else ())
    if saves:
        cuts = saved_cuts(whole / "cuts", every=args.first == "all")
    else:
        total = len([r for r in records(whole) if r["kind"] == "train"])
        cuts = [(f"signal-{b:03d}", b) for b in range(1, total + 1)]
    for name, cut in cuts:
        resume(args, out, "whole", name, cut, 1)


def saved_cuts(directory: Path, every: bool) -> list[tuple[str, Path]]:
    """The checkpoints a run saved, in order: all, or the first of each kind of place."""
    kinds, cuts = set(), []
    for cut in sorted(directory.iterdir()) if directory.exists() else []:
        state = torch.load(cut, weights_only=False)["callbacks"]["unbroken.ExactResume"]
        place = state["saved_at"]
        kind = (place["hook"], *sorted(k for k, v in place.items() if v is True))
        if every or kind not in kinds:
            kinds.add(kind)
            cuts.append((cut.stem, cut))
    return cuts


def resume(args, out: Path, parent: str, name: str, cut, depth: int) -> None:
    """Resume from ``cut`` (a checkpoint of the run ``parent``, or for ``--sweep signals`` the
    batch at whose end a run is signalled first) in ``OUT/runs/NAME/resumed``, then from its
    own checkpoints while ``depth`` < ``--resumes``."""
    run = out / "runs" / name
    deeper = depth < args.resumes
    changed = {**vars(args), "workers": args.resume_workers}
    resumed_args = argparse.Namespace(**changed) if args.resume_workers >= 0 else args
    finished = False
    resumed = run / "resumed"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if isinstance(cut, int):  # a run signalled at the end of batch `cut`, saving last.ckpt
            first = run / "signalled"
            first.mkdir(parents=True)
            try:
                fit(argparse.Namespace(**{**vars(args), "signal_at": cut}), first, None)
                # It ended (exit 0) before a place to save: the whole run, nothing to resume.
                finished, cut = True, None
                first.rename(resumed)
            except SystemExit as stop:
                assert stop.code == 75, stop.code
                cut = first / "ckpt" / "last.ckpt"
        saved = torch.load(cut, weights_only=False) if cut is not None else {}
        if not finished:
            resumed.mkdir(parents=True)
            extra = (SaveEverywhere(resumed / "cuts"),) if deeper else ()
            fit(resumed_args, resumed, None if cut is None else str(cut), extra)
    about = {
        "finished": finished,
        "parent": parent,
        "records_before": saved.get("records_before", 0),
        "global_step": saved.get("global_step", 0),
        "saved_at": saved.get("callbacks", {}).get("unbroken.ExactResume", {}).get("saved_at"),
        "warnings": [str(w.message) for w in caught if "unbroken" in str(w.message)],
    }
    (run / "about.json").write_text(json.dumps(about))
    if deeper:
        for child, child_cut in saved_cuts(resumed / "cuts", every=False):
            resume(args, out, name, f"{name}+{child}", child_cut, depth + 1)


def records(run: Path, rank: int = 0) -> list[dict]:
    path = run / f"records-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--loader", choices=["unbroken", "torch"], default="unbroken")
    parser.add_argument("--val-loader", choices=["unbroken", "torch"])
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--checkpoint", choices=["steps", "epoch"], default="steps")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--scheduler", choices=["none", "onecycle", "plateau"], default="none")
    parser.add_argument("--no-val", action="store_true")
    parser.add_argument("--epoch-metric", action="store_true")
    parser.add_argument("--iterable", action="store_true")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--signal-rank", type=int, default=-1)
    parser.add_argument("--datamodule", action="store_true")
    parser.add_argument("--ckpt-url")
    parser.add_argument("--sweep", choices=["saves", "signals"])
    parser.add_argument("--first", choices=["all", "kinds"], default="all")
    parser.add_argument("--resumes", type=int, default=1)
    parser.add_argument("--resume-workers", type=int, default=-1)
    parser.add_argument("--draw", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    if args.sweep:
        sweep(args, out)
    else:
        last = out / "ckpt" / "last.ckpt"
        if args.ckpt_url:  # Lightning's "last" loses the URL's protocol (ls): name the file
            from lightning.fabric.utilities.cloud_io import get_filesystem

            url = f"{args.ckpt_url}/last.ckpt"
            fit(args, out, url if get_filesystem(url).exists(url) else None)
        else:
            fit(args, out, "last" if last.exists() else None)
    if torch.distributed.is_initialized():
        # gloo's threads otherwise abort the exiting process now and then ("terminate called
        # without an active exception"), and torchrun reports the job failed; Lightning's DDP
        # model goes first (collected), as DDP torn down after its group aborts it too.
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
