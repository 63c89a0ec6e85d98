"""torch's DataLoader API, both ways: what it takes and what it gives back.

``unbroken.DataLoader`` takes torch's arguments and shows torch's attributes. Code written for
torch's loader relies on both: it matches torch's errors, reads ``loader.sampler`` and
``loader.batch_sampler`` (Lightning re-creates a loader from its attributes, calls
``sampler.set_epoch`` at every epoch, and under DDP replaces any sampler that is not a
``DistributedSampler`` with torch's own), and seeds torch's global generator to fix the order.

- **Arguments in**: ``refuse_what_torch_refuses`` lets torch itself check them (torch's
  exception and message); ``adopt`` turns a sampler or batch sampler that describes unbroken's
  own order (a view, torch's ``SequentialSampler``/``RandomSampler``/``DistributedSampler`` over
  the dataset, torch's ``BatchSampler`` around one of them) into the loader's own settings, so a
  loader re-created from its attributes is the same loader, resumable in O(1); ``choose_seed``
  picks the data seed as torch's ``RandomSampler`` would draw it.
- **Attributes out**: ``samplers`` and ``collate_of`` set ``sampler``,
  ``batch_sampler`` and ``collate_fn`` as torch does. ``OrderView`` is ``loader.sampler`` for a
  map-style dataset in unbroken's order: the indices this rank reads in an epoch, from its
  start, in the loader's order. It is a ``DistributedSampler`` because that is what it is (this
  rank's share of the dataset, one rank's being all of it; ``set_epoch``), and so Lightning
  keeps the loader's sharding.

Cost: at construction, one torch DataLoader built and dropped (it builds samplers and starts no
worker) and, without a seed, one draw from a copy of torch's generator (one broadcast on several
ranks); ``OrderView`` lists indices only when iterated.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
    default_convert,
)

from .._checks import SEED_LIMIT, check_seed
from ..distributed.world import World
from .sources.base import BatchSource
from .sources.streams import is_stream


class Viewed(Protocol):
    """What a sampler view reads of its loader (``DataLoader`` is one)."""

    dataset: Any
    batch_size: int | None
    rank: int
    world_size: int
    drop_last: bool
    seed: int
    _restored: bool  # the epoch protocol's: a restored position that yielded nothing yet

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...


def refuse_what_torch_refuses(dataset: Any, **arguments: Any) -> None:
    """Raise what ``torch.utils.data.DataLoader(dataset, **arguments)`` raises, if anything.

    An iterable that is not an ``IterableDataset`` (``unbroken.shuffle_buffer``, ``resumable``)
    is left to unbroken's checks: torch would take it for a map-style dataset."""
    if is_stream(dataset) and not isinstance(dataset, IterableDataset):
        return
    if arguments.get("shuffle") and _empty(dataset):
        # torch's RandomSampler refuses an empty dataset when it is built; unbroken orders the
        # dataset's length at each epoch's start (it may grow), so it takes an empty one.
        arguments = {**arguments, "shuffle": False}
    with warnings.catch_warnings():
        # Its warnings (too many workers, ...) come from the loader that runs, not this one.
        warnings.simplefilter("ignore")
        torch.utils.data.DataLoader(dataset, **arguments)


def _empty(dataset: Any) -> bool:
    try:
        return len(dataset) == 0
    except TypeError:
        return False


class OrderView(DistributedSampler):
    """``loader.sampler``: the indices of this rank's batches of the loader's current epoch, from
    the epoch's first batch, in the loader's order (it follows the loader's seed and epoch).
    Unlike torch's samplers it leaves out what ``drop_last`` drops: it lists what is read."""

    # DistributedSampler.__init__ is not called: it asks the process group for what the loader
    # already knows, and fixes seed and epoch, which here follow the loader (``follow``).
    def __init__(self, loader: Viewed, source: BatchSource, seed_given: bool) -> None:
        # The loader only weakly: it must be freed (and its workers stopped) as soon as the user
        # drops it, which a cycle through its own sampler would delay until a GC pass; the view
        # outlives it with the last seed and epoch it was told.
        self._loader_ref: Callable[[], Viewed | None] = weakref.ref(loader)
        self._source = source  # one that lists_indices
        self.dataset = loader.dataset
        self.num_replicas, self.rank = loader.world_size, loader.rank
        self.shuffle = bool(getattr(self._source, "shuffle", False))
        self.drop_last = loader.drop_last
        self.seed_given = seed_given
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

    def _batches(self) -> Iterator[Sequence[int]]:
        return self._source.epoch_indices(self._seed, self._epoch)

    def __iter__(self) -> Iterator[int]:
        for indices in self._batches():
            yield from indices

    def __len__(self) -> int:
        return self._source.epoch_length(self._seed, self._epoch)

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


def samplers(
    loader: Viewed, source: BatchSource, seed_given: bool, sampler: Any, batch_sampler: Any
) -> tuple[Any, Any]:
    """``sampler`` and ``batch_sampler`` as torch's DataLoader sets them: the user's, else the
    loader's own order seen as torch's samplers (``OrderView``, for a source that
    ``lists_indices``); none for an iterable dataset."""
    if is_stream(loader.dataset):
        return None, None
    if batch_sampler is not None:
        # As torch: set, and never used.
        return SequentialSampler(loader.dataset), batch_sampler
    if sampler is None and source.lists_indices:
        sampler = OrderView(loader, source, seed_given)
    if loader.batch_size is None or sampler is None:
        return sampler, None
    return sampler, BatchSampler(sampler, loader.batch_size, loader.drop_last)


def collate_of(collate_fn: Any, batch_size: int | None, batch_sampler: Any) -> Any:
    """``collate_fn`` as torch's DataLoader sets it: the user's, else torch's default."""
    if collate_fn is not None:
        return collate_fn
    auto_collation = batch_size is not None or batch_sampler is not None
    return default_collate if auto_collation else default_convert


def choose_seed(
    seed: int | None,
    generator: torch.Generator | None,
    taken: Adopted,
    ranks: tuple[int, int] | None,
) -> tuple[int, bool]:
    """The data seed and whether the user chose it (then a saved state must have the same)."""
    if seed is not None:
        check_seed("seed", seed)
        return seed, True
    if generator is not None:
        return generator.initial_seed() % SEED_LIMIT, True
    if taken.seed is not None:
        return taken.seed % SEED_LIMIT, taken.seed_given
    # The draw torch's RandomSampler would make from torch's global generator, so that
    # torch.manual_seed (or Lightning's seed_everything) reproduces the order and the samples'
    # randomness; made on a copy, so that building a loader never moves the training process's
    # draws (Lightning builds a val loader lazily, at a point a resumed run does not repeat).
    copy = torch.Generator()
    copy.set_state(torch.get_rng_state())
    drawn = int(torch.empty((), dtype=torch.int64).random_(generator=copy).item())
    if ranks is not None and ranks[1] > 1:
        drawn = _rank0_seed(drawn, ranks[1])
    return drawn, False


def _rank0_seed(drawn: int, world_size: int) -> int:
    """Rank 0's seed, so that every rank derives one global order even if their global
    generators differ: one broadcast, which every rank makes as it builds its loader."""
    world = World.current()
    if not world.initialized or world.size != world_size:
        raise ValueError(
            f"unbroken.DataLoader on {world_size} ranks needs seed= (or an initialized process "
            "group of that size, to take rank 0's): every rank derives the same global order "
            "from it"
        )
    box = [drawn]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])
