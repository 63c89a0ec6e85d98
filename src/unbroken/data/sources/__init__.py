"""Where an ``unbroken.DataLoader``'s batches come from: one ``BatchSource`` class per kind of
dataset and sampler (``base``: the protocol), chosen once by ``make_source`` from torch's
arguments, by the one table below (first match wins).

- ``orders``: map-style datasets in unbroken's order (``NativeOrder``), and what a dataset may
  say of its order (``DatasetOrder``); ``samplers``: the user's sampler or batch sampler;
- ``streams``, ``worker_streams``, ``replicas``: iterable datasets, by how they resume;
- ``sharding``: one rank's share of a global order (data parallelism); ``ranks``: the rank and
  world size of sources iterated per rank;
- ``fetch``, ``standin``: what the inner torch loader's workers run (the seeded fetch, and the
  dataset standing in for the user's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._checks import is_int
from ..._state import has_state
from .base import BatchSource
from .orders import DatasetOrder, NativeOrder
from .replicas import ReplayStream, SamplerPatternStream, StatefulStream
from .samplers import UserBatchSampler, UserSampler
from .sharding import ShardedOrder, ShardedRangeStream
from .streams import RangeStream, is_stream, warn_if_buffer_shuffled


@dataclass(frozen=True)
class Arguments:
    """torch's arguments that choose the source, after torch's own checks of them."""

    stream: bool  # an iterable dataset (``streams.is_stream``)
    dataset: Any
    batch_size: int | None
    shuffle: bool | None
    sampler: Any
    batch_sampler: Any
    drop_last: bool
    num_workers: int
    ranks: tuple[int, int] | None  # (rank, world size) of a data-parallel job


def _reads_ranges(a: Arguments) -> bool:
    return callable(getattr(a.dataset, "read_range", None))


def _stream(a: Arguments, kind: type) -> BatchSource:
    return kind(a.dataset, a.batch_size, a.drop_last, a.num_workers)


def _sharded(a: Arguments, rank: int, world: int) -> BatchSource:
    order = DatasetOrder(a.dataset)
    return ShardedOrder(
        len(a.dataset), a.batch_size, a.drop_last, bool(a.shuffle), rank, world, order
    )


def _native(a: Arguments) -> BatchSource:
    order = DatasetOrder(a.dataset)
    return NativeOrder(len(a.dataset), a.batch_size, a.drop_last, bool(a.shuffle), order)


# (what the dataset and arguments are, the source that reads them); first match wins.
SOURCES: list[tuple[Callable[[Arguments], bool], Callable[[Arguments], BatchSource]]] = [
    # Iterable datasets, by what they offer to resume with.
    (
        lambda a: a.stream and a.ranks is not None and _reads_ranges(a),
        lambda a: ShardedRangeStream(
            a.dataset, a.batch_size, a.drop_last, a.num_workers, *(a.ranks or (0, 1))
        ),
    ),
    (lambda a: a.stream and _reads_ranges(a), lambda a: _stream(a, RangeStream)),
    (lambda a: a.stream and has_state(a.dataset), lambda a: _stream(a, StatefulStream)),
    (
        lambda a: (
            a.stream
            and hasattr(a.dataset, "sampler")
            and callable(getattr(a.dataset, "__next__", None))
        ),
        lambda a: _stream(a, SamplerPatternStream),
    ),
    (lambda a: a.stream, lambda a: _stream(a, ReplayStream)),
    # Map-style datasets: the user's batch sampler or sampler (torch's own samplers of
    # unbroken's order were taken in before, by views.adopt), else unbroken's order.
    (lambda a: a.batch_sampler is not None, lambda a: UserBatchSampler(a.batch_sampler)),
    (lambda a: a.sampler is not None, lambda a: UserSampler(a.sampler, a.batch_size, a.drop_last)),
    (lambda a: a.ranks is not None, lambda a: _sharded(a, *(a.ranks or (0, 1)))),
    (lambda a: True, _native),
]


def make_source(
    dataset: Any,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
    num_workers: int,
    ranks: tuple[int, int] | None = None,
) -> BatchSource:
    """The source of the loader's batches, from torch's arguments (and torch's checks)."""
    _check_batch_size(batch_size)
    arguments = Arguments(
        is_stream(dataset),
        dataset,
        batch_size,
        shuffle,
        sampler,
        batch_sampler,
        drop_last,
        num_workers,
        ranks,
    )
    if arguments.stream:
        if shuffle or sampler is not None or batch_sampler is not None:
            raise ValueError(
                "an IterableDataset orders itself: shuffle, sampler and batch_sampler must be left "
                "unset (for an exact shuffle of a stream, see unbroken.shuffle_buffer)"
            )
        warn_if_buffer_shuffled(dataset)
    elif batch_sampler is not None and (
        batch_size != 1 or shuffle or sampler is not None or drop_last
    ):
        raise ValueError(
            "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and "
            "drop_last"
        )
    elif sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    return next(build(arguments) for matches, build in SOURCES if matches(arguments))


def _check_batch_size(batch_size: Any) -> None:
    if batch_size is not None and (not is_int(batch_size) or batch_size <= 0):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
