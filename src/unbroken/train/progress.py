"""The Trainer's loop counters (checkpointed) and its progress bar (tqdm).

``Progress`` is everything the loop needs to know where it is: epoch, phase, batch and step
counts, the position inside a gradient-accumulation window, and the running loss sum of the
current phase (a Python float, so the epoch mean after a resume is the same bits). It also
holds the computation-shaping configuration, checked on resume.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any


_COUNTERS = ("epoch", "batches", "steps", "micro", "epoch_batches", "val_batches", "ticks", "count")


class Progress:
    def __init__(self, config: dict) -> None:
        self.config = config
        self.epoch = 0
        self.phase = "train"  # "train", then "val" (if there is a val loader), then "end"
        self.batches = 0  # training batches, all epochs
        self.steps = 0  # optimizer steps
        self.micro = 0  # batches in the current accumulation window
        self.epoch_batches = 0  # training batches this epoch
        self.val_batches = 0  # validation batches this epoch
        self.ticks = 0  # every batch, training or validation: names checkpoints
        self.loss_sum, self.count = 0.0, 0  # the current phase's running loss
        self.saved_at = -1  # ticks at the last checkpoint (not saved: a load sets it)

    def start_phase(self) -> None:
        self.loss_sum, self.count = 0.0, 0

    def batch_done(self, loss: float) -> None:
        self.batches += 1
        self.epoch_batches += 1
        self.micro += 1
        self._tick(loss)

    def val_batch_done(self, loss: float) -> None:
        self.val_batches += 1
        self._tick(loss)

    def _tick(self, loss: float) -> None:
        self.ticks += 1
        self.loss_sum += loss
        self.count += 1

    def optimizer_step_done(self) -> None:
        self.steps += 1
        self.micro = 0

    def phase_mean(self) -> float:
        return self.loss_sum / self.count if self.count else math.nan

    def next_epoch(self) -> None:
        self.epoch += 1
        self.phase = "train"
        self.epoch_batches = self.val_batches = 0

    def state_dict(self) -> dict:
        state = {name: getattr(self, name) for name in _COUNTERS}
        return {**state, "phase": self.phase, "loss_sum": self.loss_sum, "config": dict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        for field, current in self.config.items():
            saved = state["config"].get(field)
            if saved != current:
                raise ValueError(
                    f"unbroken.Trainer: the checkpoint was saved by a run with {field}={saved!r}, "
                    f"but this Trainer has {field}={current!r}. The checkpoint directory belongs "
                    f"to a run with other settings: pass {field}={saved!r} again, or train in a "
                    "new directory.")
        for name in _COUNTERS:
            setattr(self, name, int(state[name]))
        self.phase, self.loss_sum = state["phase"], float(state["loss_sum"])
        self.saved_at = self.ticks


class _Bar:
    """Iterates the loader itself and only tells tqdm how far it got: tqdm never sees the
    loader, so it cannot create iterators of its own (tqdm.auto calls ``iter()`` eagerly)."""

    def __init__(self, bar: Any, loader: Any, progress: Progress) -> None:
        self._bar, self._loader, self._progress = bar, loader, progress
        self._started, self._seen = time.perf_counter(), 0

    def __iter__(self):
        for item in self._loader:
            self._seen += 1
            yield item

    def show(self, loss: float) -> None:
        self._bar.update(1)
        if self._bar.disable:
            return
        rate = self._seen / max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix(step=self._progress.steps, loss=f"{loss:.4f}",
                              batches_per_s=f"{rate:.1f}", refresh=False)


@contextmanager
def bar(enabled: bool, loader: Any, progress: Progress, phase: str):
    """A tqdm bar over ``loader`` showing epoch, step, loss and throughput."""
    from tqdm import tqdm  # imported here: the library itself needs no tqdm to import

    done = progress.epoch_batches if phase == "train" else progress.val_batches
    try:
        total = len(loader)
    except TypeError:
        total = None
    display = tqdm(total=total, initial=done, disable=not enabled or None, leave=False,
                   desc=f"epoch {progress.epoch} {phase}", dynamic_ncols=True)
    try:
        yield _Bar(display, loader, progress)
    finally:
        display.close()
