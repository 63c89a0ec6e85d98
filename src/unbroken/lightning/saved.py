"""What ``ExactResume`` keeps in Lightning's checkpoint, and its check on load.

``{"version": 2, "ranks": [{"rng": ..., "metrics": ..., "epoch_metrics": ...} per rank],
"saved_at": loops.Place.to_state(), "workers": {"train": [2], "val": [0]}, "should_stop":
false}``: each rank's generator states (``GlobalRNG``), its ``trainer.callback_metrics`` as plain
scalars with their dtype, the training step's epoch aggregates, the place in the loop the
checkpoint was taken at, the loaders' ``num_workers`` (``draws``), and ``trainer.should_stop``
(which Lightning does not save). Version 1 (the generators only) still loads, and so do version
2 states saved before ``workers``, ``should_stop`` and the later places' fields were added.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer

from .._checks import is_int
from ..errors import CorruptState
from . import loops

VERSION = 2
_RANK_FIELDS = {"rng", "metrics", "epoch_metrics"}
_PLACE_FIELDS = set(loops.Place("").to_state())
# Places saved before by_max_steps, counters_off and last_step were known load (as False).
_OLDER_PLACE_FIELDS = _PLACE_FIELDS - {"by_max_steps", "counters_off", "last_step"}
_WHAT = "unbroken.lightning.ExactResume"


def metrics(trainer: Trainer | None) -> dict[str, dict[str, Any]]:
    """``trainer.callback_metrics`` as plain values: each scalar with its dtype."""
    if trainer is None:
        return {}
    saved = {}
    for name, value in trainer.callback_metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            saved[name] = {"value": value.item(), "dtype": str(value.dtype).split(".")[-1]}
    return saved


def tensors(metrics: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {
        name: torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]))
        for name, entry in metrics.items()
    }


def read_state(state: Any) -> tuple[list[dict], dict | None, dict[str, list[int]] | None]:
    """(each rank's {"rng", "metrics", "epoch_metrics"}, where it was saved, the loaders'
    worker counts) from a saved state; None for what an older state does not hold."""
    version = state.get("version") if isinstance(state, dict) else None
    if version == 1 and isinstance(state.get("rng"), list) and state["rng"]:
        return (
            [{"rng": rng, "metrics": {}, "epoch_metrics": []} for rng in state["rng"]],
            None,
            None,
        )
    ranks = state.get("ranks") if version == VERSION else None
    place = state.get("saved_at") if version == VERSION else None
    workers = state.get("workers") if version == VERSION else None
    if (
        not isinstance(ranks, list)
        or not ranks
        or not all(isinstance(r, dict) and set(r) == _RANK_FIELDS for r in ranks)
        or not isinstance(place, dict)
        or not _OLDER_PLACE_FIELDS <= set(place) <= _PLACE_FIELDS
        or not (workers is None or _worker_counts(workers))
    ):
        raise CorruptState(
            f"{_WHAT} state: expected {{'version': {VERSION}, 'ranks': [{{'rng': ..., "
            f"'metrics': ..., 'epoch_metrics': ...}} per rank], 'saved_at': "
            f"{sorted(_PLACE_FIELDS)}, 'workers': {{'train': [int], ...}}}}, got "
            f"{str(state)[:200]}"
        )
    return ranks, place, workers


def stop_decided(state: dict[str, Any]) -> bool:
    """Whether the run had decided to stop (``trainer.should_stop``) when the state was saved;
    False for a state saved before it was kept.

    Raises:
        CorruptState: ``should_stop`` is there and not a bool.
    """
    decided = state.get("should_stop", False)
    if not isinstance(decided, bool):
        raise CorruptState(f"{_WHAT} state: 'should_stop' must be a bool, got {decided!r}")
    return decided


def _worker_counts(workers: Any) -> bool:
    return isinstance(workers, dict) and all(
        isinstance(phase, str) and isinstance(counts, list) and all(is_int(n) for n in counts)
        for phase, counts in workers.items()
    )
