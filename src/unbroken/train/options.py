"""What the Trainer accepts, checked where it is given: its arguments and ``fit``'s loaders.

Every check runs before anything is trained, saved or locked, and its error names the argument,
the value received and what is expected. Costs a few ``isinstance`` checks per call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .._checks import is_int, is_number
from .._state import has_state

SCHEDULER_INTERVALS = ("step", "epoch")


def check_arguments(trainer: Any) -> None:
    """Raise ``ValueError`` for a ``Trainer`` argument out of its range (read from the
    Trainer's attributes, before it installs anything)."""
    max_epochs, max_steps = trainer.max_epochs, trainer.max_steps
    checkpoint_every_seconds = trainer.checkpoint_every_seconds
    checkpoint_every_steps = trainer.checkpoint_every_steps
    accumulate, deterministic = trainer.accumulate, trainer.deterministic
    scheduler_interval = trainer.scheduler_interval
    positive("max_epochs", max_epochs)
    for name, value in (
        ("max_steps", max_steps),
        ("checkpoint_every_steps", checkpoint_every_steps),
    ):
        if value is not None:
            positive(name, value)
    if checkpoint_every_seconds is not None and (
        isinstance(checkpoint_every_seconds, bool)
        or not isinstance(checkpoint_every_seconds, (int, float))
        or not checkpoint_every_seconds > 0
    ):
        raise ValueError(
            "checkpoint_every_seconds must be a number > 0 or None, got "
            f"{checkpoint_every_seconds!r}"
        )
    if deterministic not in (None, True, False):
        raise ValueError(f"deterministic must be True, False or None, got {deterministic!r}")
    positive("accumulate", accumulate)
    if scheduler_interval not in SCHEDULER_INTERVALS:
        raise ValueError(
            f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}"
        )
    positive("log_every", trainer.log_every)
    positive("preemption_check_every", trainer.preemption_check_every)
    timeout = trainer.checkpoint_timeout
    if not is_number(timeout) or not timeout > 0:
        raise ValueError(f"checkpoint_timeout must be a number of seconds > 0, got {timeout!r}")


def positive(name: str, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def hooks(callbacks: Iterable[Any], hook: str) -> tuple[Callable[..., Any], ...]:
    """The ``hook`` methods of the callbacks that have one, in order (duck-typed): looked up
    once before a loop, so a batch with no callback for it costs an empty ``for``."""
    return tuple(method for c in callbacks if callable(method := getattr(c, hook, None)))


def call_hooks(callbacks: Iterable[Any], hook: str, trainer: Any, *args: Any) -> None:
    """Call ``hook(trainer, *args)`` on every callback that has it (duck-typed, in order)."""
    for method in hooks(callbacks, hook):
        method(trainer, *args)


def check_loaders(train_loader: Iterable, val_loader: Iterable | None) -> None:
    """A loader without ``state_dict`` would restart its epoch on resume: refuse it."""
    for loader, name in ((train_loader, "train_loader"), (val_loader, "val_loader")):
        if loader is not None and not has_state(loader):
            raise TypeError(
                f"{name} has no state_dict(), so its position cannot be saved and a resume "
                "would restart its epoch; use unbroken.DataLoader (or any loader with "
                "state_dict/load_state_dict)"
            )
