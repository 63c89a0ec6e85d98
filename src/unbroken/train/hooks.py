"""The Trainer's callbacks (its hooks, looked up once) and ``fit``'s loaders, checked where
they are given. The Trainer's own options are checked in ``options``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .._state import has_state


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
