"""What ``ExactResume`` reads of Lightning's training loop (where a checkpoint resumes exactly),
and what it changes in it after a resume.

Lightning 2.x decides where a resumed run goes on from its loops' progress counters. From most
places a checkpoint can be taken it goes on exactly; from these it cannot, whatever the data
loader does (each seen by running Lightning 2.6 in ``tests/jobs/test_lightning_cuts.py``):

- the end of a training batch after which Lightning validates: the resumed run skips that
  validation (its metrics, and what callbacks decide on them);
- the end of an epoch's last training batch: the resumed run skips the rest of that epoch (its
  validation, its ``on_train_epoch_end`` hooks with epoch-level metrics, an epoch-interval
  ``ReduceLROnPlateau`` step, ``EarlyStopping``'s check) and the next epoch's
  ``on_train_epoch_start`` hooks;
- inside a gradient accumulation window: the gradients accumulated so far are not saved;
- at ``on_train_epoch_end``, when ``ReduceLROnPlateau`` steps at the epoch's end or the training
  step logs epoch-level metrics: Lightning takes the epoch as done, and does neither;
- bounded by ``max_steps``: an epoch's end (Lightning trains on in the ended epoch), anywhere in
  a run resumed from one (its epoch counters stay off), and the run's last step (the resumed
  run ends at once, without the rest of that epoch).

``Place`` says which of these a moment of the run is, so that ``ExactResume`` saves on
preemption only where Lightning goes on exactly, and warns when a checkpoint taken elsewhere
(by a ``ModelCheckpoint``, ``trainer.save_checkpoint``) is resumed. The rest of the module:

- ``stateful_training_loaders``: the loaders whose ``state_dict()`` Lightning saves, in its
  order, and ``states_left_unloaded``: the saved states it did not put back;
- ``prefetched``: how many batches Lightning's fetcher holds ahead of the training step (one,
  for a training loader without ``len()``): the loaders' states already count them;
- ``epoch_counts``: the fit loop's epoch progress, which ``start_epoch_left_unstarted``
  repairs after a resume.

Some of these read Lightning's private loop attributes (``fit_loop.epoch_loop``, its
``_should_check_val_fx`` and ``batch_progress``, ``fit_loop.epoch_progress``,

``fit_loop._data_fetcher``, ``fit_loop._combined_loader_states_to_load``); if a Lightning
release renames the first four, ``LightningInternalsChanged`` says so rather than guessing.
Each is a few attribute reads, once a batch.

What it changes in the loops after a resume, so that the run goes on as the uninterrupted one
would, and so do the checkpoints it saves:

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

import signal
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from .._checks import is_int

_MISSING = object()


class LightningInternalsChanged(RuntimeError):
    """This Lightning release lays out its loops otherwise than the 2.x releases
    ``unbroken.lightning`` was tested with."""


@dataclass(frozen=True)
class Place:
    """Where in the run a checkpoint taken now would resume, and why not exactly if not."""

    hook: str  # the last of ExactResume's hooks that ran: "train_batch_end", "validation_end"...
    accumulating: bool = False  # inside a gradient accumulation window
    validates_next: bool = False  # at a training batch's end, after which Lightning validates
    last_batch: bool = False  # at the end of an epoch's last training batch
    epoch_end_steps: bool = False  # before the epoch-end plateau steps and metrics (see below)
    by_max_steps: bool = False  # at an epoch's end of a run bounded by max_steps (see below)
    counters_off: bool = False  # Lightning's epoch counters are off since a resume (see below)
    last_step: bool = False  # at or after the run's last step, max_steps (see below)

    @property
    def exact(self) -> bool:
        return self.exact_but_for_counters and not self.counters_off

    @property
    def exact_but_for_counters(self) -> bool:
        """Exact, or off only in the epoch counters, which no later place of the run repairs:
        where a preemption save need not wait."""
        return not (self.accumulating or self.validates_next or self.last_batch) and not (
            self.epoch_end_steps or self.by_max_steps or self.last_step
        )

    def problems(self) -> list[str]:
        """What a run resumed from here loses, one phrase each (empty when exact)."""
        lost = []
        if self.accumulating:
            lost.append(
                "the gradients accumulated so far in this accumulation window are not in the "
                "checkpoint, so the window's optimizer step differs"
            )
        if self.validates_next:
            lost.append("Lightning skips the validation that follows this training batch")
        if self.last_batch:
            lost.append(
                "Lightning skips the end of this epoch (its on_train_epoch_end hooks, "
                "epoch-level metrics, an epoch-interval ReduceLROnPlateau step, EarlyStopping's "
                "check) and the next epoch's on_train_epoch_start hooks"
            )
        if self.epoch_end_steps:
            lost.append(
                "Lightning does not run the rest of this epoch's end: its epoch-interval "
                "ReduceLROnPlateau steps and the logging of epoch-level training metrics"
            )
        if self.by_max_steps:
            # Lightning 2.x, training by max_steps, takes a checkpoint of an epoch's end for
            # one taken at the end's start: it trains one more batch in the ended epoch and
            # starts the epoch after the next (found by benchmarks/goodput.py).
            lost.append(
                "Lightning, bounded by max_steps, resumes an epoch's end by training one more "
                "batch in that epoch and then skipping to the epoch after the next"
            )
        if self.last_step:
            lost.append(
                "this is the run's last step (max_steps): Lightning ends a run resumed here at "
                "once, without the rest of this epoch (its on_train_epoch_end hooks, "
                "epoch-level metrics, its validation if one follows)"
            )
        if self.counters_off:
            # Since a resume from an epoch's end under max_steps, Lightning's epoch_progress
            # counts the epoch as not started, and does not count the last one as completed.
            lost.append(
                "Lightning's epoch counters are off since this run resumed from an epoch's end "
                "under max_steps, so it runs on_train_epoch_start hooks again and counts "
                "batch_idx from 0 in the middle of the epoch"
            )
        return lost

    def to_state(self) -> dict[str, Any]:
        return {
            "hook": self.hook,
            "accumulating": self.accumulating,
            "validates_next": self.validates_next,
            "last_batch": self.last_batch,
            "epoch_end_steps": self.epoch_end_steps,
            "by_max_steps": self.by_max_steps,
            "counters_off": self.counters_off,
            "last_step": self.last_step,
        }


def batch_end_place(trainer: Trainer, stepped: bool) -> Place:
    """The place at ``on_train_batch_end``; ``stepped``: the optimizer stepped in this batch."""
    epoch_loop = _epoch_loop(trainer)
    module = trainer.lightning_module
    accumulating = (
        module.automatic_optimization and trainer.accumulate_grad_batches > 1 and not stepped
    )
    try:
        validates = bool(epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
        last = bool(epoch_loop.batch_progress.is_last_batch)
    except AttributeError as error:
        raise LightningInternalsChanged(
            f"unbroken.lightning: Lightning {lightning_version()} has no {error.name!r} where "
            "2.x has it (the training loop's progress); this release of unbroken cannot tell which "
            "checkpoints it resumes exactly. Use Lightning 2.4-2.6, or report it."
        ) from error
    off, last_step = _counters_off(trainer), _ran_last_step(trainer)
    return Place("train_batch_end", accumulating, validates, last, False, False, off, last_step)


def validation_end_place(trainer: Trainer, accumulating: bool) -> Place:
    """The place at a validation's end (``on_validation_end``) inside the training epoch."""
    off, last_step = _counters_off(trainer), _ran_last_step(trainer)
    return Place("validation_end", accumulating, counters_off=off, last_step=last_step)


def _ran_last_step(trainer: Trainer) -> bool:
    """Bounded by ``max_steps``, whether the run made its last step: a run resumed from here
    ends at once, without the end of the epoch the uninterrupted run still runs."""
    return 0 <= trainer.max_steps <= trainer.global_step


def epoch_end_place(trainer: Trainer) -> Place:
    """The place at ``on_train_epoch_end``: after it, Lightning steps the epoch-interval
    ``ReduceLROnPlateau`` schedulers and logs the epoch-level training metrics; resumed from a
    checkpoint taken here, it does neither (it takes the epoch as done). Bounded by
    ``max_steps`` (its "iteration-based training"), Lightning does not resume here exactly at
    all (``Place.problems``)."""
    steps = bool(epoch_plateau_monitors(trainer) or training_epoch_metrics(trainer))
    by_max_steps = trainer.max_steps != -1
    off = _counters_off(trainer, epoch_end=True)
    return Place(
        "train_epoch_end", epoch_end_steps=steps, by_max_steps=by_max_steps, counters_off=off
    )


def stateful_training_loaders(trainer: Trainer) -> list[Any]:
    """The training loaders whose ``state_dict()`` Lightning saves, in the order it saves
    them (its ``CombinedLoader``'s ``flattened``, those with ``state_dict`` and
    ``load_state_dict``)."""
    loaders = trainer.train_dataloader
    if loaders is None:
        return []
    return [loader for loader in CombinedLoader(loaders).flattened if _stateful(loader)]


def all_loaders(trainer: Trainer) -> list[tuple[str, Any]]:
    """("train" or "val", loader) for every loader of the fit that exists now."""
    found: list[tuple[str, Any]] = []
    for phase, loaders in (("train", trainer.train_dataloader), ("val", trainer.val_dataloaders)):
        if loaders is not None:
            found += [(phase, loader) for loader in CombinedLoader(loaders).flattened]
    return found


def prefetched(trainer: Trainer) -> int:
    """Batches Lightning's training fetcher took from the loaders and has not yet handed to the
    training step (it prefetches one when the loaders have no ``len()``)."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", _MISSING)
    if fetcher is _MISSING:
        raise LightningInternalsChanged(
            f"unbroken.lightning: Lightning {lightning_version()}'s fit loop has no "
            "'_data_fetcher'; this release of unbroken cannot tell whether it prefetched a batch"
        )
    return len(getattr(fetcher, "batches", ()))


def states_left_unloaded(trainer: Trainer) -> list[Any]:
    """The saved loader states Lightning read from the checkpoint and has not (yet) loaded into
    the training loaders: it loads them when it builds the loaders while resuming, and drops
    them when the loaders were built before (its issue 20550)."""
    return list(getattr(trainer.fit_loop, "_combined_loader_states_to_load", None) or ())


def saved_loader_states(checkpoint: dict[str, Any]) -> list[Any] | None:
    """The training loaders' states in a Lightning checkpoint (None if it holds none)."""
    try:
        states = checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader")
    except (KeyError, TypeError, AttributeError):
        return None
    return states if isinstance(states, list) and states else None


def _counters_off(trainer: Trainer, epoch_end: bool = False) -> bool:
    """Whether Lightning's epoch counters (``fit_loop.epoch_progress``, total and current) are
    not those it resumes exactly from: inside an epoch, ready == started == processed + 1 ==
    completed + 1; at ``on_train_epoch_end``, ready == started == processed == completed + 1."""
    current, total = epoch_counts(trainer)
    open_ = 0 if epoch_end else 1
    return not all(
        c.ready == c.started == c.processed + open_ == c.completed + 1 for c in (current, total)
    )


def epoch_counts(trainer: Trainer) -> tuple[Any, Any]:
    """(current, total) of the fit loop's ``epoch_progress``, each with int ready, started,
    processed and completed."""
    progress = getattr(trainer.fit_loop, "epoch_progress", None)
    counts = (getattr(progress, "current", None), getattr(progress, "total", None))
    fields = ("ready", "started", "processed", "completed")
    if not all(is_int(getattr(c, f, None)) for c in counts for f in fields):
        raise LightningInternalsChanged(
            f"unbroken.lightning: Lightning {lightning_version()}'s fit loop has no "
            f"epoch_progress with current and total {fields} (2.x has them); this release of "
            "unbroken cannot tell "
            "which checkpoints it resumes exactly. Use Lightning 2.4-2.6, or report it."
        )
    return counts


def training_epoch_metrics(trainer: Trainer) -> list[str]:
    """Names the training step logs with ``on_epoch=True`` (Lightning's running epoch sums)."""
    results = getattr(_epoch_loop(trainer), "_results", None)
    metrics = getattr(results, "result_metrics", ())
    return sorted(
        {m.meta.name for m in metrics if m.meta.on_epoch and m.meta.fx == "training_step"}
    )


def sole_unsized_training_loader(trainer: Trainer) -> Any:
    """The training loader if it is the only one and has no ``len()``, else None."""
    loaders = trainer.train_dataloader
    flat = CombinedLoader(loaders).flattened if loaders is not None else []
    if len(flat) != 1:
        return None
    try:
        len(flat[0])
    except TypeError:
        return flat[0]
    return None


def fetch_anew(trainer: Trainer) -> None:
    """Make Lightning's training fetcher iterate its loaders anew (what its epoch loop does at
    an epoch's start), dropping what it prefetched."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None:
        raise LightningInternalsChanged(
            f"unbroken.lightning: Lightning {lightning_version()}'s fit loop has no '_data_fetcher'"
        )
    iter(fetcher)


def iterates_anew_this_epoch(trainer: Trainer) -> bool:
    """Whether Lightning's training epoch loop calls ``iter()`` on the loaders as the epoch now
    starting begins (its ``on_run_start``: not in the first epoch, nor in the one it resumes
    in, which use the iterator made when the loaders were set up)."""
    fit_loop = trainer.fit_loop
    return trainer.current_epoch > 0 and not fit_loop.is_resuming and not fit_loop.restarting


def keep_ignoring_after_teardown(trainer: Trainer, signals: tuple[signal.Signals, ...]) -> None:
    """Lightning puts back, as it tears down after the exception that ends ``fit`` (our
    SystemExit(75)), the handlers it found when ``fit`` started: the default action for SIGTERM,
    which would let torchrun's SIGTERM to a rank still exiting kill it (-15). Make it put back
    "ignore" for the preemption signals instead (its ``_signal_connector._original_handlers``;
    on a release without it, nothing changes)."""
    originals = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
    if isinstance(originals, dict):
        for sig in signals:
            originals[sig] = signal.SIG_IGN


def epoch_plateau_monitors(trainer: Trainer) -> list[str]:
    """The metrics of the ``ReduceLROnPlateau`` schedulers that step at an epoch's end."""
    return [
        str(config.monitor)
        for config in trainer.lr_scheduler_configs
        if config.reduce_on_plateau and config.interval == "epoch"
    ]


def _epoch_loop(trainer: Trainer) -> Any:
    epoch_loop = getattr(trainer.fit_loop, "epoch_loop", None)
    if epoch_loop is None:
        raise LightningInternalsChanged(
            f"unbroken.lightning: Lightning {lightning_version()}'s fit loop has no 'epoch_loop'"
        )
    return epoch_loop


def _stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def lightning_version() -> str:
    """The installed Lightning's version, for messages."""
    import lightning

    return str(getattr(lightning, "__version__", "?"))


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
