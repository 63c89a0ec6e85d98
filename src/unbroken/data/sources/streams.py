"""Iterable-dataset sources: each worker batches, seeds and tags its own items.

torch gives every worker its own replica of an iterable dataset and delivers their batches
round-robin (worker 0, 1, ..., 0, 1, ...; an exhausted worker drops out of the cycle). A
``StreamSource`` hands the inner torch loader a ``StreamWorker`` that, in each worker, batches
the items itself and sends every batch as a ``Tagged`` carrying what the main process records
when the batch is *received* (never when it is prefetched). Two kinds of stream:

- ``RangeStream`` (here): a *global-cursor* stream declares ``read_range(start, stop)`` (items
  [start, stop) of the epoch's stream, e.g. rows of Parquet row groups). Worker w reads global
  batches w, w + N, ...; the state is just the global cursor, ``num_workers`` may change on
  resume, and each item's randomness derives from (seed, epoch, global position), like a
  map-style dataset.
- per-worker streams (``worker_streams``): any other iterable; each replica's own state
  travels with its batches, and ``num_workers`` must stay the same on resume.

Randomness: before each batch, the global RNGs are seeded from the stream's key and the batch's
first position (``rng``), and again before its ``collate_fn`` (``fetch.SeededCollate``).
"""

from __future__ import annotations

import math
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch
from torch.utils.data import (
    Dataset,
    IterableDataset,
    default_collate,
    default_convert,
    get_worker_info,
)

from ...errors import CorruptState
from .. import keys
from ..rng import CURRENT, Seeder, clear_sample, keep_main_torch_rng, make_seeder
from .base import SKIP, Arguments, BatchSource, Cursor, Receiver
from .fetch import SeededCollate, StandIn
from .rank_checks import refuse_a_global_cursor

PLACEHOLDER = -1  # Tagged.items of a placeholder: a worker's turn that already came


class Tagged:
    """A batch from a worker, with what the main process records when it is received."""

    __slots__ = ("batch", "items", "state", "worker")

    def __init__(self, batch: Any, worker: int, items: int, state: Any) -> None:
        self.batch, self.worker, self.items, self.state = batch, worker, items, state

    def __reduce__(self) -> Any:
        return (Tagged, (self.batch, self.worker, self.items, self.state))

    def pin_memory(self) -> Tagged:  # torch's pin-memory thread calls this on custom types
        return Tagged(_pin(self.batch), self.worker, self.items, self.state)


def _pin(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.pin_memory()
    if isinstance(value, dict):
        return {key: _pin(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return (
            type(value)(_pin(item) for item in value)
            if not hasattr(value, "_fields")
            else type(value)(*(_pin(item) for item in value))
        )
    return value


def is_stream(dataset: Any) -> bool:
    """An IterableDataset, or any iterable object without ``__getitem__`` (e.g. a
    ``shuffle_buffer``): torch would treat the latter as map-style, so unbroken says so."""
    if isinstance(dataset, IterableDataset):
        return True
    return callable(getattr(dataset, "__iter__", None)) and not callable(
        getattr(dataset, "__getitem__", None)
    )


def reads_ranges(dataset: Any) -> bool:
    """A global-cursor stream: one that reads any range of its items (``read_range``)."""
    return callable(getattr(dataset, "read_range", None))


def set_epoch(dataset: Any, epoch: int) -> None:
    if callable(getattr(dataset, "set_epoch", None)):
        dataset.set_epoch(epoch)


def identity(batch: Any) -> Any:
    return batch


def read_items(
    items: Iterator | Callable[[], Iterable],
    count: int,
    seed: Seeder,
    key: int,
    position: int,
    global_rngs: tuple[str, ...],
) -> list:
    """Up to ``count`` items, a batch starting at ``position``: the RNGs are seeded once for it,
    and ``sample_seed()`` follows each item; in the training process itself, torch's generator
    is put back afterwards (see ``keep_main_torch_rng``). ``items`` given as a function is
    called after the seeding: a ``read_range`` that builds its items at once (returns a list)
    then draws from the seeded generators too, not from whatever state they had."""
    batch: list = []
    saved_rng = keep_main_torch_rng(global_rngs)
    seed(key, position)
    if callable(items):
        items = iter(items())
    current = CURRENT
    for item_position in range(position, position + count):
        current.position = item_position
        try:
            batch.append(next(items))
        except StopIteration:
            break
    clear_sample(saved_rng)
    return batch


class StreamWorker(StandIn, IterableDataset):
    """What the inner torch loader iterates: the source's batches, read in each worker. In a
    worker, ``get_worker_info().dataset``: it stands in for the user's dataset
    (``fetch.StandIn``)."""

    _OWN = frozenset(
        (
            "_unbroken_source",
            "_unbroken_dataset",
            "_unbroken_batch_size",
            "_unbroken_rngs",
            "_unbroken_collator",
            "_unbroken_plan",
        )
    )
    _STOOD_FOR = "_unbroken_dataset"

    def __init__(
        self,
        source: StreamSource,
        collate_fn: Any,
        batch_size: int | None,
        global_rngs: tuple[str, ...],
    ) -> None:
        self._unbroken_source, self._unbroken_dataset = source, source.dataset
        self._unbroken_batch_size, self._unbroken_rngs = batch_size, global_rngs
        self._unbroken_collator = SeededCollate(
            collate_fn or (default_collate if batch_size is not None else default_convert),
            global_rngs,
        )
        self._unbroken_plan: dict = {}  # set by the main process before each iter(): seed, ...

    def _unbroken_collate(self, batch: list, key: int, position: int) -> Any:
        """``batch`` collated, seeded for the batch starting at ``position`` under ``key``."""
        return self._unbroken_collator.keeping(
            batch if self._unbroken_batch_size is not None else batch[0], key, position
        )

    def __iter__(self) -> Iterator[Tagged]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        try:
            yield from self._unbroken_source.read(self, worker, workers)
        finally:
            clear_sample()


class StreamSource(BatchSource):
    """An iterable dataset as a source: the main-process side, and ``read`` for the workers."""

    tag: str  # saved in the fingerprint: how the stream resumes
    allows_persistent_workers = False  # each epoch starts every worker from another state
    warns_past_length = True

    @classmethod
    def build(cls, a: Arguments) -> BatchSource:
        return cls(a.dataset, a.batch_size, a.drop_last, a.num_workers)

    def __init__(
        self, dataset: Any, batch_size: int | None, drop_last: bool, num_workers: int
    ) -> None:
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.workers = max(1, num_workers)
        self._worker: StreamWorker | None = None

    def fingerprint(self) -> dict[str, Any]:
        return {"sampler": f"stream:{self.tag}", "shuffle": None}

    def __len__(self) -> int:
        n, step = len(self.dataset), self.batch_size or 1
        return n // step if self.drop_last else math.ceil(n / step)

    def torch_dataset(
        self, dataset: Any, collate_fn: Any, batch_size: int | None, global_rngs: tuple[str, ...]
    ) -> tuple[Dataset, dict[str, Any]]:
        self._worker = StreamWorker(self, collate_fn, batch_size, global_rngs)
        return self._worker, {"batch_size": None, "collate_fn": identity}  # workers batch

    def begin(self, seed: int, epoch: int, cursor: Cursor) -> Receiver:
        """The epoch is also set on the dataset here, in the main process, before the workers
        are forked: Hugging Face keeps it in shared memory and updates it with a non-atomic
        ``+=``, so two workers setting it at once could leave it wrong. Set beforehand, the
        workers' own ``set_epoch`` calls change nothing."""
        assert self._worker is not None, "torch_dataset() comes first"
        plan = self.plan(seed, epoch, cursor)
        set_epoch(self.dataset, epoch)
        self._worker._unbroken_plan = plan
        return self.receive

    @abstractmethod
    def plan(self, seed: int, epoch: int, cursor: Cursor) -> dict:
        """What every worker needs for this epoch (pickled to them): plain data."""

    @abstractmethod
    def receive(self, cursor: Cursor, tagged: Tagged) -> Any:
        """Record a received batch in ``cursor``; return the user's batch, or ``SKIP``."""

    @abstractmethod
    def read(self, out: StreamWorker, worker: int, workers: int) -> Iterator[Tagged]:
        """In worker ``worker`` of ``workers``: its batches of the planned epoch, tagged."""


class RangeStream(StreamSource):
    """A global-cursor stream (``read_range``): batch b is always items [b * B, (b + 1) * B)
    of the epoch, whoever reads it, so the round-robin yields batches in global order for any
    number of workers."""

    tag = "range"

    @classmethod
    def matches(cls, a: Arguments) -> bool:
        return a.stream and reads_ranges(a.dataset)

    def check_cursor(self, cursor: Cursor, what: str) -> None:
        step = self.batch_size or 1
        consistent = (cursor.batches - 1) * step < cursor.samples <= cursor.batches * step
        if self.drop_last:
            consistent = cursor.samples == cursor.batches * step
        if cursor.source is not None or not (consistent or cursor.samples == cursor.batches == 0):
            if cursor.source is None and hasattr(self.dataset, "__len__"):
                refuse_a_global_cursor(
                    cursor.samples, cursor.batches, step, len(self.dataset), what
                )
            raise CorruptState(
                f"{what} state is inconsistent: samples={cursor.samples}, "
                f"batches={cursor.batches}, source={cursor.source!r:.100} for batches of {step}"
            )

    def plan(self, seed: int, epoch: int, cursor: Cursor) -> dict:
        return {"seed": seed, "epoch": epoch, "first_batch": cursor.batches}

    def receive(self, cursor: Cursor, tagged: Tagged) -> Any:
        if tagged.items == PLACEHOLDER:
            return SKIP
        cursor.samples = tagged.items
        return tagged.batch

    def read(self, out: StreamWorker, worker: int, workers: int) -> Iterator[Tagged]:
        plan, step = out._unbroken_plan, self.batch_size or 1
        set_epoch(self.dataset, plan["epoch"])
        seed = make_seeder(out._unbroken_rngs)
        key = keys.samples(plan["seed"], plan["epoch"])
        batch_index = plan["first_batch"] + worker
        while True:
            start = batch_index * step
            batch = read_items(
                partial(self.dataset.read_range, start, start + step),
                step,
                seed,
                key,
                start,
                out._unbroken_rngs,
            )
            if not batch or (len(batch) < step and self.drop_last):
                return
            yield Tagged(out._unbroken_collate(batch, key, start), worker, start + len(batch), None)
            if len(batch) < step:
                return
            batch_index += workers


def warn_if_buffer_shuffled(dataset: Any) -> None:
    """Hugging Face ``datasets``' ``shuffle(buffer_size=...)`` loses its buffer on resume: it
    refills it and the samples that were buffered are gone for that epoch. Say so once."""
    if not type(dataset).__module__.startswith("datasets."):
        return
    # HF exposes no public flag; its example iterables form a chain through `ex_iterable`.
    node, depth = getattr(dataset, "_ex_iterable", None), 0
    while node is not None and depth < 64:
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            warnings.warn(
                "unbroken: this Hugging Face dataset is shuffled with shuffle(buffer_size=...), and "
                "HF drops the buffer's contents when it loads a state, so a resumed epoch loses up "
                "to buffer_size samples and differs from an uninterrupted run. For an exact, "
                "resumable shuffle, leave the dataset unshuffled and wrap it: "
                "unbroken.shuffle_buffer(dataset, size, seed=seed).",
                stacklevel=4,  # the user's DataLoader(...), through the loader's make_source
            )
            return
        node, depth = getattr(node, "ex_iterable", None), depth + 1
