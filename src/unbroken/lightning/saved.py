"""What ``ExactResume`` keeps in Lightning's checkpoint, and its check on load.

``{"version": 2, "ranks": [{"rng": ..., "metrics": ..., "epoch_metrics": ...} per rank],
"saved_at": loops.Place.to_state()}``: each rank's generator states (``GlobalRNG``), its
``trainer.callback_metrics`` as plain scalars with their dtype, the training step's epoch
aggregates, and the place in the loop the checkpoint was taken at. Version 1 (the generators
only) still loads.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer

from ..errors import CorruptState
from . import loops

VERSION = 2
_RANK_FIELDS = {"rng", "metrics", "epoch_metrics"}
_PLACE_FIELDS = set(loops.Place("").to_state())
_OLDER_PLACE_FIELDS = _PLACE_FIELDS - {"by_max_steps"}  # saved before it was known (issue 26)
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


def read_state(state: Any) -> tuple[list[dict], dict | None]:
    """(each rank's {"rng", "metrics"}, where it was saved) from a saved state; version 1
    (generators only) still loads."""
    version = state.get("version") if isinstance(state, dict) else None
    if version == 1 and isinstance(state.get("rng"), list) and state["rng"]:
        return [{"rng": rng, "metrics": {}, "epoch_metrics": []} for rng in state["rng"]], None
    ranks = state.get("ranks") if version == VERSION else None
    place = state.get("saved_at") if version == VERSION else None
    if (
        not isinstance(ranks, list)
        or not ranks
        or not all(isinstance(r, dict) and set(r) == _RANK_FIELDS for r in ranks)
        or not isinstance(place, dict)
        or not _OLDER_PLACE_FIELDS <= set(place) <= _PLACE_FIELDS
    ):
        raise CorruptState(
            f"{_WHAT} state: expected {{'version': {VERSION}, 'ranks': [{{'rng': ..., "
            f"'metrics': ..., 'epoch_metrics': ...}} per rank], 'saved_at': "
            f"{sorted(_PLACE_FIELDS)}}}, got {str(state)[:200]}"
        )
    return ranks, place
