"""Check your own pipeline: ``assert_resumes_exactly(make_loader, epochs=2)``.

It runs the loader uninterrupted for ``epochs`` epochs, saving the state after every batch
(inside the loop) and after every epoch's loop has ended, then restores each saved state into
a fresh loader and checks that the rest of the stream is equal, batch by batch, with
``torch.equal`` and the same structure. The saved states go through ``json.dumps``/``loads``
on the way, as they would through a checkpoint.

Cost: one full run plus one partial run per cut point, i.e. quadratic in the number of
batches; pass ``cuts`` to check a subset of the cut points on a large pipeline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

__all__ = ["assert_resumes_exactly", "assert_same"]


def assert_resumes_exactly(
    make_loader: Callable[[], Any],
    epochs: int = 2,
    *,
    resume_with: Callable[[], Any] | None = None,
    cuts: Iterable[int] | None = None,
) -> int:
    """Raise ``AssertionError`` at the first cut point whose resumed stream differs.

    ``make_loader()`` must build a fresh loader each call (same dataset, seed and settings).
    ``resume_with()`` builds the loader that resumes (default: ``make_loader``), e.g. with
    another ``num_workers``. ``cuts`` selects cut points by index into the list of saved
    states (0 is before the first batch). Returns the number of cut points checked.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    stream, saved = _record(make_loader(), epochs)
    resume_with = resume_with or make_loader
    chosen = range(len(saved)) if cuts is None else sorted(set(cuts))
    for cut in chosen:
        if not 0 <= cut < len(saved):
            raise ValueError(f"cut {cut} is out of range: there are {len(saved)} cut points")
        received, label, state = saved[cut]
        loader = resume_with()
        loader.load_state_dict(json.loads(state))
        rest = [batch for _ in range(loader.epoch, epochs) for batch in loader]
        expected = stream[received:]
        where = f"resumed from the state saved {label} ({received} batches received)"
        if len(rest) != len(expected):
            raise AssertionError(
                f"{where}: got {len(rest)} batches, the uninterrupted run has {len(expected)}"
            )
        for i, (got, want) in enumerate(zip(rest, expected)):
            assert_same(got, want, f"{where}: batch {received + i}")
    return len(chosen)


def _record(loader: Any, epochs: int) -> tuple[list, list[tuple[int, str, str]]]:
    stream: list = []
    saved = [(0, "before the first batch", json.dumps(loader.state_dict()))]
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            stream.append(batch)
            label = f"inside epoch {epoch} after its batch {i}"
            saved.append((len(stream), label, json.dumps(loader.state_dict())))
        saved.append(
            (len(stream), f"after epoch {epoch}'s loop ended", json.dumps(loader.state_dict()))
        )
    return stream, saved


def assert_same(got: Any, want: Any, where: str = "value") -> None:
    """Assert equal structure and values; tensors are compared with ``torch.equal``."""
    if type(got) is not type(want):
        raise AssertionError(f"{where}: type {type(got).__name__} != {type(want).__name__}")
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            raise AssertionError(f"{where}: tensors differ:\n{got}\n!=\n{want}")
    elif isinstance(want, np.ndarray):
        if got.dtype != want.dtype or not np.array_equal(got, want):
            raise AssertionError(f"{where}: arrays differ:\n{got}\n!=\n{want}")
    elif isinstance(want, dict):
        if list(got) != list(want):
            raise AssertionError(f"{where}: keys {list(got)} != {list(want)}")
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        if len(got) != len(want):
            raise AssertionError(f"{where}: length {len(got)} != {len(want)}")
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    elif got != want:
        raise AssertionError(f"{where}: {got!r} != {want!r}")
