"""``ExactResumeCallback``: the ``transformers.Trainer`` side of exact resume, which
``ExactResumeMixin`` adds (``hf.trainer`` says what it changes and why).

It finds and checks the checkpoint a resume loads (the newest sealed one), reads this rank's
state from it and removes the newer folders (a damaged one is moved aside: ``aside``); restores
the training loader's position and the logged loss when training starts; agrees with the other ranks on a preemption signal every
``check_every`` optimizer steps; moves a save that lands on an epoch's last step after the
epoch's end; writes each rank's state beside transformers' files, seals the folder and keeps
``save_total_limit`` sealed ones. Cost per save: one small JSON file per rank, a seal (a read,
sha256 and fsync of every file of the folder) and two barriers.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback

from .._files import atomic_write
from ..data.loader import DataLoader
from ..distributed.reduction import ensure_exact
from ..errors import CorruptCheckpoint, StateMismatch
from ..preemption import EXIT_CODE, Preemption, exit_to_be_requeued
from ..train.agreement import Agreement
from ..train.progress import say
from . import internals
from .aside import judged, put_aside
from .loader import TrainLoader
from .seal import Verdict, check, checkpoints, prune, resume_point, seal
from .state import FORMAT, VERSION, state_file

_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR


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
        skipped: list[Verdict] = []  # the newer folders judged on the way
        if resume is True:
            path, skipped = resume_point(args.output_dir, _PREFIX)
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
        self._remove_newer(path, skipped)
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

    def _remove_newer(self, path: str, skipped: list[Verdict]) -> None:
        """Checkpoints newer than the resumed one belong to a run that is being redone: a
        damaged one is moved aside, never deleted; the others are removed (``aside``)."""
        args = self.trainer.args
        if args.should_save:  # process 0, or each node's first with save_on_each_node
            resumed = os.path.realpath(path)
            verdicts = judged(skipped)
            for _, folder in checkpoints(args.output_dir, _PREFIX):
                if os.path.realpath(folder) == resumed:
                    break
                put_aside(args.output_dir, folder, verdicts.get(os.path.realpath(folder)))
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
        for folder in prune(  # a damaged folder is moved aside, never deleted
            os.path.dirname(newest), self._keep, step, _PREFIX, spare
        ):
            say(f"removing {folder} (save_total_limit={self._keep})")
