"""torch's sampler API onto an ``unbroken.DataLoader``'s own order, in both directions.

Code written for torch's DataLoader reads ``loader.sampler`` and ``loader.batch_sampler``:
Lightning re-creates a loader from its attributes, calls ``sampler.set_epoch`` at every epoch,
and under DDP replaces any sampler that is not a ``DistributedSampler`` with torch's own. So:

- ``OrderView`` is ``loader.sampler`` for a map-style dataset in unbroken's order: the indices
  this rank reads in an epoch, from its start, in the loader's order. It is a
  ``DistributedSampler`` because that is what it is (this rank's share of the dataset, one rank's
  being all of it; ``set_epoch``), and so Lightning keeps the loader's sharding.
- ``adopt`` goes the other way: a sampler or batch sampler that describes unbroken's own order
  (a view, torch's ``SequentialSampler``/``RandomSampler``/``DistributedSampler`` over the
  dataset, torch's ``BatchSampler`` around one of them) becomes the loader's own settings, so a
  loader re-created from its attributes is the same loader, resumable in O(1).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    default_collate,
    default_convert,
)

from .sources.base import Cursor
from .sources.orders import IndexSource, NativeOrder
from .sources.streams import is_stream

if TYPE_CHECKING:
    from .loader import DataLoader


class OrderView(DistributedSampler):
    """``loader.sampler``: the indices of this rank's batches of the loader's current epoch, from
    the epoch's first batch, in the loader's order (it follows the loader's seed and epoch).
    Unlike torch's samplers it leaves out what ``drop_last`` drops: it lists what is read."""

    # DistributedSampler.__init__ is not called: it asks the process group for what the loader
    # already knows, and fixes seed and epoch, which here follow the loader (``follow``).
    def __init__(self, loader: DataLoader) -> None:
        assert isinstance(loader._source, IndexSource), "a view of a map-style source only"
        # The loader only weakly: it must be freed (and its workers stopped) as soon as the user
        # drops it, which a cycle through its own sampler would delay until a GC pass; the view
        # outlives it with the last seed and epoch it was told.
        self._loader_ref: Callable[[], DataLoader | None] = weakref.ref(loader)
        self._source = loader._source
        self.dataset = loader.dataset
        self.num_replicas, self.rank = loader.world_size, loader.rank
        self.shuffle = bool(getattr(self._source, "shuffle", False))
        self.drop_last = loader.drop_last
        self.seed_given = loader._seed_given
        self.follow(loader.seed, loader.epoch)

    def __getstate__(self) -> dict[str, Any]:
        # A weak reference does not pickle: the loader goes by value (pickle keeps one copy of
        # it, so a pickled loader comes back with its own view pointing at it).
        state = self.__dict__.copy()
        state["_loader_ref"] = state["_loader_ref"]()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        loader = state.pop("_loader_ref")
        self.__dict__.update(state)
        self._loader_ref = weakref.ref(loader) if loader is not None else _gone

    def follow(self, seed: int, epoch: int) -> None:
        """Called by the loader whenever its seed or epoch changes."""
        self._seed, self._epoch = seed, epoch

    @property
    def seed(self) -> int:  # type: ignore[override]
        return self._seed

    @property
    def epoch(self) -> int:  # type: ignore[override]
        return self._epoch

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        return len(self)

    @property
    def total_size(self) -> int:  # type: ignore[override]
        """Samples in the epoch over all ranks (the dataset's length, less what drop_last drops)."""
        return getattr(self._source, "epoch_samples", len(self) * self.num_replicas)

    def _batches(self) -> Iterator[Any]:
        source = self._source
        start = Cursor(source=source.fresh())
        return (keys[0] for keys in source.batches(self._seed, self._epoch, start, deque()))

    def __iter__(self) -> Iterator[int]:
        for indices in self._batches():
            yield from indices

    def __len__(self) -> int:
        if self.num_replicas == 1 and isinstance(self._source, NativeOrder):
            return self._source.epoch_samples
        return sum(len(indices) for indices in self._batches())

    def set_epoch(self, epoch: int) -> None:
        """Make the loader's next iteration start ``epoch`` from its first batch, as torch's
        ``DistributedSampler.set_epoch`` does, except when the loader holds a position of
        ``epoch`` that ``load_state_dict`` restored and that has yielded nothing yet: a call
        at every epoch's start (Lightning's, or a loop written for DistributedSampler) must not
        drop it. A restored position of another epoch is dropped: Lightning resumed from a
        checkpoint taken at an epoch's last batch restores that epoch's (empty) remainder, then
        calls ``set_epoch`` with the next epoch."""
        loader = self._loader_ref()
        if loader is None:
            self._epoch = epoch
        elif not (loader._restored and epoch == loader.epoch):
            loader.set_epoch(epoch)


def _gone() -> None:
    """The loader of a view pickled after its loader was freed."""
    return None


@dataclass
class Adopted:
    """The loader's arguments once a sampler that describes unbroken's order is taken in."""

    sampler: Any
    batch_sampler: Any
    batch_size: int | None
    drop_last: bool
    shuffle: bool | None
    seed: int | None = None  # the order's seed, if the sampler fixes one
    seed_given: bool = False  # whether that seed was chosen by the user (not drawn at random)
    ranks: tuple[int, int] | None = None  # (rank, world_size), if the sampler fixes them


def adopt(
    dataset: Any,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    batch_size: int | None,
    drop_last: bool,
) -> Adopted:
    """The loader's arguments with a sampler (or torch's ``BatchSampler`` around one) that
    describes unbroken's own order over ``dataset`` replaced by settings; others unchanged."""
    unchanged = Adopted(sampler, batch_sampler, batch_size, drop_last, shuffle)
    if batch_sampler is None:
        order = _order_of(dataset, sampler)
        if order is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
    elif type(batch_sampler) is BatchSampler:
        order = _order_of(dataset, batch_sampler.sampler)
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            return unchanged  # torch's own "mutually exclusive" error, from make_source
        batch_size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
    else:
        order = None
    if order is None:
        return unchanged
    return Adopted(None, None, batch_size, drop_last, *order)


def _order_of(
    dataset: Any, sampler: Any
) -> tuple[bool, int | None, bool, tuple[int, int] | None] | None:
    """(shuffle, seed, seed chosen by the user, ranks) if ``sampler`` is one of unbroken's own
    orders over ``dataset``, else None. Exact types only: a subclass may order otherwise."""
    kind = type(sampler)
    if kind is OrderView and sampler.dataset is dataset:
        ranks = (sampler.rank, sampler.num_replicas) if sampler.num_replicas > 1 else None
        return sampler.shuffle, sampler.seed, sampler.seed_given, ranks
    if kind is SequentialSampler and sampler.data_source is dataset:
        return False, None, False, None
    if (
        kind is RandomSampler
        and sampler.data_source is dataset
        and not sampler.replacement
        and sampler.num_samples == len(dataset)
    ):
        generator = sampler.generator
        seed = None if generator is None else generator.initial_seed()
        return True, seed, generator is not None, None
    if kind is DistributedSampler and sampler.dataset is dataset:
        ranks = (sampler.rank, sampler.num_replicas)
        return sampler.shuffle, sampler.seed, True, ranks
    return None


def samplers(loader: DataLoader, sampler: Any, batch_sampler: Any) -> tuple[Any, Any]:
    """``sampler`` and ``batch_sampler`` as torch's DataLoader sets them: the user's, else the
    loader's own order seen as torch's samplers (``views``); none for an iterable dataset."""
    if is_stream(loader.dataset):
        return None, None
    if batch_sampler is not None:
        # As torch: set, and never used.
        return SequentialSampler(loader.dataset), batch_sampler  # type: ignore[arg-type]
    if sampler is None:
        sampler = OrderView(loader)
    if loader.batch_size is None:
        return sampler, None
    return sampler, BatchSampler(sampler, loader.batch_size, loader.drop_last)


def default_collate_of(loader: DataLoader) -> Any:
    auto_collation = loader.batch_size is not None or loader.batch_sampler is not None
    return default_collate if auto_collation else default_convert
