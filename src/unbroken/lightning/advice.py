"""What ``ExactResume`` warns about: the places where exactness is out of its hands, and what to
do instead. Each kind of warning is given once per callback, by the first rank only.

- a checkpoint saved, or resumed from, where Lightning does not go on exactly
  (``loops.Place.problems``), and where to save instead (``AVOID``);
- a training loader whose prefetched batches Lightning's saved state counts, or whose position
  Lightning dropped;
- torch ``DataLoader``s in the fit: their position is not saved, and a SIGTERM to the process
  group kills their workers before anything is saved;
- epoch-level values and ``ReduceLROnPlateau`` monitors that a resume leaves short;
- numpy or ``random`` draws after a resume that moved a loader between 0 and more workers
  (``draws``);
- a ``ModelCheckpoint`` that writes no checkpoint at all (``save_top_k=0`` without
  ``save_last``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from ..data.loader import DataLoader
from . import loops

WHAT = "unbroken.lightning.ExactResume"

AVOID = (
    "Weights and data stay exact unless what is skipped changes the training. To avoid it, save "
    "at validation ends, where Lightning resumes exactly: "
    "ModelCheckpoint(save_on_train_epoch_end=False, save_last=True) without "
    "every_n_train_steps, with "
    "val_check_interval setting how often. "
    "every_n_train_steps=n lands on an epoch's last batch every lcm(n, optimizer steps an "
    "epoch) steps, whatever n. ExactResume's own preemption save always waits for an exact place."
)


class Advice:
    """The warnings of one ``ExactResume``; ``first``: whether this rank gives them."""

    def __init__(self) -> None:
        self.first = True
        self._given: set[str] = set()

    def once(self, kind: str, message: str) -> None:
        """Warn of ``kind`` unless it was given already (or this is not the first rank)."""
        if kind in self._given or not self.first:
            return
        self._given.add(kind)
        warnings.warn(f"{WHAT}: {message}", stacklevel=4)  # at the caller of ExactResume's hook

    def saved_inexactly(self, place: loops.Place) -> None:
        problems = place.problems()
        self.once(
            "save:" + ",".join(problems),
            "a checkpoint is being saved where Lightning cannot resume exactly: "
            f"{'; '.join(problems)}. {AVOID}",
        )

    def prefetched(self, ahead: int, loader: Any) -> None:
        self.once(
            "prefetch",
            f"Lightning fetched {ahead} batch(es) of {type(loader).__name__} ahead of the "
            "training step (it does so for loaders without len()), and the state it saves "
            "counts them: a resumed run skips them. Give the dataset __len__, or use an "
            "unbroken.DataLoader (whose state is corrected).",
        )

    def dropped(self, loader: Any) -> None:
        self.once(
            "dropped",
            f"Lightning did not restore the position of the training loader "
            f"{type(loader).__name__} (it does not when the checkpoint was taken at an "
            "epoch's end, or when trainer.estimated_stepping_batches is read in "
            "configure_optimizers): the epoch restarts from its beginning. Use an "
            "unbroken.DataLoader for training.",
        )

    def torch_loaders(self, trainer: Trainer, signals: tuple) -> None:
        """torch ``DataLoader``s in the fit (``unbroken.DataLoader`` is one too: not those)."""
        for phase, loader in loops.all_loaders(trainer):
            if not isinstance(loader, torch.utils.data.DataLoader) or isinstance(
                loader, DataLoader
            ):
                continue
            if phase == "train":
                self.once(
                    "torch-train",
                    "the training loader is torch's DataLoader, whose position Lightning does "
                    "not save: a run resumed mid-epoch reshuffles the epoch and repeats and "
                    "skips samples. Use unbroken.DataLoader (the same arguments).",
                )
            if loader.num_workers > 0 and signals:
                self.once(
                    "torch-workers",
                    f"a {phase} loader is torch's DataLoader with num_workers="
                    f"{loader.num_workers}. Schedulers send SIGTERM to the whole process group: "
                    "torch's workers die of it, and the run fails with 'DataLoader worker ... "
                    "killed by signal' before the preemption checkpoint is saved. unbroken's "
                    "workers outlive it: use unbroken.DataLoader for every loader of the fit.",
                )

    def partial_epoch_metrics(self, partial: list[str], before: int) -> None:
        self.once(
            "partial-epoch-metrics",
            f"the epoch-level values of {partial} (self.log(on_epoch=True) in training_step) "
            "cover only the batches since the resume: Lightning does not save their running "
            f"sums, and this epoch had {before} batches before it. Log epoch values from "
            "validation, or from a torchmetrics Metric kept in the LightningModule with "
            "persistent state.",
        )

    def plateau(self, missing: list[str]) -> None:
        self.once(
            "plateau",
            "ReduceLROnPlateau does not step at the end of this epoch, as in the run that saved "
            f"the checkpoint: its metric {missing} is not available after the resume (an epoch "
            "aggregate of training batches run before it). Monitor a validation metric.",
        )

    def writes_nothing(self, trainer: Trainer) -> None:
        """A ``ModelCheckpoint`` with ``save_top_k=0`` and no ``save_last`` never writes a file."""
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint):
                continue
            if callback.save_top_k == 0 and not callback.save_last:
                self.once(
                    "writes-nothing",
                    f"ModelCheckpoint(dirpath={callback.dirpath!r}) has save_top_k=0 and no "
                    "save_last: it writes no checkpoint, so a run killed (not preempted) starts "
                    "again from its beginning. Give it save_last=True: it writes last.ckpt "
                    'where it saves, which ckpt_path="last" resumes from (save_top_k=0 keeps '
                    "no other checkpoint).",
                )

    def draws(self, said: str | None) -> None:
        if said is not None:
            self.once("draws", said)


def resumed_inexactly(place: dict[str, Any] | None, first: bool) -> None:
    """Said as a checkpoint saved where Lightning cannot go on exactly loads: resumed at its
    last epoch's end, Lightning trains no more and calls no hook after that."""
    saved_at = loops.Place(**place) if place is not None else None
    if saved_at is not None and not saved_at.exact and first:
        warnings.warn(
            f"{WHAT}: resuming from a checkpoint saved where Lightning cannot go on exactly "
            f"(at {saved_at.hook}): {'; '.join(saved_at.problems())}. {AVOID}",
            stacklevel=3,
        )
