"""The Trainer's view of a data-parallel job: its rank, and the two collectives the loop needs.

Under ``torchrun`` (an initialized ``torch.distributed`` default group of more than one rank)
every rank runs the same loop over its share of the data. What one rank alone knows must be
agreed before anyone acts on it, or the ranks would save different steps, or one would exit
while the others wait for it in the next gradient all-reduce:

- a preemption signal, which schedulers deliver to ranks at different moments, and a
  wall-clock checkpoint, due by each rank's own clock: ``any_of`` all-reduces both flags (MAX)
  in one call, every ``preemption_check_every`` batches;
- the epoch's mean loss, each rank's over its own batches: ``mean`` averages it.

One process is a ``Job`` of one rank: both return what they are given, with no collective
and no change to the bits. Collectives run on the default group, on the device its backend
needs (CUDA for NCCL). Cost: one all-reduce of two ints, ~50-100 us on gloo over loopback
(benchmarks/RESULTS.md), per agreement.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..distributed.world import World
from ..preemption import EXIT_CODE, Preemption, exit_to_be_requeued
from .progress import say


class Job:
    def __init__(self) -> None:
        world = World.current()
        self.rank, self.world_size = (world.rank, world.size) if world.distributed else (0, 1)
        self.device = torch.device("cpu")
        if self.distributed and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def first(self) -> bool:
        return self.rank == 0

    def any_of(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, true if it is true on any rank."""
        if not self.distributed:
            return flags
        values = torch.tensor([int(flag) for flag in flags], device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return tuple(bool(value) for value in values.tolist())

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks."""
        if not self.distributed:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total.item()) / self.world_size


def exit_if_preempted(job: Job, preemption: Preemption) -> None:
    """Exit with ``EXIT_CODE`` if any rank got a preemption signal before training started:
    nothing new was trained, so nothing is saved."""
    (preempted,) = job.any_of(preemption.received is not None)
    if preempted:
        received = preemption.received
        name = received.name if received is not None else "a preemption signal (on another rank)"
        preemption.ignore_until_exit()
        say(
            f"{name} received before training started: nothing new to save; "
            f"exiting with {EXIT_CODE} to be requeued"
        )
        exit_to_be_requeued()


class Boundary:
    """What the loop acts on after a batch (``decide``): whether a preemption signal came, and
    whether a wall-clock save is due (``schedule``). Under torch.distributed, what any rank
    knows, agreed every ``check_every`` batches; with just-in-time saves (``jit``), agreed
    right after every backward instead (``agree``), before the optimizer step, whose changes to
    the model then run no collective that could fail, in a gather that carries each rank's
    loss."""

    def __init__(
        self, job: Job, preemption: Preemption, schedule: Any, jit: Any, check_every: int
    ) -> None:
        self.job, self.preemption, self.schedule = job, preemption, schedule
        self.jit, self.check_every = jit, check_every
        self.agreed = (False, False)

    def agree(self, loss: torch.Tensor) -> None:
        if self.jit.enabled:
            preempted = self.preemption.received is not None
            self.agreed = self.jit.agree(preempted, self.schedule.by_time(), loss)

    def decide(self, ticks: int) -> tuple[bool, bool]:
        if self.jit.enabled:
            return self.agreed
        preempted, time_due = self.preemption.received is not None, self.schedule.by_time()
        if self.job.distributed:  # act only on what every rank knows, at the same batch
            if ticks % self.check_every:
                return False, False
            preempted, time_due = self.job.any_of(preempted, time_due)
        return preempted, time_due
