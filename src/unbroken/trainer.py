"""``Trainer``: a small training loop that a kill at any instant cannot change the result of.

Everything that decides the next step is in the checkpoint: the model, optimizer, scheduler,
gradient scaler, the gradients of an unfinished accumulation window, the loaders' positions,
the process's RNGs, the loop's counters, torchmetrics states, callbacks with ``state_dict`` and
the CSV log's length. Starting the same command again loads the newest valid checkpoint and
continues; the finished run's weights and logged values are bit for bit those of a run that was
never interrupted.

The loop, top to bottom: restore or seed; for each epoch a training phase (forward, backward,
every ``accumulate`` batches clip and step), then a validation phase; after every batch, check
for a checkpoint (every ``checkpoint_every`` training batches) or a preemption signal (save,
exit with ``EXIT_CODE``). A checkpoint can be taken inside either phase and resumes there.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import Checkpointer
from ._state import has_state
from .csvlog import CSVLog, open_tensorboard
from .globalrng import GlobalRNG
from .preemption import DEFAULT_SIGNALS, EXIT_CODE, Preemption
from .progress import Progress, bar

StepFn = Callable[[torch.nn.Module, Any], Any]


class Trainer:
    """``Trainer(directory, max_epochs=3, checkpoint_every=50, seed=0).fit(model, opt, loader)``.

    Arguments that shape the computation (``seed``, ``accumulate``, ``clip_grad_norm``,
    ``scheduler_interval``) are recorded in the checkpoint and must match on resume; the length
    of the run (``max_epochs``, ``max_steps``) and how often it saves may change.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_epochs: int,
        max_steps: int | None = None,
        seed: int = 0,
        checkpoint_every: int | None = None,
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
    ) -> None:
        _positive("max_epochs", max_epochs)
        for name, value in (("max_steps", max_steps), ("checkpoint_every", checkpoint_every)):
            if value is not None:
                _positive(name, value)
        _positive("accumulate", accumulate)
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
        self.directory = Path(directory)
        self.max_epochs, self.max_steps = max_epochs, max_steps
        self.checkpoint_every, self.keep, self.async_save = checkpoint_every, keep, async_save
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
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log_file = CSVLog(self.directory / "metrics.csv")
        self.checkpointer = Checkpointer(self.directory / "checkpoints", keep=self.keep)
        self.entries = self._entries(train_loader, val_loader)

        restored = self.checkpointer.load_latest(self.entries)
        progress = self.progress
        if restored is None:
            self.log_file.restart()
            _seed_everything(self.seed)
        # Events up to the checkpoint's tick were flushed before it was saved; later ones replay.
        self.board = open_tensorboard(self.tensorboard, self.directory / "tensorboard",
                                      purge_from=progress.ticks + 1)
        self._call("on_fit_start")
        try:
            with Preemption(self.signals) as self.preemption:
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
        self._call("on_fit_end")
        return self.logs

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
                self._after_batch(periodic=True)
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
                self._after_batch(periodic=False)
        self._log("val", {"epoch_loss": progress.phase_mean(), **_compute(self.val_metrics)},
                  per_batch=False)
        model.train()

    def _after_batch(self, periodic: bool) -> None:
        """A step boundary: save if it is time or a preemption signal came; then maybe exit."""
        progress = self.progress
        if self.preemption.requested:
            self._save(blocking=True)
            seconds = self.preemption.seconds_since_signal()
            print(f"unbroken: {self.preemption.received.name} received; checkpoint at epoch "
                  f"{progress.epoch}, batch {progress.batches} committed {seconds:.3f} s after "
                  f"the signal; exiting with {EXIT_CODE} to be requeued", file=sys.stderr, flush=True)
            self._call("on_preempted", seconds)
            raise SystemExit(EXIT_CODE)
        if periodic and self.checkpoint_every and progress.batches % self.checkpoint_every == 0:
            self._save(blocking=not self.async_save)

    def _save(self, blocking: bool = True) -> None:
        if self.progress.ticks == self.progress.saved_at:
            return  # nothing happened since the last checkpoint
        self.progress.saved_at = self.progress.ticks
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


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")

