"""The saved states of unbroken's data objects, in one place: each a ``TypedDict`` and a
``Format`` (its ``format`` tag, the version ``state_dict()`` writes and the versions
``load_state_dict`` reads). Every state is plain JSON; user objects' own states ride inside
(``source``, ``inner``, ``upstream``, a child's ``state``) encoded by ``unbroken._state``.

Versions:

- ``unbroken.DataLoader`` 3: the global generators are seeded once per batch, from a 32-bit
  bijection of the batch's position, and ``sample_rng()`` from one of the sample's (``rng``);
  versions 1 and 2 seeded them per sample from a 64-bit hash. The rest of an epoch saved by
  them would draw other numbers than the run that saved it, so their states are refused with a
  ``StateMismatch`` on ``version`` that says why (2 had moved stream worker w's seeds to their
  own key, ``unbroken.data.keys``).
- ``unbroken.shuffle_buffer`` 2: windows are permuted with keys of their own; version 1 states
  are refused the same way.
- ``unbroken.resumable`` 1, ``unbroken.CombinedLoader`` 1: unchanged.

On several ranks, a ``DataLoader`` whose dataset each rank iterates on its own (a user sampler,
an iterable dataset other than a global-cursor stream with ``len()``) also saves ``rank`` and
``world_size`` in its fingerprint, and loads only on that rank and world size
(``sources.rank_checks``). A fingerprint without them is a single process's, as every state was
before, so the version stays.
"""

from __future__ import annotations

from typing import Any, TypedDict

from .._state import Format
from ..errors import StateMismatch


class LoaderState(TypedDict):
    format: str
    version: int
    seed: int
    epoch: int
    samples: int  # samples received this epoch
    batches: int  # batches received this epoch
    source: Any  # the source's own part (None, SamplerPosition or WorkersPosition)
    fingerprint: dict[str, Any]  # settings that must match on load (+ rank, world_size: ranks)


class SamplerPosition(TypedDict):
    """A user sampler's part, after an epoch's first batch."""

    state: Any  # the sampler's state_dict() after the last batch drawn, or None
    end: bool  # that batch was the epoch's last


class WorkerPosition(TypedDict):
    """One worker replica of an iterable dataset."""

    state: Any  # the dataset's state after the worker's last received batch, or None
    items: int  # items of the worker's received batches
    exhausted: bool  # its epoch ended


class WorkersPosition(TypedDict):
    """A per-worker iterable dataset's part: torch's round-robin over the replicas."""

    workers: list[WorkerPosition]
    next: int  # the worker whose batch comes next


class ResumableState(TypedDict):
    format: str
    version: int
    name: str | None
    epoch: int
    items: int  # items received this epoch
    end: bool  # the last one was the epoch's last
    inner: Any  # the epoch's iterable's own state, or None (resumed by skipping)


class ShuffleBufferState(TypedDict):
    format: str
    version: int
    size: int
    seed: int
    epoch: int
    window: int
    emitted: int  # items of the window emitted
    end: bool  # the epoch's last item was emitted
    upstream: Any  # the upstream's state at the window's start (after its epoch, if end)


class ChildPosition(TypedDict):
    state: Any  # the child's state_dict()
    batches: int  # its batches in this combined epoch
    exhausted: bool  # it ran out in this combined epoch
    open: bool  # its own epoch is started and not ended


class CombinedState(TypedDict):
    format: str
    version: int
    mode: str
    keys: list[str] | int  # a dict's keys, or a list's length
    epoch: int
    batches: int
    current: int | None  # sequential mode: the child being iterated
    loaders: list[ChildPosition]


LOADER = Format("unbroken.DataLoader", 3, LoaderState, readable=(1, 2))
RESUMABLE = Format("unbroken.resumable", 1, ResumableState)
SHUFFLE_BUFFER = Format("unbroken.shuffle_buffer", 2, ShuffleBufferState)
COMBINED = Format("unbroken.CombinedLoader", 1, CombinedState)


def refuse_seeded_per_sample(version: int | None, what: str) -> None:
    """Refuse a loader state of a version ``LOADER`` reads but cannot continue (``StateMismatch``):
    versions 1 and 2 seeded the global generators once per sample, this one once per batch."""
    if version != LOADER.version:
        raise StateMismatch(
            what,
            "version",
            version,
            LOADER.version,
            message=(
                f"{what}: the state was saved with version={version}, which seeded the "
                "global generators once per sample (and sample_rng() from other seeds); this "
                f"version={LOADER.version} seeds them once per batch, so the rest of the epoch "
                "would draw other random numbers than the run that saved it. Finish that run "
                "with the unbroken release that started it (0.1.x), or start a new one."
            ),
        )
