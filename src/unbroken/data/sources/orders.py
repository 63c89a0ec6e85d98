"""Map-style sources: each epoch is batches of dataset indices, starting at any cursor.

An epoch's *global order* is the sequence of dataset indices it visits; the loader's cursor
counts how much of it the user has received. An ``IndexSource`` turns (seed, epoch, cursor)
into the remaining batches (``batches``); the inner torch loader draws them through
``_EpochPlan``, its batch sampler, and fetches them through ``SeededDataset``, which seeds
each batch from (seed, epoch, its first position). Every batch drawn is recorded (in ``done``) with the
cursor it leads to, and the cursor moves to it when the batch is *received*, so batches that
workers prefetched never count.

- ``NativeOrder`` (here): ``shuffle`` on or off, with unbroken's per-index shuffle. Batches are
  contiguous runs of positions, so starting at sample k computes nothing before k.
  A dataset may bring its own shuffle and plan its reads (``DatasetOrder``, e.g.
  ``unbroken.streaming.StreamingDataset``).
- ``UserSampler``/``UserBatchSampler`` (``samplers``): the user's sampler or batch sampler.
"""

from __future__ import annotations

import itertools
import math
from abc import abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate, default_convert

from ...errors import CorruptState
from .. import keys
from ..bijection import IndexShuffle
from .base import Arguments, BatchSource, Cursor, Receiver
from .fetch import Keys, SeededDataset, passed
from .rank_checks import refuse_a_global_cursor

# Indices are computed in blocks of at least this many positions: one numpy call per block
# keeps the per-index cost low (row ``order_index`` of docs/benchmarks/unit-costs.md) without
# holding more than a block in memory.
_BLOCK = 4096


class Permutation(Protocol):
    """An epoch's shuffled order: positions of the epoch → dataset indices, any position at
    the same cost (``IndexShuffle`` is one)."""

    def at(self, positions: np.ndarray) -> np.ndarray: ...

    def range(self, start: int, stop: int) -> list[int]: ...


class DatasetOrder:
    """What a map-style dataset may tell the loader about its order, through three optional
    methods (``unbroken.streaming.StreamingDataset`` has all three):

    - ``shuffle_order(key) -> Permutation``: the epoch's shuffle for ``shuffle=True``, in place
      of unbroken's uniform per-index shuffle (e.g. one that keeps reads local to a few
      shards); ``key`` is the epoch's shuffle key, so it stays a pure function of (seed, epoch).
    - ``order_fingerprint() -> dict``: JSON values the loader's state records under
      ``"dataset"``; a state resumes only where they are equal (the same shards, windows).
    - ``plan_reads(batches, received)``: called at the start of each iteration, after the
      workers started, with this rank's remaining batches of indices (a lazy iterator, the
      exact future order) and ``received()``, how many of them the user has received so far.
      It returns an object whose ``close()`` the loader calls when the iteration ends (to
      download ahead what will be read next).
    """

    def __init__(self, dataset: Any) -> None:
        self.shuffle = _method(dataset, "shuffle_order")
        fingerprint = _method(dataset, "order_fingerprint")
        self.fingerprint = fingerprint() if fingerprint is not None else None
        self.plan_reads = _method(dataset, "plan_reads")

    def permutation(self, n: int, seed: int, epoch: int) -> Permutation:
        key = keys.shuffle(seed, epoch)
        return self.shuffle(key) if self.shuffle is not None else IndexShuffle(n, key)


def _method(dataset: Any, name: str) -> Any:
    method = getattr(dataset, name, None)
    return method if callable(method) else None


class IndexSource(BatchSource):
    """A map-style source: the epoch's batches of indices, each recorded when it is drawn."""

    batched_by_user = False  # a batch_sampler: torch must batch even with batch_size=None
    lists_indices = True

    def __init__(self) -> None:
        self._plan: tuple[int, int, Cursor, deque] | None = None

    @abstractmethod
    def batches(self, seed: int, epoch: int, cursor: Cursor, done: deque) -> Iterator[Keys]:
        """The epoch's batches from ``cursor``; before yielding one, append to ``done`` the
        ``(samples, source)`` the cursor holds once that batch is received."""

    def epoch_indices(self, seed: int, epoch: int) -> Iterator[Sequence[int]]:
        start = Cursor(source=self.fresh())
        return (keys[0] for keys in self.batches(seed, epoch, start, deque()))

    def torch_dataset(
        self, dataset: Any, collate_fn: Any, batch_size: int | None, global_rngs: tuple[str, ...]
    ) -> tuple[Dataset, dict[str, Any]]:
        plan = _EpochPlan(self)
        auto_batch = batch_size is not None or self.batched_by_user
        collate = collate_fn or (default_collate if auto_batch else default_convert)
        # The fetch collates, seeded for the batch; its errors come back as a Failed batch,
        # counted when received (iterator).
        return SeededDataset(dataset, global_rngs, collate), {
            "batch_size": 1 if auto_batch else None,  # torch's default, needed with batch_sampler
            "sampler": None if auto_batch else plan,
            "batch_sampler": plan if auto_batch else None,
            "collate_fn": passed,
        }

    def begin(self, seed: int, epoch: int, cursor: Cursor) -> Receiver:
        done: deque = deque()  # (samples, source) per batch drawn and not yet received
        # A copy: the loader's cursor moves as batches are received, this plan's start does not.
        self._plan = (seed, epoch, cursor.copy(), done)

        def receive(cursor: Cursor, batch: Any) -> Any:
            cursor.samples, cursor.source = done.popleft()
            return batch

        return receive


class _EpochPlan(torch.utils.data.Sampler):
    """The batch sampler the inner torch loader iterates: the planned epoch from its cursor.
    torch asks for its iterator inside ``iter(inner_loader)``, right after ``begin``."""

    def __init__(self, source: IndexSource) -> None:
        self._source = source  # no cycle: the source does not refer to the loader

    def __iter__(self) -> Iterator[Keys]:
        plan = self._source._plan
        assert plan is not None, "begin() plans the epoch before the inner loader iterates"
        return self._source.batches(*plan)

    def __len__(self) -> int:
        return len(self._source)


class NativeOrder(IndexSource):
    """Sequential or shuffled order over a map-style dataset of length ``n``: unbroken's own,
    for a map-style dataset without a sampler (the last of ``SOURCES``: it matches any)."""

    @classmethod
    def matches(cls, a: Arguments) -> bool:
        return True

    @classmethod
    def build(cls, a: Arguments) -> BatchSource:
        order = DatasetOrder(a.dataset)
        return cls(len(a.dataset), a.batch_size, a.drop_last, bool(a.shuffle), order)

    def __init__(
        self,
        n: int,
        batch_size: int | None,
        drop_last: bool,
        shuffle: bool,
        order: DatasetOrder | None = None,
    ) -> None:
        super().__init__()
        self.batch_size, self.drop_last, self.shuffle = batch_size, drop_last, shuffle
        self.order = order or DatasetOrder(None)
        self.resize(n)

    def resize(self, n: int) -> None:
        """Order ``n`` samples from now on."""
        step = self.batch_size or 1
        self.n, self.epoch_samples = n, n - n % step if self.drop_last else n

    def follow_length(self, dataset: Any) -> None:
        if self.n != (n := len(dataset)):
            self.resize(n)

    def ordered_length(self) -> int:
        return self.n

    def epoch_length(self, seed: int, epoch: int) -> int:
        return self.epoch_samples

    def fingerprint(self) -> dict[str, Any]:
        if self.order.fingerprint is None:  # the fields of every state since version 1
            return {"sampler": "unbroken", "shuffle": self.shuffle}
        return {"sampler": "unbroken", "shuffle": self.shuffle, "dataset": self.order.fingerprint}

    def __len__(self) -> int:
        return math.ceil(self.epoch_samples / (self.batch_size or 1))

    def check_cursor(self, cursor: Cursor, what: str) -> None:
        check_no_source(cursor, what)
        step = self.batch_size or 1
        expected = min(cursor.batches * step, self.epoch_samples)
        if cursor.samples != expected or cursor.batches > len(self):
            refuse_a_global_cursor(cursor.samples, cursor.batches, step, self.n, what)
            raise CorruptState(
                f"{what} state is inconsistent: samples={cursor.samples} and "
                f"batches={cursor.batches} do not describe a position of an epoch of "
                f"{self.epoch_samples} samples in batches of {step}; the state is corrupt"
            )

    def plan_reads(self, seed: int, epoch: int, cursor: Cursor) -> Any:
        """The dataset's ``plan_reads`` (``DatasetOrder``) of this iteration's batches."""
        if self.order.plan_reads is None:
            return None
        start = cursor.batches
        future = self.batches(seed, epoch, cursor.copy(), deque(maxlen=1))
        return self.order.plan_reads((list(b[0]) for b in future), lambda: cursor.batches - start)

    def batches(self, seed: int, epoch: int, cursor: Cursor, done: deque) -> Iterator[Keys]:
        epoch_key = keys.samples(seed, epoch)
        step = self.batch_size or 1
        shuffle = self.order.permutation(self.n, seed, epoch) if self.shuffle else None
        block = step * max(1, _BLOCK // step)
        start, end = cursor.samples, self.epoch_samples
        # The first block is one batch: the first batch after a resume waits for nothing more.
        starts = itertools.chain((start,), range(start + step, end, block)) if start < end else ()
        for block_start in starts:
            block_end = min(block_start + (step if block_start == start else block), end)
            indices: range | list[int]
            if shuffle is None:
                indices = range(block_start, block_end)
            else:
                indices = shuffle.range(block_start, block_end)
            for offset in range(0, block_end - block_start, step):
                first = block_start + offset
                last = min(first + step, block_end)
                done.append((last, None))
                yield indices[offset : offset + step], epoch_key, first


def check_no_source(cursor: Cursor, what: str) -> None:
    """Refuse a cursor with a source part: unbroken's own orders keep none."""
    if cursor.source is not None:
        raise CorruptState(
            f"{what} state field 'source': expected null (unbroken's own order "
            f"keeps no sampler state), got {cursor.source!r:.200}",
            "source",
        )
