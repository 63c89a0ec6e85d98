"""Steps that draw from numpy's or ``random``'s global generator, resumed with other workers.

An ``unbroken.DataLoader`` with ``num_workers=0`` fetches its batches in the training process
and leaves numpy's and ``random``'s global generators as the batch's last sample left them
(seeded anew for every batch); with workers it leaves them alone. A training or validation step
that draws from them therefore draws other numbers after a resume that moved a loader between
0 and more workers, and the run goes on with other weights. The loader cannot tell (it does not
see the step), and putting those generators back after every batch would cost every run two
state copies a batch (rows ``numpy_rng_back`` and ``random_rng_back`` of
docs/benchmarks/unit-costs.md). So ``ExactResume`` saves the loaders' worker counts, and a run resumed with counts on
the other side of 0 watches its steps: the first that draws from numpy's or ``random``'s global
generator is warned about. Cost: nothing when no count crossed 0; else both generators' states
read at the step's start and end (row ``draws_check`` of the unit costs) for the first ``WATCHED`` steps after the
resume, or until a draw is seen.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
from lightning.pytorch import Trainer

from .._checks import is_int
from . import loops

WATCHED = 100  # training and validation steps watched after a resume that crossed 0 workers


def worker_counts(trainer: Trainer | None) -> dict[str, list[int]]:
    """Each phase's loaders' ``num_workers`` ("train", "val"), in Lightning's order."""
    counts: dict[str, list[int]] = {}
    for phase, loader in loops.all_loaders(trainer) if trainer is not None else []:
        workers = getattr(loader, "num_workers", None)
        if is_int(workers):
            counts.setdefault(phase, []).append(workers)
    return counts


def crossed(saved: dict[str, list[int]], now: dict[str, list[int]]) -> list[str]:
    """The loaders that ran with 0 workers on one side and more on the other, as
    "train loader 0: 2 -> 0"."""
    moved = []
    for phase in sorted(set(saved) & set(now)):
        for i, (before, after) in enumerate(zip(saved[phase], now[phase])):
            if (before == 0) != (after == 0):
                moved.append(f"{phase} loader {i}: {before} -> {after}")
    return moved


class DrawWatch:
    """Watches the steps of a resumed run whose loaders crossed 0 workers (``moved``) for draws
    from numpy's and ``random``'s global generators: ``start()`` as a step begins, ``end()``
    as it ends returns the warning to give, once."""

    def __init__(self, moved: list[str]) -> None:
        self.moved = moved
        self._left = WATCHED if moved else 0
        self._before: tuple[Any, Any] | None = None

    def start(self) -> None:
        self._before = _states() if self._left > 0 else None

    def end(self, step: str) -> str | None:
        if self._before is None:
            return None
        before, self._before = self._before, None
        self._left -= 1
        drawn = [name for name, a, b in zip(("numpy", "random"), before, _states()) if a != b]
        if not drawn:
            return None
        self._left = 0
        names = " and ".join(f"{name}'s" for name in drawn)
        return (
            f"the {step} step draws from {names} global generator, and this run's loaders "
            f"changed between 0 and more workers since the checkpoint ({', '.join(self.moved)})."
            " With num_workers=0 an unbroken.DataLoader leaves those generators as its batch's "
            "samples left them, with workers it leaves them alone: the step draws other "
            "numbers than in the run that saved the checkpoint, and the weights differ. Resume "
            "with the saved num_workers, or draw in the step from torch's generator (which the "
            "loader puts back) or from a generator of your own that the checkpoint holds."
        )


def _states() -> tuple[Any, Any]:
    """numpy's legacy global state (as comparable values) and ``random``'s."""
    legacy = cast("tuple[str, Any, int, int, float]", np.random.get_state(legacy=True))
    kind, keys, position, has_gauss, cached = legacy
    return (position, has_gauss, cached, keys.tobytes()), random.getstate()
