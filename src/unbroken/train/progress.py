"""The Trainer's loop counters (checkpointed) and its progress bar (tqdm).

``Progress`` is everything the loop needs to know where it is: epoch, phase, batch and step
counts, the position inside a gradient-accumulation window, and the running loss sum of the
current phase (a Python float, so the epoch mean after a resume is the same bits). It also
holds the computation-shaping configuration, checked on resume.

Its saved state is ``ProgressState``: plain ints, a phase name, a float and the configuration,
one small dict; ``load_state_dict`` checks it in one place (``_checked``) before changing
anything: a malformed state is ``CorruptState``, another configuration ``StateMismatch``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypedDict, cast

import torch.distributed as dist

from ..errors import CorruptState, StateMismatch


class TrainerConfig(TypedDict):
    """The Trainer settings that shape the computation: saved, and must match on resume."""

    seed: int
    accumulate: int
    clip_grad_norm: float | None
    scheduler_interval: str


class ProgressState(TypedDict):
    """What ``Progress.state_dict`` returns (the saved format; the keys are the attributes)."""

    epoch: int
    batches: int
    steps: int
    micro: int
    epoch_batches: int
    val_batches: int
    ticks: int
    count: int
    phase: str
    loss_sum: float
    config: TrainerConfig


# The int fields of ProgressState, in its order; `phase`, `loss_sum` and `config` are the rest.
COUNTERS = ("epoch", "batches", "steps", "micro", "epoch_batches", "val_batches", "ticks", "count")
PHASES = ("train", "val", "end")  # an epoch's phases, in order


class Progress:
    def __init__(self, config: TrainerConfig) -> None:
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

    def where(self) -> str:
        """Where the loop is, in words: "epoch 0, train batch 5, optimizer step 2"."""
        if self.phase == "end":
            return f"the end of epoch {self.epoch}, optimizer step {self.steps}"
        batch = self.val_batches if self.phase == "val" else self.epoch_batches
        return f"epoch {self.epoch}, {self.phase} batch {batch}, optimizer step {self.steps}"

    def next_epoch(self) -> None:
        self.epoch += 1
        self.phase = "train"
        self.epoch_batches = self.val_batches = 0

    def state_dict(self) -> ProgressState:
        return ProgressState(
            epoch=self.epoch,
            batches=self.batches,
            steps=self.steps,
            micro=self.micro,
            epoch_batches=self.epoch_batches,
            val_batches=self.val_batches,
            ticks=self.ticks,
            count=self.count,
            phase=self.phase,
            loss_sum=self.loss_sum,
            config=cast(TrainerConfig, dict(self.config)),
        )

    def load_state_dict(self, state: Any) -> None:
        checked = _checked(state, self.config)  # raises before anything changes
        for name in COUNTERS:
            setattr(self, name, state[name])
        self.phase, self.loss_sum = checked["phase"], float(checked["loss_sum"])
        self.saved_at = self.ticks


def _checked(state: Any, config: TrainerConfig) -> ProgressState:
    """``state`` if a Trainer with ``config`` could have saved it; else why not."""
    if not isinstance(state, dict):
        raise CorruptState(f"Progress state: expected a dict, got {type(state).__name__}")
    missing = [key for key in ProgressState.__required_keys__ if key not in state]
    if missing:
        raise CorruptState(
            f"Progress state: missing {sorted(missing)} (it holds {sorted(state)})",
            field=sorted(missing)[0],
        )
    for name in COUNTERS:
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CorruptState(
                f"Progress state: {name} must be an int >= 0, got {value!r}", field=name
            )
    if state["phase"] not in PHASES:
        raise CorruptState(
            f"Progress state: phase must be one of {PHASES}, got {state['phase']!r}", field="phase"
        )
    loss_sum = state["loss_sum"]
    if isinstance(loss_sum, bool) or not isinstance(loss_sum, (int, float)):
        raise CorruptState(
            f"Progress state: loss_sum must be a float, got {loss_sum!r}", field="loss_sum"
        )
    saved = state["config"]
    if not isinstance(saved, dict):
        raise CorruptState(f"Progress state: config must be a dict, got {saved!r}", field="config")
    for field, current in config.items():
        if saved.get(field) != current:  # a setting the saving run did not record reads None
            raise _mismatch(field, saved.get(field), current)
    return cast(ProgressState, state)


def _mismatch(field: str, saved: Any, current: Any) -> StateMismatch:
    return StateMismatch(
        "unbroken.Trainer",
        field,
        saved,
        current,
        holder="Trainer",
        message=f"unbroken.Trainer: the checkpoint was saved by a run with {field}={saved!r}, "
        f"but this Trainer has {field}={current!r}. The checkpoint directory belongs "
        f"to a run with other settings: pass {field}={saved!r} again, or train in a "
        "new directory.",
    )


def say(message: str) -> None:
    """Print a line about the run's course (resumed, preempted) for the job's log; in a
    data-parallel job, rank 0's only (every rank would print the same)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    # stderr, flushed, not a logger: it must reach a batch job's log file as it happens.
    print(f"unbroken: {message}", file=sys.stderr, flush=True)


class _Bar:
    """Iterates the loader itself and only tells tqdm how far it got: tqdm never sees the
    loader, so it cannot create iterators of its own (tqdm.auto calls ``iter()`` eagerly)."""

    def __init__(self, bar: Any, loader: Any, progress: Progress) -> None:
        self._bar, self._loader, self._progress = bar, loader, progress
        self._started, self._seen = time.perf_counter(), 0

    def __iter__(self) -> Iterator[Any]:
        for item in self._loader:
            self._seen += 1
            yield item

    def show(self, loss: float) -> None:
        self._bar.update(1)
        if self._bar.disable:
            return
        rate = self._seen / max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix(
            step=self._progress.steps,
            loss=f"{loss:.4f}",
            batches_per_s=f"{rate:.1f}",
            refresh=False,
        )


@contextmanager
def bar(enabled: bool, loader: Any, progress: Progress, phase: str) -> Iterator[_Bar]:
    """A tqdm bar over ``loader`` showing epoch, step, loss and throughput."""
    from tqdm import tqdm  # imported here: the library itself needs no tqdm to import

    done = progress.epoch_batches if phase == "train" else progress.val_batches
    try:
        total = len(loader)
    except TypeError:
        total = None
    display = tqdm(
        total=total,
        initial=done,
        disable=not enabled or None,
        leave=False,
        desc=f"epoch {progress.epoch} {phase}",
        dynamic_ncols=True,
    )
    try:
        yield _Bar(display, loader, progress)
    finally:
        display.close()
