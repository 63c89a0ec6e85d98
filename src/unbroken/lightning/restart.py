"""What ``ExactResume`` changes in Lightning's loops after a resume, so that the run goes on
as the uninterrupted one would, and so do the checkpoints it saves.

- ``let_plateau_schedulers_step``: Lightning leaves out the epoch-interval
  ``ReduceLROnPlateau`` steps at the end of the first epoch after a resume (it assumes the
  monitored metric was lost; ``ExactResume`` saves ``callback_metrics``): clear its restarting
  flag there, with the loops' base setter (Lightning's own keeps it set under ``max_steps``).
- ``start_epoch_left_unstarted``: resumed at an epoch's last batch, Lightning goes on into the
  next epoch without counting it as started; count it, so that the resumed run's checkpoints do
  not resume at that epoch's start.

Both act once per resume (a few attribute reads); both raise ``LightningInternalsChanged`` on a
Lightning release whose loops are laid out otherwise than 2.x's.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

from .loops import (
    LightningInternalsChanged,
    epoch_counts,
    epoch_plateau_monitors,
    lightning_version,
)


def let_plateau_schedulers_step(trainer: Trainer) -> list[str]:
    """Called at the end of the first epoch after a resume (``on_train_epoch_end``), where
    Lightning leaves out its epoch-interval ``ReduceLROnPlateau`` steps (``not self.restarting``
    in ``FitLoop.on_advance_end``: it assumes the monitored metric was lost with the process;
    ``ExactResume`` saves ``callback_metrics``). If every such scheduler's metric is available,
    clear the flag that makes Lightning skip them (it clears it itself right after) and return
    []; else leave it, and return the missing metrics' names."""
    monitors = epoch_plateau_monitors(trainer)
    if not monitors:
        return []
    missing = [name for name in monitors if name not in trainer.callback_metrics]
    if not missing:
        _stop_restarting(trainer.fit_loop)
    return missing


def _stop_restarting(fit_loop: Any) -> None:
    """``fit_loop.restarting = False``, as Lightning 2.x's setter does it under ``max_epochs``:
    the fit loop and its child loops (epoch, validation) all stop restarting. Under
    ``max_steps`` that setter (``_FitLoop.restarting``) keeps the flag True and pushes True to
    the child loops, so the next epoch reuses the ended epoch's batch counts: it ends at once,
    and with validation forever. The one framework name used in its place: the setter of the
    loops' base class, ``lightning.pytorch.loops.loop._Loop.restarting``, which sets the flag
    and the child loops' as given. Used on Lightning 2.x only and checked by its effect: another
    release raises ``LightningInternalsChanged`` instead of resuming otherwise."""
    try:
        if not lightning_version().startswith("2."):
            raise ImportError(f"Lightning {lightning_version()}: _Loop is known in 2.x only")
        from lightning.pytorch.loops.loop import _Loop

        setter = vars(_Loop)["restarting"].fset  # the property's, not _FitLoop's override
        epoch_loop = fit_loop.epoch_loop
    except (ImportError, KeyError, AttributeError) as error:
        raise LightningInternalsChanged(
            f"unbroken.lightning: Lightning {lightning_version()} has no _Loop.restarting "
            "setter or fit_loop.epoch_loop (2.x has both); this release of unbroken cannot make "
            "ReduceLROnPlateau step after a resume. Use Lightning 2.4-2.6, or report it."
        ) from error
    setter(fit_loop, False)
    if fit_loop.restarting or epoch_loop.restarting:
        raise LightningInternalsChanged(
            f"unbroken.lightning: Lightning {lightning_version()}'s loops stay restarting when "
            "told not to; this release of unbroken cannot make ReduceLROnPlateau step after a "
            "resume. Use Lightning 2.4-2.6, or report it."
        )


def start_epoch_left_unstarted(trainer: Trainer) -> bool:
    """Called at the first training batch after a resume. Resumed at an epoch's last training
    batch, Lightning 2.x goes on into the next epoch without counting it as started: while it
    runs, its ``fit_loop.epoch_progress`` has ready == started == processed, as between two
    epochs. A checkpoint saved in that epoch would then resume as at the epoch's start: its
    ``on_train_epoch_start`` hooks again mid-epoch, ``batch_idx`` from 0, validation on other
    batches. Count the epoch as Lightning counts one it starts (ready and started + 1, which
    Lightning reads only when it resumes) and return True; else return False."""
    if not all(c.ready == c.started == c.processed == c.completed for c in epoch_counts(trainer)):
        return False
    trainer.fit_loop.epoch_progress.increment_ready()
    trainer.fit_loop.epoch_progress.increment_started()
    return True
