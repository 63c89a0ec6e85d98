"""Which source an ``unbroken.DataLoader`` reads its batches from, given torch's arguments (and
torch's own checks of them): one ``BatchSource`` class per kind of dataset and sampler."""

from __future__ import annotations

from typing import Any

from .._checks import is_int
from .orders import DatasetOrder, NativeOrder
from .replicas import stream_source
from .samplers import UserBatchSampler, UserSampler
from .sharding import ShardedOrder, ShardedRangeStream
from .sources import BatchSource
from .streams import is_stream, warn_if_buffer_shuffled


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
    if is_stream(dataset):
        if shuffle or sampler is not None or batch_sampler is not None:
            raise ValueError(
                "an IterableDataset orders itself: shuffle, sampler and batch_sampler must be left "
                "unset (for an exact shuffle of a stream, see unbroken.shuffle_buffer)"
            )
        warn_if_buffer_shuffled(dataset)
        if ranks is not None and callable(getattr(dataset, "read_range", None)):
            return ShardedRangeStream(dataset, batch_size, drop_last, num_workers, *ranks)
        return stream_source(dataset, batch_size, drop_last, num_workers)
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                "and drop_last"
            )
        return UserBatchSampler(batch_sampler)
    if sampler is not None:
        if shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        # torch's samplers of unbroken's own order were taken in before (views.adopt).
        return UserSampler(sampler, batch_size, drop_last)
    order = DatasetOrder(dataset)
    if ranks is not None:  # each rank's share of one global order (unbroken.distributed)
        return ShardedOrder(len(dataset), batch_size, drop_last, bool(shuffle), *ranks, order)
    return NativeOrder(len(dataset), batch_size, drop_last, bool(shuffle), order)


def _check_batch_size(batch_size: Any) -> None:
    if batch_size is not None and (not is_int(batch_size) or batch_size <= 0):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
