"""The Trainer's saves: a checkpoint of the loop's entries, and the exit after a preemption.

``save`` is every checkpoint the loop takes (periodic, at a preemption, at the end): it waits
for the background save before it, skips a place already saved (``progress.saved_at``: a
committed checkpoint's; a background save counts once that wait returned), times what it holds
training for (``schedule``) and tolerates an unreachable store for a periodic save of one
process.
``exit_preempted`` ends the process after the preemption checkpoint: it says when the
signal came, ignores the signals from then on and exits with ``EXIT_CODE``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NoReturn

from ..errors import RemoteUnavailable
from ..preemption import EXIT_CODE, exit_to_be_requeued
from .hooks import call_hooks
from .progress import say

if TYPE_CHECKING:
    from .trainer import Trainer


def exit_preempted(trainer: Trainer) -> NoReturn:
    """After the preemption checkpoint: say so, and exit with ``EXIT_CODE`` to be requeued."""
    progress, received = trainer.progress, trainer.preemption.received
    seconds = trainer.preemption.seconds_since_signal()
    heard = (
        f"{received.name} received; checkpoint at {progress.where()} committed "
        f"{seconds:.3f} s after the signal"
        if received is not None
        else f"a preemption signal reached another rank; checkpoint at {progress.where()} committed"
    )
    trainer.preemption.ignore_until_exit()  # saved: nothing may kill it with -15 now
    trainer.schedule.history.end("preempted")
    say(f"{heard}; exiting with {EXIT_CODE} to be requeued")
    call_hooks(trainer.options.callbacks, "on_preempted", trainer, seconds)
    exit_to_be_requeued()


def save(trainer: Trainer, blocking: bool = True, periodic: bool = False) -> None:
    """Checkpoint the loop where it is, unless it is saved there already."""
    # A periodic save that cannot reach object storage (RemoteUnavailable: after its
    # retries, or a store that did not answer within remote_timeout) does not stop
    # training: it is reported and the next one tries again; so does a background save
    # (always periodic) before any save. One process only: under torch.distributed the
    # ranks raise together (the job restarts).
    tolerate = periodic and not trainer.world.distributed
    started = time.perf_counter()  # what the save holds training for: the wait included
    checkpointer, progress = trainer.checkpointer, trainer.progress
    background = checkpointer.background_step
    try:
        checkpointer.wait()  # the background save before it: it may have failed
    except RemoteUnavailable as error:
        if trainer.world.distributed:
            raise
        say(f"the background checkpoint failed ({error}); training goes on")
    else:
        if background is not None:
            progress.saved_at = background  # committed: every rank knows it now
    if progress.ticks == progress.saved_at:
        return  # nothing happened since the last committed checkpoint
    trainer.schedule.saved()
    call_hooks(trainer.options.callbacks, "on_save_start", trainer)
    try:
        trainer.run_log.flush_board()
        checkpointer.save(progress.ticks, trainer.entries, blocking=blocking)
    except RemoteUnavailable as error:
        if not tolerate:
            raise
        say(f"checkpoint at {progress.where()} failed ({error}); training goes on")
        return
    if blocking:  # a background save counts once committed: at the next wait (above)
        progress.saved_at = progress.ticks
    trainer.schedule.measured(time.perf_counter() - started)
