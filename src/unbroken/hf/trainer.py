"""``unbroken.hf.Trainer``: ``transformers.Trainer``, resumed exactly from sealed checkpoints.

Use it as ``transformers.Trainer``; ``train(resume_from_checkpoint=True)`` resumes::

    trainer = unbroken.hf.Trainer(model=model, args=args, train_dataset=train)
    trainer.train(resume_from_checkpoint=True)   # the newest sealed checkpoint-<step>

What it changes, all through transformers' public hooks except for what ``internals`` touches
(five private attributes of the Trainer and the global ``transformers.trainer.skip_first_batches``):

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
  Checkpoints newer than the one resumed are removed: the resumed run writes them again; a
  damaged one is moved into ``damaged/`` (``aside``).
- **Where saves happen**: a save that lands on an epoch's last step waits for the epoch's end,
  after transformers' epoch-end evaluation and logging, which a run resumed from it would skip
  otherwise. ``save_total_limit`` keeps that many *sealed* checkpoints (and the best one);
  transformers' own rotation is turned off, since it could delete the last sealed checkpoint
  before the new one is sealed.
- **Preemption**: SIGTERM and SIGUSR1 (``signals=``) set a flag; at the next optimizer step the
  ranks agree (one all-reduce every ``check_every`` steps), the checkpoint is saved and sealed,
  and every process exits with 75. DataLoader workers ignore these signals meanwhile.
- **DDP on 3 or more ranks**: ``unbroken.distributed.exact_reduce`` on the wrapped model.
- **torchrun's restarts**: under ``--max-restarts``, a process group that
  ``unbroken.distributed.init_process_group`` did not make (``TrainingArguments`` make one with
  torch's own call when none exists) is refused at construction: a restart could not start it.

``ExactResumeMixin`` does all this for a subclass of ``transformers.Trainer`` of your own
(``class MyTrainer(ExactResumeMixin, SFTTrainer)``).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from ..data.loader import DataLoader
from ..distributed.process_group import refuse_unrestartable_group
from ..preemption import DEFAULT_SIGNALS
from ..train.progress import say
from . import internals
from .callback import ExactResumeCallback
from .loader import TrainLoader


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
            ``UNBROKEN_HF_UNTESTED=1`` to be warned instead); or, under ``torchrun
            --max-restarts``, the process group was not made by
            ``unbroken.distributed.init_process_group``: a restart could not start it again.
    """

    def __init__(
        self, *args: Any, signals: Any = DEFAULT_SIGNALS, check_every: int = 1, **kwargs: Any
    ) -> None:
        if not isinstance(self, transformers.Trainer):
            raise TypeError("ExactResumeMixin goes before transformers.Trainer in the bases")
        internals.check_version()
        internals.install_skip(lambda loader: isinstance(loader, TrainLoader), TrainLoader.skip)
        super().__init__(*args, **kwargs)  # the TrainingArguments have made the group by now
        refuse_unrestartable_group(
            "transformers' TrainingArguments (through Accelerate's PartialState)",
            "before building the TrainingArguments; they then use that group",
        )
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
            ``UNBROKEN_HF_UNTESTED=1`` to be warned instead); or, under ``torchrun
            --max-restarts``, the process group was not made by
            ``unbroken.distributed.init_process_group``: a restart could not start it again.
    """
