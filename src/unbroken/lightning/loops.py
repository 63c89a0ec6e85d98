"""What ``ExactResume`` reads of Lightning's training loop, and the one flag it changes.

Lightning 2.x decides where a resumed run goes on from its loops' progress counters. From most
places a checkpoint can be taken it goes on exactly; from three it cannot, whatever the data
loader does (each seen by running Lightning 2.6 in ``tests/test_lightning_cuts.py``):

- the end of a training batch after which Lightning validates: the resumed run skips that
  validation (its metrics, and what callbacks decide on them);
- the end of an epoch's last training batch: the resumed run skips the rest of that epoch (its
  validation, its ``on_train_epoch_end`` hooks with epoch-level metrics, an epoch-interval
  ``ReduceLROnPlateau`` step, ``EarlyStopping``'s check) and the next epoch's
  ``on_train_epoch_start`` hooks;
- inside a gradient accumulation window: the gradients accumulated so far are not saved;
- at ``on_train_epoch_end``, when ``ReduceLROnPlateau`` steps at the epoch's end or the training
  step logs epoch-level metrics: Lightning takes the epoch as done, and does neither.

``Place`` says which of these a moment of the run is, so that ``ExactResume`` saves on
preemption only where Lightning goes on exactly, and warns when a checkpoint taken elsewhere
(by a ``ModelCheckpoint``, ``trainer.save_checkpoint``) is resumed. The rest of the module:

- ``stateful_training_loaders``: the loaders whose ``state_dict()`` Lightning saves, in its
  order, and ``states_left_unloaded``: the saved states it did not put back;
- ``prefetched``: how many batches Lightning's fetcher holds ahead of the training step (one,
  for a training loader without ``len()``): the loaders' states already count them;
- ``let_plateau_schedulers_step``: Lightning skips ``ReduceLROnPlateau`` at the end of the first
  epoch after a resume (it assumes the monitored metric is lost; ``ExactResume`` saves it).

Four of these read Lightning's private loop attributes (``fit_loop.epoch_loop``, its
``_should_check_val_fx`` and ``batch_progress``, ``fit_loop._data_fetcher``,
``fit_loop._combined_loader_states_to_load``); if a Lightning release renames the first three,
``LightningInternalsChanged`` says so rather than guessing.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.combined_loader import CombinedLoader

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

    @property
    def exact(self) -> bool:
        return not (self.accumulating or self.validates_next or self.last_batch) and not (
            self.epoch_end_steps or self.by_max_steps
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
        return lost

    def to_state(self) -> dict[str, Any]:
        return {
            "hook": self.hook,
            "accumulating": self.accumulating,
            "validates_next": self.validates_next,
            "last_batch": self.last_batch,
            "epoch_end_steps": self.epoch_end_steps,
            "by_max_steps": self.by_max_steps,
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
            f"unbroken.lightning: Lightning {_version()} has no {error.name!r} where 2.x has it "
            "(the training loop's progress); this release of unbroken cannot tell which "
            "checkpoints it resumes exactly. Use Lightning 2.4-2.6, or report it."
        ) from error
    return Place("train_batch_end", accumulating, validates, last)


def epoch_end_place(trainer: Trainer) -> Place:
    """The place at ``on_train_epoch_end``: after it, Lightning steps the epoch-interval
    ``ReduceLROnPlateau`` schedulers and logs the epoch-level training metrics; resumed from a
    checkpoint taken here, it does neither (it takes the epoch as done). Bounded by
    ``max_steps`` (its "iteration-based training"), Lightning does not resume here exactly at
    all (``Place.problems``)."""
    steps = bool(_epoch_plateau_monitors(trainer) or training_epoch_metrics(trainer))
    return Place("train_epoch_end", epoch_end_steps=steps, by_max_steps=trainer.max_steps != -1)


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
            f"unbroken.lightning: Lightning {_version()}'s fit loop has no '_data_fetcher'; "
            "this release of unbroken cannot tell whether it prefetched a batch"
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


def let_plateau_schedulers_step(trainer: Trainer) -> list[str]:
    """Called at the end of the first epoch after a resume (``on_train_epoch_end``), where
    Lightning leaves out its epoch-interval ``ReduceLROnPlateau`` steps (``not self.restarting``
    in ``FitLoop.on_advance_end``: it assumes the monitored metric was lost with the process;
    ``ExactResume`` saves ``callback_metrics``). If every such scheduler's metric is available,
    clear the flag that makes Lightning skip them (it clears it itself right after) and return
    []; else leave it, and return the missing metrics' names."""
    monitors = _epoch_plateau_monitors(trainer)
    if not monitors:
        return []
    missing = [name for name in monitors if name not in trainer.callback_metrics]
    if not missing:
        trainer.fit_loop.restarting = False
    return missing


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
            f"unbroken.lightning: Lightning {_version()}'s fit loop has no '_data_fetcher'"
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


def _epoch_plateau_monitors(trainer: Trainer) -> list[str]:
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
            f"unbroken.lightning: Lightning {_version()}'s fit loop has no 'epoch_loop'"
        )
    return epoch_loop


def _stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def _version() -> str:
    import lightning

    return str(getattr(lightning, "__version__", "?"))
