"""``Agreement``: what the ranks of a data-parallel job must agree on before any of them acts.

Under ``torchrun`` (an initialized ``torch.distributed`` default group of more than one rank)
every rank runs the same loop over its share of the data. Where a rank stands is a ``World``
(``distributed.world``); what one rank alone knows must be agreed before anyone acts on it, or
the ranks would save different steps, or one would exit while the others wait for it in the
next gradient all-reduce:

- a preemption signal, which schedulers deliver to ranks at different moments, and a
  wall-clock checkpoint, due by each rank's own clock. With a DDP model both ride, with each
  rank's loss and rank 0's log size, on every backward's gradient reduction (``Carrier``): no
  collective of the loop's own and no host read of a device value per step. Without one,
  ``any_of`` all-reduces both flags (MAX) every ``preemption_check_every`` batches (or, with
  just-in-time saves, ``jit.JustInTime.agree`` gathers them every batch);
- the epoch's mean loss, each rank's over its own batches: ``mean`` averages it.

In a world of one rank both return what they are given, with no collective and no change to
the bits. Collectives run on the default group, on the device its backend needs (CUDA for
NCCL). Cost of ``any_of``: one all-reduce of two ints (docs/benchmarks/unit-costs.md, row
``agreement_any_of``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
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


@dataclass
class Received:
    """What the ranks agreed on with a batch's backward, as the host reads it."""

    preempted: bool  # some rank had a preemption signal
    time_due: bool  # some rank's clock says a wall-clock save is due
    log_bytes: int  # rank 0's CSV log size when the batch was sent ...
    rows: int  # ... the rows logged by then (every rank counts them) ...
    ticks: int  # ... and the loop's ticks then


HEAD = 16  # the row's bytes before the ranks' losses: the two flags, padding, rank 0's log size
_HEAD = struct.Struct("<BB6xq")  # those 16 bytes: two flags, 6 of padding, a little-endian int64


class Carrier:
    """The per-batch agreement riding on the gradient reduction (``ExactReduction.carry``).

    ``send``, before a backward: a row of bytes, summed over the ranks with the gradients: the
    preemption flag (byte 0) and the wall-clock flag (byte 1) of each rank, rank 0's log size
    (bytes 8-15, an int64) and each rank's loss as a float64 in 8 bytes of its own (from byte
    16). Each byte but a flag's is non-zero on one rank at most, so the sums are the values,
    bit for bit. ``receive``, after it: each rank's loss as a tensor on the device (never read
    here), and the flags as the host reads them. On the CPU they are read at once; on an
    accelerator a batch later, from a copy that travelled while the next batch ran, so the host
    never waits for the device (a preemption is then acted on a batch later).
    """

    def __init__(self, reduction: Any, world: World, device: torch.device) -> None:
        self.reduction, self.world, self.device = reduction, world, device
        self._tags: tuple[int, int] = (0, 0)
        self._travelling: tuple[torch.Tensor, Any, tuple[int, int]] | None = None
        self.lag = device.type != "cpu"  # whether the host reads the flags a batch later
        # On the CPU one row serves every batch: the reduction copies it as it sends it, and
        # each rank only ever writes the head and its own loss's bytes (the rest stays zero).
        self._cpu: tuple[torch.Tensor, Any, torch.Tensor] | None = None

    @staticmethod
    def width(world_size: int) -> int:
        """The row's bytes in a world of ``world_size`` ranks."""
        return HEAD + 8 * world_size

    def send(
        self,
        preempted: bool,
        time_due: bool,
        log_bytes: int,
        rows: int,
        ticks: int,
        loss: torch.Tensor,
    ) -> None:
        start = HEAD + 8 * self.world.rank
        self._tags = (rows, ticks)
        if self.device.type == "cpu":
            if self._cpu is None:
                row = torch.zeros(self.width(self.world.size), dtype=torch.uint8)
                self._cpu = (
                    row,
                    row.numpy().data,  # the array's buffer, written in place
                    row[start : start + 8].view(torch.float64),
                )
            row, host, slot = self._cpu
            _HEAD.pack_into(host, 0, preempted, time_due, log_bytes)  # no tensor op per byte
            slot.copy_(loss.detach().reshape(1))  # in float64, on the tensor's side: no read
            self.reduction.carry(row)
            return
        # On a device a row of its own each batch (the last one may still be on its way):
        # filled there, byte by byte, since a copy from pageable host memory would sync.
        row = torch.zeros(self.width(self.world.size), dtype=torch.uint8, device=self.device)
        for index, byte in enumerate(_HEAD.pack(preempted, time_due, log_bytes)):
            if byte:
                row[index] = byte
        row[start : start + 8] = loss.detach().reshape(1).to(torch.float64).view(torch.uint8)
        self.reduction.carry(row)

    def receive(self) -> tuple[torch.Tensor, Received | None] | None:
        """After the backward: each rank's loss (on the device) and the agreed flags (None on
        an accelerator's first batch); None if no backward reduced the row (fall back)."""
        sums = self.reduction.carried()
        if sums is None:
            return None
        losses = sums[HEAD:].view(torch.float64)
        if not self.lag:  # the CPU: read at once
            return losses, self._read(sums.numpy(), self._tags)
        ready, self._travelling = self._travelling, None
        host = sums[:HEAD].to("cpu", non_blocking=True)
        event = torch.cuda.Event() if sums.is_cuda else None
        if event is not None:
            event.record()
        self._travelling = (host, event, self._tags)
        if ready is None:
            return losses, None
        previous, done, tags = ready
        if done is not None:
            done.synchronize()  # recorded a batch ago: long done, no wait in practice
        return losses, self._read(previous.numpy(), tags)

    @staticmethod
    def _read(head: Any, tags: tuple[int, int]) -> Received:
        preempted, time_due, log_bytes = _HEAD.unpack_from(head)
        return Received(preempted > 0, time_due > 0, log_bytes, *tags)


class Boundary:
    """What the loop acts on after a batch (``decide``): whether a preemption signal came, and
    whether a wall-clock save is due (``schedule``). Under torch.distributed, what any rank
    knows must be agreed. With a DDP model (``carrier``) it rides on every backward's
    gradient reduction: no collective of its own, no host read of a device value. Otherwise,
    with just-in-time saves (``jit``), a gather right after every batch, before the optimizer
    step, whose changes to the model then run no collective that could fail; without them, an
    all-reduce every ``check_every`` batches."""

    def __init__(
        self,
        agreement: Agreement,
        preemption: Preemption,
        schedule: Any,
        jit: Any,
        check_every: int,
        carrier: Carrier | None = None,
    ) -> None:
        self.agreement, self.preemption, self.schedule = agreement, preemption, schedule
        self.jit, self.check_every, self.carrier = jit, check_every, carrier
        self.agreed: tuple[bool, bool] | None = None

    def send(self, loss: torch.Tensor, ticks: int) -> None:
        """Before a training batch's backward: hand what this rank knows to the reduction."""
        if self.carrier is not None:
            jit = self.jit
            self.carrier.send(
                self.preemption.received is not None,
                self.schedule.by_time(),
                jit.log_bytes(),
                jit.run_log.rows,
                ticks,
                loss,
            )

    def agree(self, loss: torch.Tensor) -> None:
        """After a batch's backward (or a validation batch): what the ranks agreed on."""
        received = self.carrier.receive() if self.carrier is not None else None
        if received is not None:
            losses, flags = received
            self.jit.agreed_on(losses, flags)
            self.agreed = (flags.preempted, flags.time_due) if flags is not None else (False, False)
        elif self.jit.enabled:
            preempted = self.preemption.received is not None
            self.agreed = self.jit.agree(preempted, self.schedule.by_time(), loss)
        else:
            self.agreed = None

    def decide(self, ticks: int) -> tuple[bool, bool]:
        if not self.agreement.world.distributed:
            return self.preemption.received is not None, self.schedule.by_time()
        if ticks % self.check_every:  # act only on what every rank knows, at one batch
            return False, False
        if self.agreed is not None:  # what the backward's reduction carried
            return self.agreed
        preempted, time_due = self.preemption.received is not None, self.schedule.by_time()
        preempted, time_due = self.agreement.any_of(preempted, time_due)
        return preempted, time_due
