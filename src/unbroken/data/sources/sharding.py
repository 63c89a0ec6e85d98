"""Data parallelism for map-style datasets: each rank's share of one global order.

Every rank derives the same global order from (seed, epoch), as a single process would (the
same shuffle, the same seeds: a batch's are those of its first position, and rank r's batches
are positions [m * B, (m + 1) * B) of that order whatever W is). Global batch k is positions
[k * B * W, (k + 1) * B * W) of that order for ``batch_size`` B and W ranks; rank r receives
positions [k * B * W + r * B, k * B * W + (r + 1) * B). The loader's state is the *global*
cursor (samples and global batches received), identical on every rank, so any rank's state
resumes any rank, and on any number of ranks: a job saved on W ranks continues on W' ranks at
the same global position, with global batches of B * W' from there on. Over the epoch no
sample is repeated or skipped (apart from the padding below), whatever W was at each moment.

Stays fixed across a resume: ``batch_size`` per rank, the dataset, ``seed``, ``shuffle``,
``drop_last``. Changes with W: the global batch size (so what a step averages over) and, with
more than one rank, the order in which gradients are reduced, so weights after a resume on
another world size are not bit for bit those of an uninterrupted run; the samples and their
randomness are.

The epoch's tail, as ``DistributedSampler`` does it, so that every rank yields the same number
of batches and none waits alone in a collective: with ``drop_last=True`` the last incomplete
global batch is dropped; otherwise it is split evenly, ``ceil(rest / W)`` samples per rank, and
ranks past the end repeat samples of that last global batch (their batches are seeded from
positions past the end, so a repeated sample is augmented anew). After a resume on another
world size the global batches count from the saved cursor, so ``drop_last`` drops the least it
can: what remains of the epoch modulo the new global batch (``tail_end``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np

from ...distributed.world import World
from ...errors import CorruptState
from .. import keys
from ..rng import make_seeder
from .base import Arguments, BatchSource, Cursor
from .fetch import Keys
from .orders import DatasetOrder, NativeOrder, Permutation, check_no_source
from .streams import RangeStream, StreamWorker, Tagged, read_items, reads_ranges, set_epoch

_BLOCK = 4096  # positions per numpy call, as in NativeOrder


def world_of(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` of ``World.given``, or None for a single process."""
    world = World.given(rank, world_size)
    return None if world is None else (world.rank, world.size)


def check_global_cursor(cursor: Cursor, n: int, what: str) -> None:
    """Global batches may have had other sizes (another world size saved the state), so the
    counters are checked against the epoch, not against this world's batch size."""
    check_no_source(cursor, what)
    ok = cursor.samples <= n and cursor.batches <= cursor.samples
    if not ok or (cursor.batches == 0) != (cursor.samples == 0):
        raise CorruptState(
            f"{what} state is inconsistent: samples={cursor.samples} and "
            f"batches={cursor.batches} do not describe a position of an epoch of {n} "
            "samples in batches of at least one sample; the state is corrupt"
        )


def tail_end(n: int, start: int, global_batch: int, drop_last: bool) -> int:
    """Where the epoch's batches end, read from the global cursor ``start``: with ``drop_last``
    after the last whole global batch from there (the global batch may have another size than
    the one that brought the cursor there: another world size saved it), else at ``n``."""
    if not drop_last:
        return n
    return start + max(0, n - start) // global_batch * global_batch


class ShardedOrder(NativeOrder):
    """Rank ``rank`` of ``world``'s share of the sequential or shuffled global order. Its
    fingerprint is NativeOrder's: a single process's state resumes on ranks, and back."""

    shared_by_ranks = True

    @classmethod
    def matches(cls, a: Arguments) -> bool:
        return a.ranks is not None

    @classmethod
    def build(cls, a: Arguments) -> BatchSource:
        assert a.ranks is not None
        order = DatasetOrder(a.dataset)
        shuffle = bool(a.shuffle)
        return cls(len(a.dataset), a.batch_size, a.drop_last, shuffle, *a.ranks, order)

    def __init__(
        self,
        n: int,
        batch_size: int | None,
        drop_last: bool,
        shuffle: bool,
        rank: int,
        world: int,
        order: DatasetOrder | None = None,
    ) -> None:
        self.rank, self.world = rank, world
        self.global_batch = (batch_size or 1) * world
        super().__init__(n, batch_size, drop_last, shuffle, order)

    def resize(self, n: int) -> None:
        self.n = n
        self.epoch_samples = n - n % self.global_batch if self.drop_last else n

    def __len__(self) -> int:
        return math.ceil(self.epoch_samples / self.global_batch)

    def epoch_length(self, seed: int, epoch: int) -> int:
        if self.world == 1:
            return self.epoch_samples
        return BatchSource.epoch_length(self, seed, epoch)  # counted: the tail is split

    def check_cursor(self, cursor: Cursor, what: str) -> None:
        check_global_cursor(cursor, self.n, what)

    def batches(self, seed: int, epoch: int, cursor: Cursor, done: deque) -> Iterator[Keys]:
        epoch_key = keys.samples(seed, epoch)
        shuffle = self.order.permutation(self.n, seed, epoch) if self.shuffle else None
        step, size = self.batch_size or 1, self.global_batch
        start = cursor.samples
        end = tail_end(self.n, start, size, self.drop_last)
        if start >= end:
            return  # saved at the epoch's end, or too little left for one global batch
        whole = (end - start) // size  # whole global batches left
        per_block = max(1, _BLOCK // step)
        for block in range(0, whole, per_block):
            count = min(per_block, whole - block)
            firsts = start + (block + np.arange(count)) * size + self.rank * step
            positions = (firsts[:, None] + np.arange(step)).reshape(-1)
            indices = self._indices(positions, shuffle)
            for j in range(count):
                done.append((start + (block + j + 1) * size, None))
                yield indices[j * step : (j + 1) * step], epoch_key, int(firsts[j])
        first = start + whole * size
        rest = end - first
        if rest and not self.drop_last:  # the last, incomplete global batch, split evenly
            share = -(-rest // self.world)
            positions = first + self.rank * share + np.arange(share)
            real = first + (positions - first) % rest  # past the end: repeat the batch's own
            indices = self._indices(real, shuffle)
            done.append((end, None))
            yield indices, epoch_key, int(positions[0])

    def _indices(self, positions: np.ndarray, shuffle: Permutation | None) -> list[int]:
        if shuffle is None:
            return positions.tolist()
        return shuffle.at(positions).tolist()


class ShardedRangeStream(RangeStream):
    """Rank ``rank`` of ``world``'s share of a global-cursor stream (``read_range`` and
    ``len()``): global batch k is items ``[c + k * B * W, c + (k + 1) * B * W)`` from the saved
    global cursor c, split over the ranks as ``ShardedOrder`` splits an epoch; within a rank,
    worker w reads global batches w, w + N, ... The length is needed so that every rank knows
    where the epoch's last global batch is and yields as many batches as the others."""

    shared_by_ranks = True

    @classmethod
    def matches(cls, a: Arguments) -> bool:
        return a.stream and a.ranks is not None and reads_ranges(a.dataset)

    @classmethod
    def build(cls, a: Arguments) -> BatchSource:
        assert a.ranks is not None
        return cls(a.dataset, a.batch_size, a.drop_last, a.num_workers, *a.ranks)

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None,
        drop_last: bool,
        num_workers: int,
        rank: int,
        world: int,
    ) -> None:
        super().__init__(dataset, batch_size, drop_last, num_workers)
        try:
            self.n = len(dataset)
        except TypeError:
            raise ValueError(
                f"a global-cursor stream on {world} ranks needs len(): every rank must know where "
                f"the epoch ends to yield as many batches as the others; give "
                f"{type(dataset).__qualname__} a __len__"
            ) from None
        self.rank, self.world = rank, world
        self.global_batch = (batch_size or 1) * world
        self.epoch_samples = self.n - self.n % self.global_batch if drop_last else self.n

    def __len__(self) -> int:
        return math.ceil(self.epoch_samples / self.global_batch)

    def check_cursor(self, cursor: Cursor, what: str) -> None:
        check_global_cursor(cursor, self.n, what)

    def plan(self, seed: int, epoch: int, cursor: Cursor) -> dict:
        return {"seed": seed, "epoch": epoch, "start": cursor.samples}

    def read(self, out: StreamWorker, worker: int, workers: int) -> Iterator[Tagged]:
        plan, step, size = out._unbroken_plan, self.batch_size or 1, self.global_batch
        set_epoch(self.dataset, plan["epoch"])
        seed = make_seeder(out._unbroken_rngs)
        key = keys.samples(plan["seed"], plan["epoch"])
        start = plan["start"]
        end = tail_end(self.n, start, size, self.drop_last)
        if start >= end:
            return
        index = worker
        while (first := start + index * size) < end:
            rest = min(size, end - first)
            share = step if rest == size else -(-rest // self.world)
            position = first + self.rank * share  # this rank's first position (maybe past end)
            batch: list = []
            for lo, hi in _wrapped(position, share, first, rest):  # past the end: wrap around
                read = partial(self.dataset.read_range, lo, hi)  # called once seeded
                batch += read_items(
                    read, hi - lo, seed, key, position + len(batch), out._unbroken_rngs
                )
            yield Tagged(out._unbroken_collate(batch, key, position), worker, first + rest, None)
            index += workers


def _wrapped(position: int, count: int, first: int, rest: int) -> list[tuple[int, int]]:
    """Positions [position, position + count) folded into [first, first + rest), as ranges."""
    ranges, offset = [], (position - first) % rest
    while count > 0:
        take = min(count, rest - offset)
        ranges.append((first + offset, first + offset + take))
        count, offset = count - take, 0
    return ranges
