"""``PerRank``: a checkpoint entry that every rank of a data-parallel job saves for itself.

A ``Checkpointer`` under ``torch.distributed`` writes each entry of ``state`` once, from rank
0, since in data parallelism the model, the optimizer, the scheduler and unbroken's sharded
loaders are the same on every rank. What differs between ranks is wrapped in ``PerRank``: every
rank writes its own part (``003-rng.rank-00001.pt``), the manifest lists them all, and on a
resume on the same number of ranks each rank loads its own.

A job restarted on another number of ranks cannot simply load "its own" part: ``resize`` says
what a rank loads then.

- ``"refuse"`` (the default): a ``StateMismatch`` on ``world_size`` naming the entry.
- ``"rank0"``: every rank loads rank 0's part: for a state that is the same on every rank (a
  loader's global cursor), or that checks itself (a per-rank loader refuses another world).
- ``"skip"``: the object is left as it is; the caller re-derives it (the Trainer re-seeds the
  process RNGs from the seed, the step and the rank).
- a function ``resize(parts, rank, world_size)``, given the saved parts in rank order,
  returning the state this rank loads, or ``None`` to leave the object as it is (the Trainer
  merges torchmetrics states onto rank 0 this way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import StateMismatch

Resize = Callable[[list[Any], int, int], Any]
_NAMED = ("refuse", "rank0", "skip")


class PerRank:
    """An entry of a ``Checkpointer``'s state that every rank saves and loads for itself.

    Args:
        obj: A stateful object or a plain value.
        resize: What a rank loads when the job resumes on another number of ranks:
            ``"refuse"``, ``"rank0"``, ``"skip"`` or a function ``resize(parts, rank,
            world_size)`` (see the module).

    Raises:
        ValueError: ``obj`` is already a ``PerRank``, or ``resize`` is none of these.
    """

    def __init__(self, obj: Any, resize: str | Resize = "refuse") -> None:
        if isinstance(obj, PerRank):
            raise ValueError("PerRank(PerRank(...)): wrap the object once")
        if not callable(resize) and resize not in _NAMED:
            raise ValueError(
                f"resize must be one of {_NAMED} or a function (parts, rank, world_size) -> "
                f"state, got {resize!r}"
            )
        self.obj, self.resize = obj, resize

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r}, resize={self.resize!r})"


def unwrap(obj: Any) -> Any:
    return obj.obj if isinstance(obj, PerRank) else obj


SKIP = object()  # what resize gives for an object to leave as it is


def resized(
    wanted: Any, name: str, parts: list[Any], rank: int, world_size: int, where: str
) -> Any:
    """What rank ``rank`` of ``world_size`` loads of ``state[name]`` (``wanted``), saved per rank
    by ``len(parts)`` ranks in checkpoint ``where``: ``SKIP`` to leave the object as it is;
    ``StateMismatch`` unless ``wanted`` is a ``PerRank`` whose ``resize`` allows it."""
    if not isinstance(wanted, PerRank) or wanted.resize == "refuse":
        raise StateMismatch(
            f"checkpoint {where}",
            "world_size",
            len(parts),
            world_size,
            message=(
                f"checkpoint {where}: state[{name!r}] was saved per rank by {len(parts)} "
                f"ranks and cannot be split over {world_size}; resume on {len(parts)} ranks, "
                "or give it as PerRank(obj, resize=...) saying what a rank loads then"
            ),
        )
    if wanted.resize == "rank0":
        return parts[0]
    if wanted.resize == "skip":
        return SKIP
    assert callable(wanted.resize)
    value = wanted.resize(parts, rank, world_size)
    return SKIP if value is None else value
