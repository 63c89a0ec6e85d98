"""``ExactResume``: a Lightning run resumed from a checkpoint goes on as if never stopped.

Lightning 2.x saves its loop counters and the ``state_dict()`` of every training loader that has
one, so an ``unbroken.DataLoader`` returned by ``train_dataloader()`` resumes at the batch after
the checkpoint. What else a resumed run needs, this callback adds:

- **The process's random generators**, which Lightning does not save (dropout would draw other
  masks): every rank's torch (CPU and CUDA), numpy and ``random`` states, gathered into the
  checkpoint rank 0 writes, put back when training starts (after ``train_dataloader()`` and the
  sanity check, so nothing Lightning does before the first batch moves them).
- **The metrics callbacks and schedulers read** (``trainer.callback_metrics``, each rank's), put
  back at the same moment, and ``ReduceLROnPlateau``'s step at the end of the first resumed
  epoch, which Lightning leaves out (``loops.let_plateau_schedulers_step``).
- **Lightning's epoch counters**, which it leaves short after a resume from an epoch's last
  batch (``loops.start_epoch_left_unstarted``), so that the resumed run's own checkpoints
  resume exactly.
- **The loaders' positions where Lightning drops them**: loaders built before the checkpoint is
  loaded (``trainer.estimated_stepping_batches`` in ``configure_optimizers``) get their saved
  state when training starts. A loader without ``len()`` is a batch ahead of the training step
  (Lightning prefetches it), so its state is saved as it was before that batch.
- **Preemption.** SIGTERM and SIGUSR1 (``signals=``) only set a flag (``Preemption``). At the
  next place Lightning resumes exactly from (``loops.Place``), the ranks agree (one all-reduce),
  ``last.ckpt`` is saved where ``ckpt_path="last"`` loads it, and the process exits with 75.
  That place is the end of the signal's training step, or later: the optimizer step that ends a
  gradient accumulation window, the end of a validation after the batch, an epoch's end.
  Where the run ends anyway, nothing is saved: it finishes, exit 0 (``stops``). A checkpoint
  saved after a stop was decided keeps ``trainer.should_stop``; a run resumed from it stops.
- **DDP on 3 or more ranks**: ``unbroken.distributed.exact_reduce`` registered on the strategy's
  model, so a resumed step sums its gradients as the uninterrupted one did.
- **Whole checkpoints**: ``AtomicCheckpointIO``, installed unless the Trainer has a checkpoint
  plugin of its own.
- **Warnings where exactness is out of its hands** (``advice``): a checkpoint saved where
  Lightning does not go on exactly (``loops.Place.problems``: at an epoch's last batch, before
  a validation, inside an accumulation window); a torch ``DataLoader`` (its position is not
  saved, and a SIGTERM to the process group kills its workers before anything is saved); numpy
  or ``random`` draws after a resume that moved a loader between 0 and more workers
  (``draws``); a ``ModelCheckpoint`` that writes no checkpoint (``save_top_k=0`` without
  ``save_last``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from .._checks import is_int
from ..data.epochs import EpochIterable
from ..data.loader import DataLoader
from ..distributed.reduction import ensure_exact
from ..distributed.world import World
from ..preemption import DEFAULT_SIGNALS, Preemption, exit_to_be_requeued
from ..train.agreement import Agreement
from ..train.globalrng import GlobalRNG
from ..train.progress import say
from . import draws, loops, stops
from .advice import WHAT, Advice, resumed_inexactly
from .io import AtomicCheckpointIO
from .saved import VERSION, metrics, read_state, stop_decided, tensors


class ExactResume(Callback):
    """Makes a Lightning run resumed from a checkpoint continue exactly (see the module).

    Args:
        signals: The preemption signals (default SIGTERM and SIGUSR1); ``()`` leaves signal
            handling to Lightning.
        check_every: Under ``torch.distributed``, the ranks agree on a preemption signal every
            this many optimizer steps (one all-reduce of an int); 1 checks every step.

    Raises:
        ValueError: ``check_every`` is not an int >= 1.
    """

    def __init__(self, signals: Any = DEFAULT_SIGNALS, check_every: int = 1) -> None:
        if not is_int(check_every) or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
        self.preemption = Preemption(signals)
        self.check_every = check_every
        self._trainer: Trainer | None = None
        self._agreement: Agreement | None = None
        self._place = loops.Place("setup")  # where a checkpoint taken now would resume
        self._step_at_batch_start = 0
        self._advice = Advice()  # each warning once, on the first rank
        # Training batches of the epoch it resumed in that the run saving the checkpoint ran.
        self._batches_before_resume: int | None = None
        self._epoch_metrics_before: list[str] = []  # ... and what it logged with on_epoch=True
        # From the checkpoint being resumed, used at train start:
        self._restore: dict | None = None  # this rank's generators and metrics
        self._saved_workers: dict[str, list[int]] | None = None  # the loaders' num_workers
        self._draws = draws.DrawWatch([])  # watches the steps if they changed across 0
        self._loader_states: list | None = None
        self._stop_decided = False  # the checkpoint was saved after the run decided to stop
        self._finishing = False  # preempted as the run ends: it finishes instead of saving

    @property
    def state_key(self) -> str:
        """The checkpoint's key for this callback: one per Trainer, not keyed by its arguments."""
        return "unbroken.ExactResume"

    # Set-up and tear-down.
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """For a fit: keep the trainer, and install ``AtomicCheckpointIO`` over Lightning's."""
        if stage != "fit":
            return
        self._trainer, self._agreement = trainer, Agreement()
        self._advice.first = self._agreement.world.first
        self._finishing = False
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's own
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        stops.run_after_stop_deciders(trainer, self)
        self._advice.writes_nothing(trainer)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Lightning's DDP on 3+ ranks: register sums that its bucket rebuild cannot change."""
        ensure_exact(trainer.strategy.model, "unbroken.lightning.ExactResume")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Put back the signal handlers; a later ``validate()`` or fit is not this resume."""
        self.preemption.uninstall()
        self._draws = draws.DrawWatch([])  # a later validate() or fit is not this resume
        self._stop_decided = False  # nor is a checkpoint loaded by validate()

    # What the checkpoint holds.
    def state_dict(self) -> dict[str, Any]:
        """Every rank's generators and metrics (gathered: Lightning saves rank 0's state)."""
        trainer = self._trainer
        mine = {
            "rng": GlobalRNG().state_dict(),
            "metrics": metrics(trainer),
            # Epoch aggregates of the training step: after a resume they cover only its batches.
            "epoch_metrics": loops.training_epoch_metrics(trainer) if trainer is not None else [],
        }
        ranks: list = [mine]
        world = World.current()
        if world.distributed:
            ranks = [None] * world.size
            dist.all_gather_object(ranks, mine)  # Lightning writes rank 0's checkpoint only
        saved_at = self._place.to_state()
        workers = draws.worker_counts(trainer)
        # Lightning saves no stop decision: a run resumed after one would train on.
        should_stop = bool(trainer is not None and trainer.should_stop)
        state = dict(version=VERSION, ranks=ranks, saved_at=saved_at, workers=workers)
        return {**state, "should_stop": should_stop}

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Warn if saved where Lightning cannot resume exactly; fix prefetched loader states."""
        if not self._place.exact:
            self._advice.saved_inexactly(self._place)
        # A training loader without len() is a batch ahead of the training step: Lightning
        # prefetched it to learn whether the epoch ends. Save the state before that batch.
        ahead = loops.prefetched(trainer) if trainer.state.fn == "fit" else 0
        states = loops.saved_loader_states(checkpoint)
        if not ahead or states is None:
            return
        for i, loader in enumerate(loops.stateful_training_loaders(trainer)):
            behind = loader._state_before_last_batch() if isinstance(loader, DataLoader) else None
            if ahead == 1 and behind is not None:
                states[i] = behind
            else:
                self._advice.prefetched(ahead, loader)

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Keep the saved loader states, for loaders Lightning will not restore."""
        self._loader_states = loops.saved_loader_states(checkpoint)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's generators and metrics, put back when training starts."""
        ranks, place, self._saved_workers = read_state(state_dict)
        self._stop_decided = stop_decided(state_dict)
        here = World.current()
        rank, world = here.rank, here.size
        if len(ranks) != world:
            warnings.warn(
                f"{WHAT}: the checkpoint holds the random generators of {len(ranks)} ranks and "
                f"this job has {world}; rank {rank} continues from rank {rank % len(ranks)}'s. "
                "Dropout and other draws of the training step will differ from the run that "
                "saved it (the data order does not).",
                stacklevel=2,
            )
        self._restore = ranks[rank % len(ranks)]
        resumed_inexactly(place, here.first)

    # Training starts: put back what Lightning does not.
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Install the preemption handlers and put back what Lightning does not restore."""
        # Over Lightning's own handlers, which it registers after the callbacks' setup: its
        # SIGTERM handler would stop the run before a checkpoint is saved.
        self.preemption.install()
        self._advice.torch_loaders(trainer, self.preemption.signals)
        if self._loader_states is not None:
            self._load_dropped_loader_states(trainer, self._loader_states)
            self._loader_states = None
        self._batches_before_resume = None if self._restore is None else -1  # -1: not known yet
        if self._saved_workers is not None:
            now = draws.worker_counts(trainer)
            self._draws = draws.DrawWatch(draws.crossed(self._saved_workers, now))
            self._saved_workers = None
        if self._stop_decided:
            # Set before Lightning's first check: where it may stop (min_epochs and min_steps
            # met) the run ends at once, as the one that saved the checkpoint did.
            trainer.should_stop, self._stop_decided = True, False
            say("resumed from a checkpoint saved after the run decided to stop: it stops")
        if self._restore is not None:
            self._epoch_metrics_before = self._restore.get("epoch_metrics", [])
            GlobalRNG().load_state_dict(self._restore["rng"])
            trainer.callback_metrics.update(tensors(self._restore.get("metrics", {})))
            self._restore = None

    def _load_dropped_loader_states(self, trainer: Trainer, saved: list) -> None:
        """Load the saved loader states that Lightning leaves unloaded: in loaders built before
        the checkpoint loaded (``estimated_stepping_batches`` in ``configure_optimizers``), and
        at an epoch's end (a loader without a sampler's ``set_epoch`` would restart epoch 0).
        An unbroken iterator takes its position at its first batch, so nothing was drawn, but
        from a loader without len(), which Lightning's fetcher prefetched: it is made anew."""
        loaders = loops.stateful_training_loaders(trainer)
        if not loops.states_left_unloaded(trainer) or len(loaders) != len(saved):
            return  # Lightning loaded them (or raises on the mismatch itself)
        prefetched = False
        for loader, state in zip(loaders, saved):
            if isinstance(loader, EpochIterable):
                ours: Any = loader
                prefetched |= ours._open
                ours.load_state_dict(state)
                continue
            self._advice.dropped(loader)
        if prefetched:
            loops.fetch_anew(trainer)

    # Where the run is, and preemption.
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Note where the run is; after a resume, fix Lightning's epoch counters."""
        self._step_at_batch_start = trainer.global_step
        if self._batches_before_resume == -1:  # the first batch after a resume
            self._batches_before_resume = batch_idx
            loops.start_epoch_left_unstarted(trainer)  # so that later checkpoints resume exactly
        self._draws.start()
        # Gradients of the window's earlier batches wait for its optimizer step.
        self._place = loops.Place("train_batch_start", accumulating=self._place.accumulating)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Note where the run is; save and exit there if preempted and it resumes exactly."""
        self._advice.draws(self._draws.end("training"))
        stepped = trainer.global_step != self._step_at_batch_start
        self._place = loops.batch_end_place(trainer, stepped)
        if self._place.exact_but_for_counters and trainer.global_step % self.check_every == 0:
            self._stop_if_preempted(trainer)

    def on_validation_batch_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """Watch the batch's random draws (after a change of ``num_workers`` across 0)."""
        self._draws.start()

    def on_validation_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """Warn if the batch drew from numpy or ``random`` where that is not exact."""
        self._advice.draws(self._draws.end("validation"))

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Note that the fit is validating."""
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._place = loops.Place("validation", accumulating=self._place.accumulating)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Note where the run is; save and exit there if preempted and it resumes exactly."""
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._place = loops.validation_end_place(trainer, self._place.accumulating)
        if self._place.exact_but_for_counters:
            self._stop_if_preempted(trainer)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Restart a loader's epoch that Lightning's prefetch would end at once (see below)."""
        self._place = loops.Place("train_epoch_start")
        # Resumed at an epoch's end, Lightning prefetches the next epoch's first batch from a
        # loader without len() while it finishes the old epoch, then starts the new epoch with
        # a new iterator: which would end the loader's epoch it had just begun. Start it again.
        loader = loops.sole_unsized_training_loader(trainer)
        if (
            isinstance(loader, EpochIterable)
            and loader._open
            and loader.epoch == trainer.current_epoch
            and loops.iterates_anew_this_epoch(trainer)
        ):
            loader.set_epoch(trainer.current_epoch)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Step plateau schedulers after a resume; save and exit here if preempted, unless an
        ``EarlyStopping`` decides after this hook (``stops``)."""
        if trainer.fit_loop.restarting:  # the first epoch's end after a resume
            self._first_epoch_end_after_resume(trainer)
        self._place = loops.epoch_end_place(trainer)
        if self._place.exact_but_for_counters and not stops.decided_after_epoch_end(trainer):
            self._stop_if_preempted(trainer, epoch_end=True)

    def _first_epoch_end_after_resume(self, trainer: Trainer) -> None:
        before: Any = self._batches_before_resume
        if before == -1:  # resumed at this epoch's end: all its batches ran before
            before = trainer.num_training_batches
        names = set(loops.training_epoch_metrics(trainer)) | set(self._epoch_metrics_before)
        partial = sorted(names) if before else []
        if partial:
            self._advice.partial_epoch_metrics(partial, before)
        self._batches_before_resume = None
        missing = loops.let_plateau_schedulers_step(trainer)
        if missing:
            self._advice.plateau(missing)

    def _stop_if_preempted(self, trainer: Trainer, epoch_end: bool = False) -> None:
        """Save ``last.ckpt`` and exit 75 if any rank was preempted, unless every rank's run
        ends here (a stop decided, ``max_steps`` or ``max_epochs`` reached): it finishes as the
        uninterrupted run does, and exits 0. One all-reduce of two ints under DDP."""
        if self._agreement is None or self._finishing:
            return
        ends = stops.ends_here(trainer, epoch_end)
        stop, going_on = self._agreement.any_of(self.preemption.requested, not ends)
        if not stop:
            return
        if not going_on:
            self._finishing = True
            say("preempted as the run ends: it finishes instead of saving a checkpoint")
            return
        trainer.save_checkpoint(_last_path(trainer))  # on every rank: it gathers their states
        self.preemption.ignore_until_exit()  # saved: nothing may kill it with -15 now
        loops.keep_ignoring_after_teardown(trainer, self.preemption.signals)
        exit_to_be_requeued(destroy_groups=False)  # Lightning's teardown still uses them


def _last_path(trainer: Trainer) -> str:
    """Where ``ckpt_path="last"`` looks first: ``last.ckpt`` in the ModelCheckpoint's dir."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
        name = callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION
        return os.path.join(callback.dirpath, name)
    return os.path.join(trainer.default_root_dir, "last.ckpt")
