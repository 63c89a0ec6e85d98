"""Where an ``unbroken.DataLoader``'s batches come from: one ``BatchSource`` class per kind of
dataset and sampler (``base``: the protocol), each saying which datasets it reads (``matches``);
``make_source`` builds the first class of ``SOURCES`` that matches torch's arguments, and
``register`` adds one.

- ``orders``: map-style datasets in unbroken's order (``NativeOrder``), and what a dataset may
  say of its order (``DatasetOrder``); ``samplers``: the user's sampler or batch sampler;
- ``streams``, ``worker_streams``, ``replicas``: iterable datasets, by how they resume;
- ``sharding``: one rank's share of a global order (data parallelism); ``rank_checks``: the
  rank and world size of sources iterated per rank;
- ``fetch``: what the inner torch loader's workers run (the seeded fetch, and the dataset
  standing in for the user's).

Cost: ``make_source`` asks each class's ``matches`` once, when a loader is built.
"""

from __future__ import annotations

from typing import Any

from ..._checks import is_int
from .base import Arguments, BatchSource
from .orders import NativeOrder
from .replicas import ReplayStream, SamplerPatternStream, StatefulStream
from .samplers import UserBatchSampler, UserSampler
from .sharding import ShardedOrder, ShardedRangeStream
from .streams import RangeStream, is_stream, warn_if_buffer_shuffled

# The source classes, tried in this order: the first whose ``matches`` takes the arguments builds
# the loader's source. Iterable datasets by what they offer to resume with, then map-style ones:
# the user's batch sampler or sampler (torch's own samplers of unbroken's order were taken in
# before, by ``torch_api.adopt``), else unbroken's order (``NativeOrder`` matches any).
SOURCES: list[type[BatchSource]] = [
    ShardedRangeStream,
    RangeStream,
    StatefulStream,
    SamplerPatternStream,
    ReplayStream,
    UserBatchSampler,
    UserSampler,
    ShardedOrder,
    NativeOrder,
]


def register(source: type[BatchSource], *, first: bool = False) -> type[BatchSource]:
    """Make ``source`` a candidate for every loader built from now on.

    Args:
        source: A ``BatchSource`` class with the classmethods ``matches`` and ``build``.
        first: Try it before the built-in sources (to take datasets one of them would read).
            Otherwise it is tried after the streams and user samplers and before unbroken's
            own orders (``ShardedOrder``, ``NativeOrder``), which take any other map-style
            dataset.

    Returns:
        ``source``, so that ``register`` can decorate the class. ``SOURCES.remove(source)``
        takes it out again.

    Raises:
        TypeError: ``source`` is not a ``BatchSource`` class.
    """
    if not (isinstance(source, type) and issubclass(source, BatchSource)):
        raise TypeError(
            f"register() takes a BatchSource subclass, got {source!r}: subclass "
            "unbroken.data.sources.base.BatchSource (or orders.IndexSource for map-style data)"
        )
    if source in SOURCES:
        SOURCES.remove(source)
    SOURCES.insert(0 if first else SOURCES.index(ShardedOrder), source)
    return source


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
    return next(source.build(arguments) for source in SOURCES if source.matches(arguments))


def _check_batch_size(batch_size: Any) -> None:
    if batch_size is not None and (not is_int(batch_size) or batch_size <= 0):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
