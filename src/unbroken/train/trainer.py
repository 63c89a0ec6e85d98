"""``Trainer``: a small training loop that a kill at any instant cannot change the result of.

Everything that decides the next step is in the checkpoint (``checkpointing`` lists it). The
same command, started again, resumes from the newest valid checkpoint, bit for bit. The loop:
lock the run directory, restore or seed; each epoch, a training then a validation phase; after
every batch, a preemption signal saves and exits with ``EXIT_CODE``, or a periodic save is due.
Loss values reach the host only on logged batches (``LossSum``), so there is no sync per batch.
Under ``torchrun`` every rank runs this loop with a DDP model; the ranks agree on signals and
saves (``agreement``), rank 0 alone writes the logs, and when a rank dies (or hangs:
``watchdog``) a survivor saves the job as of the last completed step (``jit``). Each step's
RNGs derive from (seed, phase, epoch, step, rank). ``max_steps`` and
``checkpoint_every_steps`` count optimizer steps; the log's ``step`` counts batches of its
phase; checkpoints are numbered by batches seen, both phases.
At INFO, rank 0 says where the run starts and, at the end, how it ended (``ending``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
from typing_extensions import Unpack

from ..checkpoint.manager import Checkpointer
from ..distributed.process_group import refuse_unrestartable_group
from ..distributed.reduction import ExactReduction, ensure_exact, reduction_of
from ..errors import RemoteUnavailable
from ..preemption import EXIT_CODE, Preemption, exit_to_be_requeued
from .agreement import Agreement, Boundary, Carrier, exit_if_preempted
from .checkpointing import checkpoint_entries, compute_metrics, reset_metrics, resume
from .csvlog import RunLog
from .determinism import determinism
from .ending import NOTHING_TO_TRAIN, close, summary
from .globalrng import TRAIN, VAL, seed_everything, seed_step
from .jit import JustInTime
from .options import NAMES, TrainerKeywords, TrainerOptions, options_of
from .progress import Progress, Startup, bar, say
from .rundir import RunDirectory
from .schedule import SaveSchedule
from .steps import (
    StepFn,
    call_hooks,
    check_loaders,
    hooks,
    optimizer_step,
    ready_scaler,
    step_function,
    step_loss,
    step_values,
)
from .watchdog import Watchdog


class Trainer:
    """A training loop that resumes bit for bit: ``Trainer("runs/exp1", max_epochs=3).fit(...)``.

    Args:
        directory: The run directory, where one process at a time trains: a path or a URL.
        options: All the options as one ``TrainerOptions``, instead of keywords.
        storage_options: The fsspec options of a URL's filesystem (endpoint, credentials).
        **keywords: The options by name: ``TrainerOptions``' fields, each documented there.
            ``trainer.options`` holds them; ``trainer.max_epochs`` etc. read them.

    Raises:
        TypeError: a keyword is not an option (the closest option is named).
        ValueError: an option is invalid, or given both as a keyword and in ``options``.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        options: TrainerOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        **keywords: Unpack[TrainerKeywords],
    ) -> None:
        self.startup = Startup()  # first: the time to the first step, by phase
        # The options, checked (train.options), before anything is made, installed or locked.
        self.options = options_of(keywords, options)
        self.run = RunDirectory(directory, storage_options)
        self.directory: str | Path = self.run.location if self.run.remote else Path(directory)
        config = self.options.on_resume()  # saved with the loop's counters, checked on resume
        self.progress = Progress(config=config)
        self.logs: dict[str, float] = {}  # the latest value of everything logged
        self._on_optimizer_step: tuple = ()  # the callbacks' hooks, looked up as fit starts
        # Handled from now on: a signal before training ends the run with EXIT_CODE.
        self.preemption = Preemption(self.options.signals).install()

    def __getattr__(self, name: str) -> Any:
        # Only for names not found otherwise: the options, read as the Trainer's attributes.
        options = self.__dict__.get("options")
        if options is not None and name in NAMES:
            return getattr(options, name)
        raise AttributeError(f"'Trainer' object has no attribute {name!r}")

    def fit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: Iterable,
        val_loader: Iterable | None = None,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        training_step: StepFn | None = None,
        validation_step: StepFn | None = None,
        train_metrics: dict[str, Any] | None = None,
        val_metrics: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """Train, resuming from the newest checkpoint in ``directory`` if any.

        Args:
            model: The model (DDP-wrapped under ``torchrun``).
            optimizer: Its optimizer.
            train_loader: The training batches, an ``unbroken.DataLoader`` or any resumable.
            val_loader: The validation batches, or ``None``.
            scheduler: A learning-rate scheduler, or ``None``.
            scaler: A ``torch.amp.GradScaler``, or ``None``.
            training_step: ``(model, batch)`` returning the loss, or a dict with ``"loss"`` and
                other scalars to log; by default ``model.training_step(batch)``.
            validation_step: Likewise, without gradients.
            train_metrics: Torchmetrics your steps update: reset, checkpointed, ``compute()``d.
            val_metrics: The same, for validation.

        Returns:
            The logs: the latest value of each logged name.

        Raises:
            RuntimeError: under ``torchrun --max-restarts``, the process group was made by
                torch's own ``init_process_group``, which a restart could not start again;
                the message names ``unbroken.distributed.init_process_group``, which can.
        """
        self.startup.mark("your code from Trainer() to fit()")
        try:
            self.model, self.optimizer = model, optimizer
            self.scheduler, self.scaler = scheduler, scaler
            self.training_step = training_step or step_function(model, "training_step")
            self.validation_step = validation_step or (
                step_function(model, "validation_step") if val_loader is not None else None
            )
            self.train_metrics = dict(train_metrics or {})
            self.val_metrics = dict(val_metrics or {})
            check_loaders(train_loader, val_loader)
            refuse_unrestartable_group(
                "your script", "instead of torch.distributed.init_process_group"
            )
            self.agreement = Agreement()  # this rank's World, and what the ranks agree on
            self.world = self.agreement.world
            self.show_bar = self.options.progress_bar and self.world.first  # on one rank
            # DDP: gradients summed in an order its bucket rebuild cannot change (3+ ranks),
            # and a reduction the ranks' per-batch agreement rides on (2+ ranks).
            ensure_exact(model, "unbroken.Trainer", Carrier.width(self.world.size))
            self._reduction = self._own_reduction(model)
            self._loss_divisor = self._divisor()
            with self.preemption, determinism(self.options.deterministic, model):
                exit_if_preempted(self.agreement, self.preemption)
                self.run.open(self.options.remote_timeout)
                try:
                    with self.run.locked(self.agreement, self.options.lease_seconds):
                        ending = self._fit(train_loader, val_loader)
                finally:
                    self.run.close()
        finally:
            self.preemption.uninstall()  # also when fit() raised before its `with`
            if "jit" in self.__dict__:  # a survivor that saved for the job obeys torchrun now
                self.jit.obey(self.preemption.received)
        if ending:  # once the lock is released
            say(ending)
        call_hooks(self.options.callbacks, "on_fit_end", self)
        return self.logs

    def _fit(self, train_loader: Iterable, val_loader: Iterable | None) -> str:
        self.startup.mark("run directory and its lock")
        self.run_log = RunLog(
            self.run,
            self.options.tensorboard,
            self.logs,
            write=self.world.first,  # one rank writes the log; the others keep `logs` only
        )
        self.checkpointer = Checkpointer(
            self.run.checkpoints,
            storage=self.run.storage,
            keep=self.options.keep,
            timeout=self.options.checkpoint_timeout,
        )
        self.entries = checkpoint_entries(
            progress=self.progress,
            model=self.model,
            optimizer=self.optimizer,
            train_loader=train_loader,
            val_loader=val_loader,
            scheduler=self.scheduler,
            scaler=self.scaler,
            log=self.run_log.csv,
            callbacks=self.options.callbacks,
            metrics={"train": self.train_metrics, "val": self.val_metrics},
        )
        progress = self.progress
        try:
            seed = self.options.seed
            restored = resume(self.checkpointer, self.entries, val_loader, seed, self._done)
            self.resumed = restored is not None
            self.startup.resumed(restored.seconds if restored else {})
            rerun = restored is not None and self._done()  # nothing trains, nothing is saved
            if rerun:
                say(f"already complete: {summary(*self._ended())}; {NOTHING_TO_TRAIN}")
            exit_if_preempted(self.agreement, self.preemption)
            if restored is None:
                self.run_log.restart()
                seed_everything(self.options.seed)
            else:
                ready_scaler(self.scaler, self.optimizer)  # a resumed run's pending window
            # Events up to the checkpoint's tick were flushed when it was saved; later ones replay.
            self.run_log.open_board(purge_from=progress.ticks + 1)
            run, checkpointer, agreement = self.run, self.checkpointer, self.agreement
            self.schedule = SaveSchedule.of_run(self.options, run, checkpointer, self.world)
            wanted, every = self.options.just_in_time, self.options.preemption_check_every
            self.jit = JustInTime(
                wanted, agreement, progress, self.entries, checkpointer, run, self.run_log, every
            )
            # Without the Trainer's own reduction (no DDP, the user's exact_reduce): gathered.
            carrier = None
            if self._reduction is not None:
                carrier = Carrier(self._reduction, self.world, agreement.device)
            self.boundary = Boundary(
                agreement, self.preemption, self.schedule, self.jit, every, carrier
            )
            self._on_optimizer_step = hooks(self.options.callbacks, "on_optimizer_step")
            call_hooks(self.options.callbacks, "on_fit_start", self)
            # A hung peer: this rank's own thread saves the last step (train.watchdog).
            watchdog = (
                None if rerun else Watchdog.start(self.jit, progress, self.options.hang_timeout)
            )
            try:
                if not rerun:
                    self._epochs(train_loader, val_loader)
            except Exception as error:
                if watchdog is not None:
                    watchdog.stop()  # one failure path at a time: the loop's, from here
                self.jit.on_failure(error)  # a rank died: a survivor saves the last step
                raise
            finally:
                if watchdog is not None:
                    watchdog.stop()
            self.schedule.history.end("finished")
        except BaseException as error:
            close(self.checkpointer, self.run_log, error)  # never in the place of `error`
            raise
        close(self.checkpointer, self.run_log, None)
        return "" if rerun else f"finished: {summary(*self._ended())}"  # the last line

    def _epochs(self, train_loader: Iterable, val_loader: Iterable | None) -> None:
        progress, jit = self.progress, self.jit
        jit.take()
        while not self._done():
            if progress.phase == "train":
                self._train_epoch(train_loader)
                progress.phase = "val" if val_loader is not None else "end"
                jit.take()
            if progress.phase == "val" and val_loader is not None:
                self._validate(val_loader)
                progress.phase = "end"
                jit.take()
            call_hooks(self.options.callbacks, "on_epoch_end", self, self.logs)
            progress.next_epoch()
            jit.take()
        progress.saved_at = -1  # a save at this tick came before the end: the end is saved too
        self._save()

    def _train_epoch(self, loader: Iterable) -> None:
        progress, model, log_every = self.progress, self.model, self.options.log_every
        seed, rank, jit = self.options.seed, self.world.rank, self.jit
        model.train()
        if progress.epoch_batches == 0:
            reset_metrics(self.train_metrics)
            progress.start_phase()
            jit.phase_started()
        on_batch_end = hooks(self.options.callbacks, "on_train_batch_end")  # once, not per batch
        with bar(self.show_bar, loader, progress, "train") as batches:
            for batch in batches:
                self.startup.first_batch()
                if progress.micro == 0:  # a step's randomness: derived, never saved (globalrng)
                    seed_step(seed, TRAIN, progress.epoch, progress.steps, rank)
                output = self.training_step(model, batch)
                loss = step_loss(output)
                # Dividing by 1 would add a no-op node to the graph: skip it.
                scaled = loss / self._loss_divisor if self._loss_divisor > 1 else loss
                self.boundary.send(loss, progress.ticks)  # rides on the backward's reduction
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                progress.batch_done(loss)  # adds the loss to the epoch's sum, without a sync
                self.boundary.agree(loss)  # what the ranks know, agreed before the step
                if progress.micro == self.options.accumulate:
                    self._optimizer_step()
                # The one place a batch's values reach the host (a GPU sync): logged ones only.
                if progress.batches % log_every == 0:
                    self._log(step_values(output), "train", carried=True)
                    batches.show(self.logs["train/loss"])
                for hook in on_batch_end:
                    hook(self, self.logs)
                if progress.micro == 0:
                    jit.take()
                if self._max_steps_reached():
                    break
                self._after_batch()
        if progress.micro:  # an epoch's last, incomplete accumulation window still counts
            self._optimizer_step()
            jit.take()
        epoch_loss = self.agreement.mean(progress.phase_mean())
        self.log({"epoch_loss": epoch_loss, **compute_metrics(self.train_metrics)})
        if self.scheduler is not None and self.options.scheduler_interval == "epoch":
            jit.changing()
            self.scheduler.step()

    def _own_reduction(self, model: torch.nn.Module) -> ExactReduction | None:
        """The reduction ``ensure_exact`` registered for the Trainer (carrying its row): the
        agreement rides on it, and it may leave the division to the loss (``_divisor``). None
        without DDP, or on the user's own ``exact_reduce``, which carries nothing and divides."""
        reduction = reduction_of(model)
        if reduction is None or reduction.carry_bytes != Carrier.width(self.world.size):
            return None
        return reduction

    def _divisor(self) -> int:
        """What a batch's loss is divided by before its backward: the accumulation window's
        length; or, on the Trainer's own DDP reduction without accumulation, the world size.
        That reduction then only sums (``ExactReduction.predivided``): DDP's mean with no pass
        over the gradients to divide them. Accumulated gradients are summed again by each
        backward's reduction, so that hook divides them itself."""
        accumulate, reduction = self.options.accumulate, self._reduction
        if reduction is None:
            return accumulate
        reduction.predivided = accumulate == 1
        return self.world.size if reduction.predivided else accumulate

    def _optimizer_step(self) -> None:
        self.jit.changing()
        per_step = self.scheduler if self.options.scheduler_interval == "step" else None
        optimizer_step(
            self.model,
            self.optimizer,
            scaler=self.scaler,
            scheduler=per_step,
            clip_grad_norm=self.options.clip_grad_norm,
        )
        self.progress.optimizer_step_done()
        for hook in self._on_optimizer_step:
            hook(self)

    @torch.no_grad()
    def _validate(self, loader: Iterable) -> None:
        progress, model, step = self.progress, self.model, self.validation_step
        seed, rank, log_every = self.options.seed, self.world.rank, self.options.log_every
        assert step is not None  # fit() sets one whenever there is a val_loader
        model.eval()
        if progress.val_batches == 0:
            reset_metrics(self.val_metrics)
            progress.start_phase()
            self.jit.phase_started()
        call_hooks(self.options.callbacks, "on_validation_start", self)
        on_batch_end = hooks(self.options.callbacks, "on_validation_batch_end")
        with bar(self.show_bar, loader, progress, "val") as batches:
            for batch in batches:
                self.startup.first_batch()
                seed_step(seed, VAL, progress.epoch, progress.val_batches, rank)
                output = step(model, batch)
                loss = step_loss(output)
                progress.val_batch_done(loss)
                self.boundary.agree(loss)
                if progress.val_batches % log_every == 0:  # as in training: the one host read
                    self._log(step_values(output), "val", carried=True)
                    batches.show(self.logs["val/loss"])
                for hook in on_batch_end:
                    hook(self, self.logs)
                self.jit.take()
                self._after_batch()
        epoch_loss = self.agreement.mean(progress.phase_mean())
        self.log({"epoch_loss": epoch_loss, **compute_metrics(self.val_metrics)}, "val")
        call_hooks(self.options.callbacks, "on_validation_end", self, self.logs)
        model.train()

    def _after_batch(self) -> None:
        """A step boundary: save if a preemption signal came (then exit) or if it is time."""
        self.startup.first_step(self.resumed)
        preempted, time_due = self.boundary.decide(self.progress.ticks)
        if preempted:
            self._save(blocking=True)
            self._exit_preempted()
        if time_due or self.schedule.by_steps(self.progress):
            self._save(blocking=not self.options.async_save, periodic=True)

    def _save(self, blocking: bool = True, periodic: bool = False) -> None:
        """Checkpoint the loop where it is, unless it is saved there already: every checkpoint
        the loop takes (periodic, at a preemption, at the end)."""
        # It waits for the background save before it, skips a place already saved
        # (progress.saved_at: a committed checkpoint's; a background save counts once that wait
        # returned) and times what it holds training for (schedule). A periodic save that
        # cannot reach object storage (RemoteUnavailable: after its retries, or a store that
        # did not answer within remote_timeout) does not stop training: it is reported and the
        # next one tries again; so does a background save (always periodic) before any save.
        # One process only: under torch.distributed the ranks raise together (the job restarts).
        tolerate = periodic and not self.world.distributed
        started = time.perf_counter()  # what the save holds training for: the wait included
        checkpointer, progress = self.checkpointer, self.progress
        background = checkpointer.background_step
        try:
            checkpointer.wait()  # the background save before it: it may have failed
        except RemoteUnavailable as error:
            if self.world.distributed:
                raise
            say(f"the background checkpoint failed ({error}); training goes on")
        else:
            if background is not None:
                progress.saved_at = background  # committed: every rank knows it now
        if progress.ticks == progress.saved_at:
            return  # nothing happened since the last committed checkpoint
        self.schedule.saved()
        call_hooks(self.options.callbacks, "on_save_start", self)
        try:
            self.run_log.flush_board()
            checkpointer.save(progress.ticks, self.entries, blocking=blocking)
        except RemoteUnavailable as error:
            if not tolerate:
                raise
            say(f"checkpoint at {progress.where()} failed ({error}); training goes on")
            return
        if blocking:  # a background save counts once committed: at the next wait (above)
            progress.saved_at = progress.ticks
        self.schedule.measured(time.perf_counter() - started)

    def _exit_preempted(self) -> NoReturn:
        """After the preemption checkpoint: say when the signal came, ignore the signals from
        then on, and exit with ``EXIT_CODE`` to be requeued."""
        progress, received = self.progress, self.preemption.received
        seconds = self.preemption.seconds_since_signal()
        heard = (
            f"{received.name} received; checkpoint at {progress.where()} committed "
            f"{seconds:.3f} s after the signal"
            if received is not None
            else f"a preemption signal reached another rank; checkpoint at {progress.where()} "
            "committed"
        )
        self.preemption.ignore_until_exit()  # saved: nothing may kill it with -15 now
        self.schedule.history.end("preempted")
        say(f"{heard}; exiting with {EXIT_CODE} to be requeued")
        call_hooks(self.options.callbacks, "on_preempted", self, seconds)
        exit_to_be_requeued()

    def _ended(self) -> tuple[Progress, int | None, str]:
        return self.progress, self.options.max_steps, self.checkpointer.directory

    def _max_steps_reached(self) -> bool:
        return self.options.max_steps is not None and self.progress.steps >= self.options.max_steps

    def _done(self) -> bool:  # nothing left to train: max_epochs or max_steps reached
        return self.progress.epoch >= self.options.max_epochs or self._max_steps_reached()

    def log(self, values: Mapping[str, Any], phase: str = "train") -> None:
        """Log scalars at the current step of ``phase`` (for callbacks): CSV, TensorBoard, logs.

        Args:
            values: Names mapped to numbers or one-element tensors (read on the host: a sync).
            phase: ``"train"`` or ``"val"``.
        """
        self._log(values, phase)

    def _log(self, values: Mapping[str, Any], phase: str, carried: bool = False) -> None:
        """``log``; ``carried``: a batch's own values, whose loss the ranks' agreement carried
        (rank 0 writes them at once, before the callbacks: ``RunLog.log``, ``train.jit``)."""
        progress = self.progress
        step = progress.batches if phase == "train" else progress.val_batches
        self.run_log.log(values, phase, step, progress.epoch, progress.ticks, carried)
