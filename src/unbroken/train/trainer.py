"""``Trainer``: a small training loop that a kill at any instant cannot change the result of.

Everything that decides the next step is in the checkpoint: the model, optimizer, scheduler,
gradient scaler, the gradients of an unfinished accumulation window, the loaders' positions,
the process's RNGs, the loop's counters, torchmetrics states, callbacks with ``state_dict`` and
the CSV log's length. Starting the same command again loads the newest valid checkpoint and
continues; the finished run's weights and logged values are bit for bit those of a run that was
never interrupted.

The loop, top to bottom: lock the run directory, restore or seed; for each epoch a training
phase (forward, backward, every ``accumulate`` batches clip and step), then a validation phase;
after every batch, check for a preemption signal (save, exit with ``EXIT_CODE``) or a periodic
checkpoint (every ``checkpoint_every_seconds`` of wall-clock time, by default 10 minutes, and
every ``checkpoint_every_steps`` optimizer steps). A checkpoint can be taken inside either phase
and resumes there.

Units: ``max_steps`` and ``checkpoint_every_steps`` count optimizer steps (with
``accumulate=k``, one step per k training batches), as Lightning's ``max_steps`` and
``every_n_train_steps`` do. The log's ``step`` column counts batches of its phase. Checkpoint
directories are numbered by batches seen, training plus validation, the one counter that grows
at every place a checkpoint can be taken.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .determinism import determinism
from .lock import DirectoryLock
from .._state import has_state
from ..checkpoint.manager import Checkpointer
from .csvlog import CSVLog, open_tensorboard
from .globalrng import GlobalRNG
from .preemption import DEFAULT_SIGNALS, EXIT_CODE, Preemption
from .progress import Progress, bar

StepFn = Callable[[torch.nn.Module, Any], Any]
_clock = time.monotonic  # wall-clock checkpoints; a name of its own so tests can move time


class Trainer:
    """A training loop that resumes bit for bit: ``Trainer("runs/exp1", max_epochs=3).fit(...)``.

    Arguments (all keyword-only except ``directory``):

    - ``directory``: the run directory: ``checkpoints/``, ``metrics.csv``, ``tensorboard/``.
      One process at a time may train in it (an OS lock, released when the process ends).
    - ``max_epochs``: epochs to train. ``max_steps``: stop after this many optimizer steps.
      Both may change between a run and its resume.
    - ``seed``: seeds the process RNGs of a fresh run (model init happens before ``fit``, so
      seed that yourself). Recorded in checkpoints; must match on resume.
    - ``checkpoint_every_seconds``: save when this much wall-clock time passed since the last
      save, at the next batch boundary (default 600: a crash loses at most ~10 minutes);
      ``None`` turns it off. ``checkpoint_every_steps``: also save every this many optimizer
      steps (default ``None``). A preemption signal and the end of training always save.
    - ``keep``: committed checkpoints kept (>= 2). ``async_save``: write periodic checkpoints
      in a background thread (preemption and final saves block).
    - ``accumulate``: training batches per optimizer step. ``clip_grad_norm``: max gradient
      norm, or ``None``. ``scheduler_interval``: ``"step"`` or ``"epoch"``. All three shape
      the computation, are recorded and must match on resume.
    - ``callbacks``: objects with any of ``on_fit_start``, ``on_train_batch_end``,
      ``on_validation_batch_end``, ``on_epoch_end``, ``on_save_start``, ``on_preempted``,
      ``on_fit_end``; those with ``state_dict``/``load_state_dict`` are checkpointed.
    - ``progress_bar``: a tqdm bar. ``tensorboard``: ``None`` writes TensorBoard events if it
      is installed, ``True`` requires it, ``False`` never; ``tensorboard_every``: per-batch
      values go to TensorBoard every this many batches (the CSV log gets every one).
    - ``signals``: the preemption signals (default SIGTERM, SIGUSR1). They are handled from
      the moment the Trainer is built until ``fit`` returns; one that comes before training
      starts ends ``fit`` with ``EXIT_CODE`` and saves nothing (nothing new was trained).
    - ``deterministic``: ``True`` turns on deterministic kernels during ``fit`` (needed for
      bit-exact resume on CUDA; the README's "Exactness on a GPU"); ``None`` (default) changes
      nothing and says so once if the model is on CUDA; ``False`` changes nothing.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_epochs: int,
        max_steps: int | None = None,
        seed: int = 0,
        checkpoint_every_seconds: float | None = 600.0,
        checkpoint_every_steps: int | None = None,
        keep: int = 2,
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        scheduler_interval: str = "step",
        callbacks: Iterable[Any] = (),
        progress_bar: bool = True,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        async_save: bool = False,
        tensorboard: bool | None = None,
        tensorboard_every: int = 50,
        deterministic: bool | None = None,
    ) -> None:
        _positive("max_epochs", max_epochs)
        for name, value in (("max_steps", max_steps),
                            ("checkpoint_every_steps", checkpoint_every_steps)):
            if value is not None:
                _positive(name, value)
        if checkpoint_every_seconds is not None and (
                isinstance(checkpoint_every_seconds, bool)
                or not isinstance(checkpoint_every_seconds, (int, float))
                or not checkpoint_every_seconds > 0):
            raise ValueError("checkpoint_every_seconds must be a number > 0 or None, got "
                             f"{checkpoint_every_seconds!r}")
        if deterministic not in (None, True, False):
            raise ValueError(f"deterministic must be True, False or None, got {deterministic!r}")
        _positive("accumulate", accumulate)
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
        self.directory = Path(directory)
        self.max_epochs, self.max_steps = max_epochs, max_steps
        self.checkpoint_every_seconds = checkpoint_every_seconds
        self.checkpoint_every_steps = checkpoint_every_steps
        self.keep, self.async_save, self.deterministic = keep, async_save, deterministic
        self.accumulate, self.clip_grad_norm = accumulate, clip_grad_norm
        self.scheduler_interval = scheduler_interval
        self.callbacks = list(callbacks)
        self.progress_bar, self.signals = progress_bar, tuple(signals)
        self.progress = Progress(config={
            "seed": seed, "accumulate": accumulate, "clip_grad_norm": clip_grad_norm,
            "scheduler_interval": scheduler_interval,
        })
        self.seed = seed
        self.tensorboard = tensorboard  # None: write TensorBoard events if it is installed
        # TensorBoard's writer costs ~40 us a value without TensorFlow (a pure-Python CRC), so
        # per-batch values go there every `tensorboard_every` batches; the CSV gets every one.
        _positive("tensorboard_every", tensorboard_every)
        self.tensorboard_every = tensorboard_every
        self.board = None
        self.logs: dict[str, float] = {}  # the latest value of everything logged
        # Handled from now on, so a signal while the model is built or a checkpoint is read
        # ends the run with EXIT_CODE (to be requeued) instead of killing it.
        self.preemption = Preemption(self.signals).install()

    # -- the loop ---------------------------------------------------------------------------

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
        """Train (resuming from the newest checkpoint in ``directory`` if any); return the logs.

        ``training_step(model, batch)`` returns the loss, or a dict with ``"loss"`` and other
        scalars to log; by default ``model.training_step(batch)``. ``validation_step`` likewise
        returns a loss or a dict (no gradients). ``train_metrics``/``val_metrics`` are
        torchmetrics metrics your steps update: the Trainer resets them when a phase starts,
        saves their accumulated state in checkpoints and logs ``compute()`` when it ends.
        """
        try:
            self._setup(model, optimizer, train_loader, val_loader, scheduler, scaler,
                        training_step, validation_step, train_metrics, val_metrics)
            with self.preemption, determinism(self.deterministic, model):
                self._exit_if_preempted_before_training()
                self.directory.mkdir(parents=True, exist_ok=True)
                with DirectoryLock(self.directory):
                    self._fit(train_loader, val_loader)
        finally:
            self.preemption.uninstall()  # also when fit() raised before its `with`
        self._call("on_fit_end")
        return self.logs

    def _setup(self, model, optimizer, train_loader, val_loader, scheduler, scaler,
               training_step, validation_step, train_metrics, val_metrics) -> None:
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.training_step = training_step or _method(model, "training_step")
        self.validation_step = validation_step or (
            _method(model, "validation_step") if val_loader is not None else None)
        self.train_metrics, self.val_metrics = dict(train_metrics or {}), dict(val_metrics or {})
        for loader, name in ((train_loader, "train_loader"), (val_loader, "val_loader")):
            if loader is not None and not has_state(loader):
                raise TypeError(
                    f"{name} has no state_dict(), so its position cannot be saved and a resume "
                    "would restart its epoch; use unbroken.DataLoader (or any loader with "
                    "state_dict/load_state_dict)"
                )

    def _fit(self, train_loader: Iterable, val_loader: Iterable | None) -> None:
        self.log_file = CSVLog(self.directory / "metrics.csv")
        self.checkpointer = Checkpointer(self.directory / "checkpoints", keep=self.keep)
        self.entries = self._entries(train_loader, val_loader)
        progress = self.progress
        try:
            restored = self.checkpointer.load_latest(self.entries)
            _say(self._resumed(restored))
            self._exit_if_preempted_before_training()
            if restored is None:
                self.log_file.restart()
                _seed_everything(self.seed)
            # Events up to the checkpoint's tick were flushed before it was saved; later ones replay.
            self.board = open_tensorboard(self.tensorboard, self.directory / "tensorboard",
                                          purge_from=progress.ticks + 1)
            self._last_save = _clock()
            self._call("on_fit_start")
            while progress.epoch < self.max_epochs and not self._max_steps_reached():
                if progress.phase == "train":
                    self._train_epoch(train_loader)
                    progress.phase = "val" if val_loader is not None else "end"
                if progress.phase == "val":
                    self._validate(val_loader)
                    progress.phase = "end"
                self._call("on_epoch_end", self.logs)
                progress.next_epoch()
            self._save()
        finally:
            self.checkpointer.close()
            self.log_file.close()
            if self.board is not None:
                self.board.close()

    def _train_epoch(self, loader: Iterable) -> None:
        progress, model = self.progress, self.model
        model.train()
        if progress.epoch_batches == 0:
            _reset(self.train_metrics)
            progress.start_phase()
        with bar(self.progress_bar, loader, progress, "train") as batches:
            for batch in batches:
                loss, logs = _loss_and_logs(self.training_step(model, batch))
                scaled = loss / self.accumulate if self.accumulate > 1 else loss  # skip a no-op node
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                progress.batch_done(loss.item())
                if progress.micro == self.accumulate:
                    self._optimizer_step()
                self._log("train", {"loss": loss.item(), **logs})
                batches.show(loss.item())
                self._call("on_train_batch_end", self.logs)
                if self._max_steps_reached():
                    break
                self._after_batch()
        if progress.micro:  # an epoch's last, incomplete accumulation window still counts
            self._optimizer_step()
        self._log("train", {"epoch_loss": progress.phase_mean(), **_compute(self.train_metrics)},
                  per_batch=False)
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            self.scheduler.step()

    def _optimizer_step(self) -> None:
        optimizer, scaler = self.optimizer, self.scaler
        if self.clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        self.progress.optimizer_step_done()

    @torch.no_grad()
    def _validate(self, loader: Iterable) -> None:
        progress, model = self.progress, self.model
        model.eval()
        if progress.val_batches == 0:
            _reset(self.val_metrics)
            progress.start_phase()
        with bar(self.progress_bar, loader, progress, "val") as batches:
            for batch in batches:
                loss, logs = _loss_and_logs(self.validation_step(model, batch))
                progress.val_batch_done(loss.item())
                self._log("val", {"loss": loss.item(), **logs})
                batches.show(loss.item())
                self._call("on_validation_batch_end", self.logs)
                self._after_batch()
        self._log("val", {"epoch_loss": progress.phase_mean(), **_compute(self.val_metrics)},
                  per_batch=False)
        model.train()

    def _after_batch(self) -> None:
        """A step boundary: save if a preemption signal came (then exit) or if it is time."""
        progress = self.progress
        if self.preemption.requested:
            self._save(blocking=True)
            seconds = self.preemption.seconds_since_signal()
            _say(f"{self.preemption.received.name} received; checkpoint at epoch "
                 f"{progress.epoch}, {progress.phase} batch {self._phase_batch()}, optimizer step "
                 f"{progress.steps} committed {seconds:.3f} s after the signal; exiting with "
                 f"{EXIT_CODE} to be requeued")
            self._call("on_preempted", seconds)
            raise SystemExit(EXIT_CODE)
        every_steps, every_seconds = self.checkpoint_every_steps, self.checkpoint_every_seconds
        if (every_steps and progress.phase == "train" and progress.micro == 0
                and progress.steps % every_steps == 0) or (
                every_seconds and _clock() - self._last_save >= every_seconds):
            self._save(blocking=not self.async_save)

    def _exit_if_preempted_before_training(self) -> None:
        if self.preemption.requested:
            _say(f"{self.preemption.received.name} received before training started: nothing new "
                 f"to save; exiting with {EXIT_CODE} to be requeued")
            raise SystemExit(EXIT_CODE)

    def _phase_batch(self) -> int:
        progress = self.progress
        return progress.val_batches if progress.phase == "val" else progress.epoch_batches

    def _resumed(self, restored: Any) -> str:
        """The line that says where this process starts."""
        if restored is None:
            return f"no checkpoint in {self.checkpointer.directory}: starting fresh"
        progress = self.progress
        if progress.phase == "end":
            where = f"the end of epoch {progress.epoch}, optimizer step {progress.steps}"
        else:
            where = (f"epoch {progress.epoch}, {progress.phase} batch {self._phase_batch()}, "
                     f"optimizer step {progress.steps}")
        return f"resumed from checkpoint {restored.path} ({where})"

    def _save(self, blocking: bool = True) -> None:
        if self.progress.ticks == self.progress.saved_at:
            return  # nothing happened since the last checkpoint
        self.progress.saved_at = self.progress.ticks
        self._last_save = _clock()
        if self.board is not None:
            self.board.flush()  # what the checkpoint says was logged must be on disk
        self._call("on_save_start")
        self.checkpointer.save(self.progress.ticks, self.entries, blocking=blocking)

    def _max_steps_reached(self) -> bool:
        return self.max_steps is not None and self.progress.steps >= self.max_steps

    # -- plumbing ---------------------------------------------------------------------------

    def _entries(self, train_loader, val_loader) -> dict[str, Any]:
        """Everything a checkpoint holds, by name."""
        entries: dict[str, Any] = {
            "progress": self.progress,
            "model": self.model,
            "gradients": _Gradients(self.model),
            "optimizer": self.optimizer,
            "train_loader": train_loader,
            "rng": GlobalRNG(),
            "log": self.log_file,
        }
        optional = {"val_loader": val_loader, "scheduler": self.scheduler, "scaler": self.scaler}
        entries.update({name: obj for name, obj in optional.items() if obj is not None})
        for phase, metrics in (("train", self.train_metrics), ("val", self.val_metrics)):
            for name, metric in metrics.items():
                entries[f"metric.{phase}.{name}"] = _MetricState(metric)
        for i, callback in enumerate(self.callbacks):
            if has_state(callback):
                entries[f"callback.{i}.{type(callback).__name__}"] = callback
        return entries

    def log(self, values: dict[str, float], phase: str = "train") -> None:
        """Log scalars at the current step (for callbacks): CSV, TensorBoard, ``logs``."""
        self._log(phase, values, per_batch=False)

    def _log(self, phase: str, values: dict[str, float], per_batch: bool = True) -> None:
        progress = self.progress
        step = progress.batches if phase == "train" else progress.val_batches
        board = self.board if not per_batch or step % self.tensorboard_every == 0 else None
        for name, value in values.items():
            self.log_file.log(step, progress.epoch, phase, name, value)
            self.logs[f"{phase}/{name}"] = float(value)
            if board is not None:
                board.add_scalar(f"{phase}/{name}", float(value), global_step=progress.ticks)

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if callable(method):
                method(self, *args)


class _Gradients:
    """The ``.grad`` of every parameter: non-empty only inside an accumulation window."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return {name: (None if p.grad is None else p.grad.detach().clone())
                for name, p in self.model.named_parameters()}

    def load_state_dict(self, state: dict) -> None:
        for name, p in self.model.named_parameters():
            grad = state.get(name)
            p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype)


class _MetricState:
    """A torchmetrics metric's accumulated state, so epoch-end reductions survive a resume."""

    def __init__(self, metric: Any) -> None:
        metric.persistent(True)  # torchmetrics leaves metric states out of state_dict by default
        self.metric = metric

    def state_dict(self) -> dict:
        return {"states": self.metric.state_dict(), "updates": self.metric.update_count}

    def load_state_dict(self, state: dict) -> None:
        self.metric.load_state_dict(state["states"])
        # torchmetrics has no public setter for its update count; it only gates the "compute
        # before update" warning and distributed mean reduction, and must match the saved run.
        self.metric._update_count = state["updates"]


def _loss_and_logs(output: Any) -> tuple[torch.Tensor, dict[str, float]]:
    if isinstance(output, torch.Tensor):
        return output, {}
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        logs = {k: float(v.detach() if isinstance(v, torch.Tensor) else v)
                for k, v in output.items() if k != "loss"}
        return output["loss"], logs
    raise TypeError(
        "a step function must return the loss tensor or a dict with a 'loss' tensor and other "
        f"scalars to log; got {type(output).__name__}"
    )


def _method(model: torch.nn.Module, name: str) -> StepFn:
    method = getattr(model, name, None)
    if not callable(method):
        raise TypeError(f"pass {name}=fn(model, batch) to fit(), or give the model a {name}(batch)")
    return lambda _model, batch: method(batch)


def _reset(metrics: dict[str, Any]) -> None:
    for metric in metrics.values():
        metric.reset()


def _compute(metrics: dict[str, Any]) -> dict[str, float]:
    return {name: float(metric.compute()) for name, metric in metrics.items()}


def _say(message: str) -> None:
    # stderr, flushed, not a logger: it must reach a batch job's log file as it happens.
    print(f"unbroken: {message}", file=sys.stderr, flush=True)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")

