"""``unbroken.hf.Trainer``: ``transformers.Trainer``, resumed exactly from sealed checkpoints.

Use it as ``transformers.Trainer``; ``train(resume_from_checkpoint=True)`` resumes::

    trainer = unbroken.hf.Trainer(model=model, args=args, train_dataset=train)
    trainer.train(resume_from_checkpoint=True)   # the newest sealed checkpoint-<step>

What it changes, all through transformers' public hooks but for the two names that
``internals`` reads:

- **The training data**: ``get_train_dataloader`` builds an ``unbroken.DataLoader`` from the
  ``TrainingArguments`` (batch size, workers, pinning, persistent workers, prefetch,
  ``drop_last``, the collator without unused columns, the seed from ``data_seed`` or ``seed``,
  ``train_sampling_strategy`` "random" or "sequential"). Its position is saved with every
  checkpoint and restored in O(1); transformers' skip of the resumed epoch's first batches
  becomes a check of that position (``internals``), and reads no batch.
  Each sample's randomness derives from (seed, epoch, position), so augmentations repeat.
- **What a checkpoint holds besides transformers' files**: each rank's
  ``unbroken-state-rank<r>.json`` (the loader's state, the loss accumulated since the last log),
  then a seal (``unbroken.hf.seal``) once every rank has written. transformers' own
  per-rank random states (``rng_state*.pth``) put back dropout's generator.
- **Which checkpoint a resume loads**: ``resume_from_checkpoint=True`` takes the newest sealed
  one, skipping unsealed or damaged ones with a warning naming them, and trains from the start
  when there is no checkpoint folder at all (so one command starts and resumes a job); folders
  of which none is sealed are an error. A path must be sealed.
  Checkpoints newer than the one resumed are removed: the resumed run writes them again.
- **Where saves happen**: a save that lands on an epoch's last step waits for the epoch's end,
  after transformers' epoch-end evaluation and logging, which a run resumed from it would skip
  otherwise. ``save_total_limit`` keeps that many *sealed* checkpoints (and the best one);
  transformers' own rotation is turned off, since it could delete the last sealed checkpoint
  before the new one is sealed.
- **Preemption**: SIGTERM and SIGUSR1 (``signals=``) set a flag; at the next optimizer step the
  ranks agree (one all-reduce every ``check_every`` steps), the checkpoint is saved and sealed,
  and every process exits with 75. DataLoader workers ignore these signals meanwhile.
- **DDP on 3 or more ranks**: ``unbroken.distributed.exact_reduce`` on the wrapped model.

``ExactResumeMixin`` does all this for a subclass of ``transformers.Trainer`` of your own
(``class MyTrainer(ExactResumeMixin, SFTTrainer)``).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import TrainerCallback

from .._files import atomic_write
from ..data.loader import DataLoader
from ..distributed.reduction import ensure_exact
from ..errors import CorruptCheckpoint, StateMismatch
from ..preemption import DEFAULT_SIGNALS, EXIT_CODE, Preemption, exit_to_be_requeued
from ..train.agreement import Agreement
from ..train.progress import say
from . import internals
from .loader import TrainLoader
from .seal import check, checkpoints, prune, resume_point, seal
from .state import FORMAT, VERSION, state_file

_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR


class ExactResumeMixin:
    """Exact resume for a ``transformers.Trainer`` (subclass): put it first in the bases.

    Args:
        *args: The Trainer's positional arguments.
        signals: The preemption signals (default SIGTERM and SIGUSR1); ``()`` installs none.
        check_every: On several ranks, agree on a preemption signal every this many optimizer
            steps (one all-reduce of an int).
        **kwargs: The Trainer's keyword arguments.

    Raises:
        TypeError: the mixin is not before ``transformers.Trainer`` in the bases.
        RuntimeError: the installed transformers is not a tested version (set
            ``UNBROKEN_HF_UNTESTED=1`` to be warned instead).
    """

    def __init__(
        self, *args: Any, signals: Any = DEFAULT_SIGNALS, check_every: int = 1, **kwargs: Any
    ) -> None:
        if not isinstance(self, transformers.Trainer):
            raise TypeError("ExactResumeMixin goes before transformers.Trainer in the bases")
        internals.check_version()
        internals.install_skip(lambda loader: isinstance(loader, TrainLoader), TrainLoader.skip)
        super().__init__(*args, **kwargs)
        self._exact = ExactResumeCallback(self, signals, check_every)
        self.add_callback(self._exact)

    # The training data.
    def get_train_dataloader(self) -> Any:
        """Build the training data's ``unbroken.DataLoader`` from the ``TrainingArguments``.

        Returns:
            The loader, whose position each checkpoint saves.

        Raises:
            ValueError: there is no ``train_dataset``, or ``train_sampling_strategy`` is not
                ``"random"`` or ``"sequential"``.
        """
        trainer: Any = self
        dataset = trainer.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args = trainer.args
        dataset, collator = internals.training_data(trainer, dataset)
        options: dict[str, Any] = {}
        if args.world_size > 1:
            options.update(rank=args.process_index, world_size=args.world_size)
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            strategy = args.train_sampling_strategy
            if strategy not in ("random", "sequential"):
                raise ValueError(
                    f"unbroken.hf.Trainer orders the training data itself and supports "
                    f"train_sampling_strategy 'random' or 'sequential', not {strategy!r}"
                )
            options["shuffle"] = strategy == "random"
            options["drop_last"] = args.dataloader_drop_last
        loader: DataLoader = DataLoader(
            dataset,
            batch_size=internals.train_batch_size(trainer),
            collate_fn=collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            **options,
        )
        self._exact.attach(loader)
        return self._exact.train_loader

    # Resuming.
    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """Train as ``transformers.Trainer.train``, resuming from the newest sealed checkpoint.

        Args:
            resume_from_checkpoint: ``True`` takes the newest sealed checkpoint, or starts from
                the beginning when there is no checkpoint folder; a path must be sealed.
            *args: ``transformers.Trainer.train``'s other arguments.
            **kwargs: Likewise.

        Returns:
            What ``transformers.Trainer.train`` returns.
        """
        trainer: Any = self
        if trainer.args.ignore_data_skip:
            say(
                "ignore_data_skip=True is ignored: the training loader resumes at the batch "
                "after the checkpoint, and skips nothing to get there"
            )
            trainer.args.ignore_data_skip = False  # transformers then counts the resumed epoch
        path = self._exact.resolve(resume_from_checkpoint)
        with self._exact.preemption:
            return super().train(path, *args, **kwargs)  # type: ignore[misc]


class Trainer(ExactResumeMixin, transformers.Trainer):
    """``transformers.Trainer`` with exact resume (see the module).

    Args:
        *args: ``transformers.Trainer``'s positional arguments.
        signals: The preemption signals (default SIGTERM and SIGUSR1); ``()`` installs none.
        check_every: On several ranks, agree on a preemption signal every this many optimizer
            steps (one all-reduce of an int).
        **kwargs: ``transformers.Trainer``'s keyword arguments.

    Raises:
        TypeError: in a subclass whose bases put ``ExactResumeMixin`` after
            ``transformers.Trainer`` (the shared constructor checks the order).
        RuntimeError: the installed transformers is not a tested version (set
            ``UNBROKEN_HF_UNTESTED=1`` to be warned instead).
    """


class ExactResumeCallback(TrainerCallback):
    """The Trainer's side of exact resume, added by ``ExactResumeMixin``."""

    def __init__(self, trainer: Any, signals: Any, check_every: int) -> None:
        if type(check_every) is not int or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
        self.trainer = trainer
        self.preemption = Preemption(signals)
        self.check_every = check_every
        self.train_loader: TrainLoader | None = None
        self._restore: dict[str, Any] | None = None  # this rank's saved state, until used
        self._agreement: Agreement | None = None
        self._keep = trainer.args.save_total_limit
        trainer.args.save_total_limit = None  # rotation here, once sealed (see the module)
        self._save_at_epoch_end = False
        self._preempted = False

    # Before training.
    def resolve(self, resume: str | bool | None) -> str | None:
        """The checkpoint folder to resume from, checked, with this rank's state read."""
        args = self.trainer.args
        self._restore = None
        if resume is None or resume is False:
            return None
        if resume is True:
            path, _ = resume_point(args.output_dir, _PREFIX)
            if path is None:  # the job's first run: the same command starts it
                say(f"no checkpoint in {args.output_dir}: training from the start")
                return None
        else:
            path = str(resume)
            verdict = check(path)
            if not verdict.sealed:
                raise CorruptCheckpoint(
                    f"cannot resume from {path}: {verdict.reason()}; "
                    "resume_from_checkpoint=True takes the newest sealed checkpoint"
                )
        self._restore = self._read_state(path)
        self._remove_newer(path)
        say(f"resuming from {path}")
        return path

    def _read_state(self, path: str) -> dict[str, Any]:
        args = self.trainer.args
        rank, world_size = args.process_index, args.world_size
        file = os.path.join(path, state_file(rank))
        if not os.path.isfile(file):
            if os.path.isfile(os.path.join(path, state_file(0))):
                file = os.path.join(path, state_file(0))
            else:
                raise StateMismatch(
                    f"{path} holds no {state_file(rank)}: it was not saved by unbroken.hf.Trainer, "
                    "so where its data stopped is unknown. Resume it with transformers.Trainer, "
                    "or start the run anew."
                )
        with open(file, encoding="utf-8") as handle:
            state = json.load(handle)
        for name, want in (("format", FORMAT), ("version", VERSION)):
            if state.get(name) != want:
                raise StateMismatch(
                    f"{file}: field {name!r} is {state.get(name)!r}, this unbroken reads {want!r}"
                )
        if state["world_size"] != world_size:
            warnings.warn(
                f"unbroken.hf: resuming on {world_size} ranks from a checkpoint of "
                f"{state['world_size']}: the data continues exactly, but the ranks' random "
                "generators and loss accumulators cannot be split, so dropout and the first "
                "logged loss differ from an uninterrupted run",
                stacklevel=4,
            )
            state["logging"] = None
        return state

    def _remove_newer(self, path: str) -> None:
        """Checkpoints newer than the resumed one belong to a run that is being redone."""
        args = self.trainer.args
        if args.should_save:  # process 0, or each node's first with save_on_each_node
            resumed = os.path.realpath(path)
            for _, folder in checkpoints(args.output_dir, _PREFIX):
                if os.path.realpath(folder) == resumed:
                    break
                say(f"removing {folder}, newer than the checkpoint resumed")
                shutil.rmtree(folder, ignore_errors=True)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def attach(self, loader: DataLoader) -> None:
        """The loader ``get_train_dataloader`` built: restored from the checkpoint, if any."""
        if self._restore is not None:
            loader.load_state_dict(self._restore["loader"])
        self.train_loader = TrainLoader(loader)

    # Training.
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._agreement = Agreement()
        self._preempted = self._save_at_epoch_end = False
        ensure_exact(self.trainer.model_wrapped, "unbroken.hf.Trainer")
        saved = self._restore
        if saved is not None:
            if saved["global_step"] != state.global_step:
                raise StateMismatch(
                    f"the checkpoint's trainer_state.json is at step {state.global_step} and "
                    f"its unbroken state at step {saved['global_step']}: it was changed by hand"
                )
            if saved.get("logging") is not None:
                internals.restore_logging_state(self.trainer, saved["logging"])
            self._restore = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.train_loader is not None:  # after transformers put back the saved states
            self.train_loader.take_fetch_states()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.train_loader is not None:  # transformers counts from the resume: from the data
            state.epoch = self.train_loader.epoch_progress(args)
        agreement = self._agreement
        if (
            agreement is not None
            and self.preemption.signals
            and state.global_step % self.check_every == 0
        ):
            (stop,) = agreement.any_of(self.preemption.requested)
            if stop:
                self._preempted = True
                control.should_save = control.should_training_stop = True
        loader = self.train_loader
        if control.should_save and loader is not None and loader.at_epoch_end():
            # transformers evaluates and logs at the epoch's end after this save: a run resumed
            # from it would start the next epoch without them. Saved after them instead.
            control.should_save = False
            self._save_at_epoch_end = True

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._save_at_epoch_end:
            control.should_save = True
            self._save_at_epoch_end = False

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"{_PREFIX}-{state.global_step}")
        self._write_state(folder, state.global_step)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.barrier()  # every rank's files are written
        if args.should_save:  # process 0, or each node's first with save_on_each_node
            seal(folder)
            self._rotate(folder, state)
        if distributed:
            dist.barrier()  # sealed: no rank exits before
        if self._preempted:
            say(f"preempted: saved and sealed {folder}; exiting with {EXIT_CODE} to be requeued")
            self.preemption.ignore_until_exit()
            exit_to_be_requeued()

    def _write_state(self, folder: str, step: int) -> None:
        args, loader = self.trainer.args, self.train_loader
        state = {
            "format": FORMAT,
            "version": VERSION,
            "rank": args.process_index,
            "world_size": args.world_size,
            "global_step": step,
            "loader": None if loader is None else loader.loader.state_dict(),
            "logging": internals.logging_state(self.trainer),
        }
        os.makedirs(folder, exist_ok=True)
        target = os.path.join(folder, state_file(args.process_index))
        atomic_write(target, json.dumps(state).encode())

    def _rotate(self, newest: str, state: Any) -> None:
        """Keep ``save_total_limit`` sealed checkpoints (and the best); remove the rest."""
        if self._keep is None or self._keep <= 0:
            return
        step = state.global_step
        spare = state.best_model_checkpoint
        for folder in prune(os.path.dirname(newest), self._keep, step, _PREFIX, spare):
            say(f"removing {folder} (save_total_limit={self._keep})")
