"""Where a Lightning run stops, for ``ExactResume``'s preemption save: a run that ends anyway is
not saved for a requeue, and a save comes after the stop decisions of its place.

- ``ends_here``: whether Lightning trains no further step (``trainer.should_stop`` set by
  ``EarlyStopping``, a ``Timer`` or the user where it may stop; ``max_steps`` or ``max_epochs``
  reached). A preempted run there finishes as the uninterrupted one, and exits 0.
- ``run_after_stop_deciders``: Lightning calls the callbacks' hooks in their list's order, so
  ``ExactResume`` moves itself behind every ``EarlyStopping`` and ``Timer`` at ``setup``: a
  decision they make at a place is known before its preemption save there. A user's callback
  that sets ``trainer.should_stop`` goes before it; a ``LightningModule``'s hooks run after
  every callback's, so a stop is set in its steps, not its ``on_*_end`` hooks.
- ``decided_after_epoch_end``: at an epoch's end Lightning calls ``EarlyStopping`` after every
  other callback, whatever the order: the preemption save waits for the next place.

Each is a few attribute reads, at a place where a preemption was seen (or once, at ``setup``).
They read ``fit_loop._can_stop_early`` and ``EarlyStopping._check_on_train_epoch_end``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, Timer

from .loops import LightningInternalsChanged, lightning_version


def ends_here(trainer: Trainer, epoch_end: bool = False) -> bool:
    """Whether Lightning trains no further step after this place (``epoch_end``: its
    ``on_train_epoch_end``): a stop was decided (``trainer.should_stop``, by ``EarlyStopping``,
    a ``Timer`` or the user) where Lightning may stop (``min_epochs`` and ``min_steps`` met),
    ``max_steps`` is reached, or this is the last epoch's last batch or end (``max_epochs``).
    A preemption save here would be for nothing: the run ends as the uninterrupted one does."""
    try:
        can_stop = bool(trainer.fit_loop._can_stop_early)
        last_batch = epoch_end or bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
    except AttributeError as error:
        raise LightningInternalsChanged(
            f"unbroken.lightning: Lightning {lightning_version()} has no {error.name!r} where "
            "2.x has it (whether the fit may stop early); this release of unbroken cannot tell "
            "whether a run ends. Use Lightning 2.4-2.6, or report it."
        ) from error
    if (trainer.should_stop and can_stop) or 0 <= trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return last_batch and max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch + 1


def decided_after_epoch_end(trainer: Trainer) -> bool:
    """Whether an ``EarlyStopping`` decides at the training epoch's end: Lightning runs it after
    the other callbacks' ``on_train_epoch_end`` (``ExactResume``'s), so a preemption save there
    would come before its decision. Its choice is resolved in its ``setup`` (validating once an
    epoch at its end); unknown, it is taken as deciding there."""
    return any(
        getattr(callback, "_check_on_train_epoch_end", True) is not False
        for callback in trainer.early_stopping_callbacks
    )


def run_after_stop_deciders(trainer: Trainer, callback: Callback) -> None:
    """Move ``callback`` behind every ``EarlyStopping`` and ``Timer`` in ``trainer.callbacks``
    (a new list; the other callbacks keep their order): Lightning calls the callbacks' hooks in
    that order, and a preemption save must come after their stop decision at the same place."""
    owner: Any = trainer  # Trainer.callbacks is public, set by Lightning outside its __init__
    callbacks = list(owner.callbacks)
    if not any(c is callback for c in callbacks):
        return
    mine = next(i for i, c in enumerate(callbacks) if c is callback)
    deciders = [i for i, c in enumerate(callbacks) if isinstance(c, (EarlyStopping, Timer))]
    if not deciders or deciders[-1] < mine:
        return
    callbacks.insert(deciders[-1] + 1, callback)
    del callbacks[mine]
    owner.callbacks = callbacks
