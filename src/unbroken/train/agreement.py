"""``Agreement``: what the ranks of a data-parallel job must agree on before any of them acts.

Under ``torchrun`` (an initialized ``torch.distributed`` default group of more than one rank)
every rank runs the same loop over its share of the data. Where a rank stands is a ``World``
(``distributed.world``); what one rank alone knows must be agreed before anyone acts on it, or
the ranks would save different steps, or one would exit while the others wait for it in the
next gradient all-reduce:

- a preemption signal, which schedulers deliver to ranks at different moments, and a
  wall-clock checkpoint, due by each rank's own clock: ``any_of`` all-reduces both flags (MAX)
  in one call, every ``preemption_check_every`` batches;
- the epoch's mean loss, each rank's over its own batches: ``mean`` averages it.

In a world of one rank both return what they are given, with no collective and no change to
the bits. Collectives run on the default group, on the device its backend needs (CUDA for
NCCL). Cost: one all-reduce of two ints per agreement (docs/benchmarks/unit-costs.md, row
``agreement_any_of``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..distributed.world import World
from ..preemption import EXIT_CODE, Preemption, exit_to_be_requeued
from .progress import say


class Agreement:
    """The collectives of ``world``'s ranks (by default the default process group's), on the
    device its backend needs (see the module)."""

    def __init__(self, world: World | None = None) -> None:
        self.world = World.current() if world is None else world
        self.device = torch.device("cpu")
        if self.world.distributed and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def any_of(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, true if it is true on any rank."""
        if not self.world.distributed:
            return flags
        values = torch.tensor([int(flag) for flag in flags], device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return tuple(bool(value) for value in values.tolist())

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks."""
        if not self.world.distributed:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total.item()) / self.world.size


def exit_if_preempted(agreement: Agreement, preemption: Preemption) -> None:
    """Exit with ``EXIT_CODE`` if any rank got a preemption signal before training started:
    nothing new was trained, so nothing is saved."""
    (preempted,) = agreement.any_of(preemption.received is not None)
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
        self,
        agreement: Agreement,
        preemption: Preemption,
        schedule: Any,
        jit: Any,
        check_every: int,
    ) -> None:
        self.agreement, self.preemption, self.schedule = agreement, preemption, schedule
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
        if self.agreement.world.distributed:  # act only on what every rank knows, at one batch
            if ticks % self.check_every:
                return False, False
            preempted, time_due = self.agreement.any_of(preempted, time_due)
        return preempted, time_due
