"""The Trainer's loop counters (checkpointed), its running loss, its progress bar (tqdm), and
where a start's time went before the first step.

``Progress`` is everything the loop needs to know where it is: epoch, phase, batch and step
counts, the position inside a gradient-accumulation window, and the running loss sum of the
current phase (``LossSum``: saved as a float, so the epoch mean after a resume is the same
bits). It also holds the computation-shaping configuration, checked on resume.

Its saved state is ``ProgressState``: plain ints, a phase name, a float and the configuration,
one small dict; ``load_state_dict`` checks it in one place (``_checked``) before changing
anything: a malformed state is ``CorruptState``, another configuration ``StateMismatch``.

Cost per batch: a few int increments and one add to the running loss (on the host for a CPU
loss, docs/benchmarks/unit-costs.md row ``progress_batch``; on the loss's device otherwise, without a host sync). The sum
reaches the host at the end of a phase and in ``state_dict`` (a checkpoint) only.

``Startup``: where a process's time went from its start to its first training step, phase by
phase. The Trainer logs it once the first batch is done (``unbroken: resumed, first step after
3.1 s: ...``): what a restart costs is the sum of these phases, and the ones a resume adds to a fresh
start (finding, reading and restoring the checkpoint) are named apart from the interpreter's,
the imports' and the user's own setup, so that a slow restart says where it is slow. A restart's
line is at INFO; a fresh start's at DEBUG (its one INFO line says it starts fresh).

The process's start is read from Linux's ``/proc`` (its age against the system's uptime, to
10 ms); elsewhere the first phase is left out.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict, cast

import torch

from .._checks import is_int, is_number
from .._log import logger
from ..distributed.world import World
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


class LossSum:
    """A phase's running loss: the float64 sum, in order, of each batch's loss.

    A loss on the CPU is added on the host (``loss.item()``, the cheapest there: a CPU tensor
    has no sync to avoid; ``float(loss)`` would warn on a loss that requires grad, a cost of
    its own every batch). A loss elsewhere is added into a float64 tensor on its device
    (``add_``: queued, no host sync; float32 on a device without float64, such as "mps"), read
    with ``float()`` only by ``value()``: at a phase's end and in a checkpoint. Both ways give
    the same bits: float64 holds every float32, bfloat16 and float16 value exactly, so each
    step is the same float64 addition of the same two numbers. A resume ``load``s the saved
    float into whichever way the next loss takes. ``on_device``: ``None`` chooses by the
    loss's device; ``True`` or ``False`` forces one way (tests: the device way on the CPU).
    """

    def __init__(self, on_device: bool | None = None) -> None:
        self.on_device = on_device
        self._host = 0.0  # the sum while no loss has gone to a device
        self._device: torch.Tensor | None = None  # the sum, once a loss went to a device

    def add(self, loss: torch.Tensor) -> None:
        device = self._device
        if device is not None:
            # detach: an add of a loss that requires grad would make the sum part of the graph
            device.add_(loss.detach().reshape(()))
        elif self.on_device is False or (self.on_device is None and loss.is_cpu):
            self._host += loss.item()
        else:
            self._device = self._start(loss.device).add_(loss.detach().reshape(()))

    def _start(self, device: torch.device) -> torch.Tensor:
        dtype = torch.float32 if device.type == "mps" else torch.float64  # mps has no float64
        return torch.tensor(self._host, dtype=dtype, device=device)

    def value(self) -> float:
        """The sum as a float: a host sync when it lives on an accelerator."""
        return float(self._device) if self._device is not None else self._host

    def load(self, value: float) -> None:
        """Start from ``value`` (0.0 for a new phase; a checkpoint's sum on resume)."""
        self._host, self._device = float(value), None


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
        self.loss, self.count = LossSum(), 0  # the current phase's running loss, its batches
        self.saved_at = -1  # ticks at the last checkpoint (not saved: a load sets it)

    def start_phase(self) -> None:
        self.loss.load(0.0)
        self.count = 0

    def batch_done(self, loss: torch.Tensor) -> None:
        self.batches += 1
        self.epoch_batches += 1
        self.micro += 1
        self.ticks += 1
        self.loss.add(loss)
        self.count += 1

    def val_batch_done(self, loss: torch.Tensor) -> None:
        self.val_batches += 1
        self.ticks += 1
        self.loss.add(loss)
        self.count += 1

    def optimizer_step_done(self) -> None:
        self.steps += 1
        self.micro = 0

    def phase_mean(self) -> float:
        return self.loss.value() / self.count if self.count else math.nan

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
        return self.state_with(self.loss.value())

    def state_with(self, loss_sum: float) -> ProgressState:
        """The state, with ``loss_sum`` as the phase's running loss (another rank's, known from
        the ranks' agreements: what a survivor saves for a rank that died)."""
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
            loss_sum=loss_sum,
            config=cast(TrainerConfig, dict(self.config)),
        )

    def load_state_dict(self, state: Any) -> None:
        checked = _checked(state, self.config)  # raises before anything changes
        for name in COUNTERS:
            setattr(self, name, state[name])
        self.phase = checked["phase"]
        self.loss.load(checked["loss_sum"])
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
        if not is_int(value) or value < 0:
            raise CorruptState(
                f"Progress state: {name} must be an int >= 0, got {value!r}", field=name
            )
    if state["phase"] not in PHASES:
        raise CorruptState(
            f"Progress state: phase must be one of {PHASES}, got {state['phase']!r}", field="phase"
        )
    loss_sum = state["loss_sum"]
    if not is_number(loss_sum):
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


def say(message: str, every_rank: bool = False, level: int = logging.INFO) -> None:
    """Print a line about the run's course (resumed, preempted) for the job's log; in a
    data-parallel job, rank 0's only (every rank would print the same), unless ``every_rank``
    (what one rank alone knows, such as a save for a rank that died). ``level``: DEBUG for
    the details a user asks for (the reasons of an interval, a fresh start's phases)."""
    if every_rank or World.current().first:
        # At INFO, shown by default as "unbroken: <message>" on stderr, flushed (``_log``).
        logger.log(level, message)


class _Bar:
    """Iterates the loader itself and only tells tqdm how far it got: tqdm never sees the
    loader, so it cannot create iterators of its own (tqdm.auto calls ``iter()`` eagerly).

    A batch counts as done when the loop asks for the next one (``update(1)``, nearly free on a
    disabled bar: row ``progress_bar_off`` of the unit costs); ``show`` writes the postfix, only on the batches whose values are logged:
    it needs the loss on the host."""

    def __init__(self, bar: Any, loader: Any, progress: Progress) -> None:
        self._bar, self._loader, self._progress = bar, loader, progress
        self._started, self._seen = time.perf_counter(), 0

    def __iter__(self) -> Iterator[Any]:
        if self._bar.disable:  # no bar (turned off, or not a terminal): no frame of ours per batch
            return iter(self._loader)
        return self._counted()

    def _counted(self) -> Iterator[Any]:
        update = self._bar.update
        for item in self._loader:
            self._seen += 1
            yield item
            update(1)

    def show(self, loss: float) -> None:
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


def process_age() -> float | None:
    """Seconds since this process started, or ``None`` where ``/proc`` does not say."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        # The 22nd field, counted after the command name (which may hold spaces) ends.
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Startup:
    """The phases of one process's way to its first step, marked as they end (``mark``)."""

    def __init__(self) -> None:
        now = time.perf_counter()
        age = process_age()
        self.phases: list[tuple[str, float]] = []
        if age is not None:
            self.phases.append(("interpreter, imports and your code before Trainer()", age))
        self._last = now
        self._batched = self.reported = False

    def mark(self, phase: str) -> None:
        """``phase`` ended now (it started when the one before ended)."""
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def resumed(self, seconds: dict[str, float]) -> None:
        """The resume ended now: ``seconds`` of it by the checkpoint's load phases (``scan``,
        ``read``, ``restore``; none when no checkpoint was found), and the rest."""
        now = time.perf_counter()
        rest = now - self._last - sum(seconds.values())
        self.phases.extend((f"checkpoint {name}", value) for name, value in seconds.items())
        self.phases.append(("the rest of the resume", max(0.0, rest)))
        self._last = now

    def total(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def first_batch(self) -> None:
        """Called at every batch: the first one's arrival ends a phase."""
        if not self._batched:
            self._batched = True
            self.mark("first batch")

    def first_step(self, resumed: bool) -> None:
        """Called after every batch: after the first one's step, log the phases, once (at
        INFO after a resume, what the restart cost; at DEBUG after a fresh start)."""
        if self.reported:
            return
        self.reported = True
        self.mark("first batch's step")
        phases = "; ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases)
        how = "resumed" if resumed else "started fresh"
        level = logging.INFO if resumed else logging.DEBUG
        say(f"{how}, first step after {self.total():.2f} s: {phases}", level=level)
