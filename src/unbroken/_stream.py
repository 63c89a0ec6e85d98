"""Resuming ``IterableDataset``s: each worker's state travels with the batch it produced.

torch gives every worker its own replica of an iterable dataset and delivers their batches
round-robin (worker 0, 1, ..., 0, 1, ...; an exhausted worker drops out of the cycle). The
``StreamSource`` wraps the user's dataset so that, in each worker, it batches the items itself
and sends every batch as a ``Tagged`` with the worker's id, its item count and the dataset's
state right after that batch. The main process records a worker's state only when it *yields*
that worker's batch, so prefetched batches never advance the saved state.

The saved state: per worker ``{"state", "items", "exhausted"}`` plus ``next``, the worker whose
turn is next. On resume each worker restores its own state; workers before ``next`` in the
cycle first send a placeholder that the main process drops, so the round-robin continues at
the right worker without renumbering workers (a dataset that shards by ``get_worker_info()``
keeps its shard). How a worker's dataset resumes, by what it offers:

- ``state_dict``/``load_state_dict`` (torch's Stateful protocol): restored in O(1);
- the sampler pattern (``self.sampler``; ``__iter__`` sets ``self.sampler_iter``): the sampler
  iterator is wrapped to count indices, and a resume skips that many indices, not samples;
- neither: a resume re-reads and skips the worker's consumed items (O(k), with a warning).

Randomness: before each item, the global RNGs are seeded from (seed, epoch, worker, item count).
Per-worker states cannot be redistributed, so ``num_workers`` must stay the same on resume.

A *global-cursor* stream declares ``read_range(start, stop)`` (items [start, stop) of the epoch's
stream, e.g. rows of Parquet row groups). Then the loader shards by batch: worker w reads global
batches w, w + N, ..., the state is just the global cursor, ``num_workers`` may change on resume,
and each item's randomness derives from (seed, epoch, global position), like a map-style dataset.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate, default_convert, get_worker_info

from ._rng import clear_sample, keep_main_torch_rng, make_seeder, sample_seed_at
from ._shuffle import derive_key
from ._state import from_jsonable, has_state, to_jsonable

SKIP = object()  # what receive() returns for a placeholder (main process only: never pickled)
PLACEHOLDER = -1  # Tagged.items of a placeholder


class Tagged:
    """A batch from a worker, with what the main process records when it is yielded."""

    __slots__ = ("batch", "worker", "items", "state")

    def __init__(self, batch: Any, worker: int, items: int, state: Any) -> None:
        self.batch, self.worker, self.items, self.state = batch, worker, items, state

    def __reduce__(self):
        return (Tagged, (self.batch, self.worker, self.items, self.state))

    def pin_memory(self) -> Tagged:  # torch's pin-memory thread calls this on custom types
        return Tagged(_pin(self.batch), self.worker, self.items, self.state)


def _pin(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.pin_memory()
    if isinstance(value, dict):
        return {key: _pin(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_pin(item) for item in value) if not hasattr(value, "_fields") else \
            type(value)(*(_pin(item) for item in value))
    return value


def _set_epoch(dataset: Any, epoch: int) -> None:
    if callable(getattr(dataset, "set_epoch", None)):
        dataset.set_epoch(epoch)


def is_stream(dataset: Any) -> bool:
    """An IterableDataset, or any iterable object without ``__getitem__`` (e.g. a
    ``shuffle_buffer``): torch would treat the latter as map-style, so unbroken says so."""
    if isinstance(dataset, IterableDataset):
        return True
    return callable(getattr(dataset, "__iter__", None)) and not callable(getattr(dataset, "__getitem__", None))


def _identity(batch: Any) -> Any:
    return batch


def _kind(dataset: Any) -> str:
    if callable(getattr(dataset, "read_range", None)):
        return "range"
    if has_state(dataset):
        return "stateful"
    if hasattr(dataset, "sampler") and callable(getattr(dataset, "__next__", None)):
        return "sampler"
    return "replay"


def fresh_workers(count: int) -> dict:
    return {"workers": [{"state": None, "items": 0, "exhausted": False}] * count, "next": 0}


class _CountingIterator:
    """Counts what the dataset draws from its ``sampler_iter`` (the sampler pattern)."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator, self.count = iterator, 0

    def __iter__(self):
        return self

    def __next__(self):
        value = next(self.iterator)
        self.count += 1
        return value


class StreamWorker(IterableDataset):
    """What the inner torch loader iterates: the user's dataset, batched, seeded and tagged."""

    def __init__(self, dataset: Any, batch_size: int | None, drop_last: bool, collate_fn: Any,
                 global_rngs: tuple[str, ...]) -> None:
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.collate_fn = collate_fn or (default_collate if batch_size is not None else default_convert)
        self.global_rngs = global_rngs
        self.kind = _kind(dataset)
        # Each fresh epoch starts from the dataset's state as constructed, in every worker and
        # with num_workers=0 alike (where the same object would otherwise carry on).
        self.initial = dataset.state_dict() if self.kind == "stateful" else None
        self.plan: dict = {}  # set by the main process before each iter(): seed, epoch, workers

    def __iter__(self) -> Iterator[Tagged]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        plan, dataset = self.plan, self.dataset
        if self.kind == "range":
            _set_epoch(dataset, plan["epoch"])
            yield from self._read_ranges(worker, info.num_workers if info is not None else 1)
            return
        saved = plan["workers"][worker]
        if saved["exhausted"]:
            return
        if worker < plan["next"]:
            yield Tagged(None, worker, PLACEHOLDER, None)  # its turn in this cycle already came
        if self.kind == "stateful":
            # A fresh epoch: the state as constructed, then the epoch. A resumed one: the epoch,
            # then the saved state (which may carry an epoch of its own and must win).
            if saved["state"] is None:
                dataset.load_state_dict(self.initial)
                _set_epoch(dataset, plan["epoch"])
            else:
                _set_epoch(dataset, plan["epoch"])
                dataset.load_state_dict(from_jsonable(saved["state"]))
        else:
            _set_epoch(dataset, plan["epoch"])
        items = iter(dataset)
        counter = None
        if self.kind == "sampler":
            dataset.sampler_iter = counter = _CountingIterator(dataset.sampler_iter)
            for _ in range(saved["state"]["sampler_indices"] if saved["state"] else 0):
                next(counter)
        count = saved["items"]
        seed = make_seeder(self.global_rngs)
        epoch_key = derive_key(plan["seed"], plan["epoch"], worker)
        if self.kind == "replay":
            saved_rng = keep_main_torch_rng(self.global_rngs)
            for skipped in range(count):
                seed(sample_seed_at(epoch_key, skipped))
                next(items)
            clear_sample(saved_rng)
        step = self.batch_size or 1
        try:
            while True:
                batch, saved_rng = [], keep_main_torch_rng(self.global_rngs)
                for _ in range(step):
                    seed(sample_seed_at(epoch_key, count))
                    try:
                        batch.append(next(items))
                    except StopIteration:
                        break
                    count += 1
                clear_sample(saved_rng)
                if not batch or (len(batch) < step and self.drop_last):
                    return
                if self.kind == "stateful":
                    state = to_jsonable(dataset.state_dict(), "dataset.state_dict()")
                elif counter is not None:
                    state = {"sampler_indices": counter.count}
                else:
                    state = None
                collated = self.collate_fn(batch if self.batch_size is not None else batch[0])
                yield Tagged(collated, worker, count, state)
        finally:
            clear_sample()


    def _read_ranges(self, worker: int, workers: int) -> Iterator[Tagged]:
        """A global-cursor stream: worker w reads global batches first + w, first + w + N, ...

        Batch b is always items [b * B, (b + 1) * B) of the epoch's stream, whoever reads it, so
        the round-robin yields batches in global order for any number of workers."""
        plan, step = self.plan, self.batch_size or 1
        seed = make_seeder(self.global_rngs)
        epoch_key = derive_key(plan["seed"], plan["epoch"])
        batch_index = plan["first_batch"] + worker
        try:
            while True:
                start = batch_index * step
                items, batch = iter(self.dataset.read_range(start, start + step)), []
                saved_rng = keep_main_torch_rng(self.global_rngs)
                while len(batch) < step:
                    seed(sample_seed_at(epoch_key, start + len(batch)))
                    try:
                        batch.append(next(items))
                    except StopIteration:
                        break
                clear_sample(saved_rng)
                if not batch or (len(batch) < step and self.drop_last):
                    return
                collated = self.collate_fn(batch if self.batch_size is not None else batch[0])
                yield Tagged(collated, worker, start + len(batch), None)
                if len(batch) < step:
                    return
                batch_index += workers
        finally:
            clear_sample()


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
                stacklevel=3,
            )
            return
        node, depth = getattr(node, "ex_iterable", None), depth + 1


class StreamSource:
    """The main-process side: fingerprint, length, state checks, and recording what arrives."""

    kind = "stream"

    def __init__(self, dataset: Any, batch_size: int | None, drop_last: bool, num_workers: int) -> None:
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.workers = max(1, num_workers)
        self.resumes_by = _kind(dataset)
        warn_if_buffer_shuffled(dataset)

    def fingerprint(self) -> dict:
        return {"sampler": f"stream:{self.resumes_by}", "shuffle": None}

    def __len__(self) -> int:
        n, step = len(self.dataset), self.batch_size or 1
        return n // step if self.drop_last else math.ceil(n / step)

    def fresh(self) -> dict | None:
        return None if self.resumes_by == "range" else fresh_workers(self.workers)

    def check_cursor(self, cursor: Any, what: str) -> None:
        source = cursor.source
        if self.resumes_by == "range":  # a global cursor: any number of workers resumes it
            step = self.batch_size or 1
            consistent = (cursor.batches - 1) * step < cursor.samples <= cursor.batches * step
            if source is not None or not (consistent or cursor.samples == cursor.batches == 0):
                raise ValueError(
                    f"{what} state is inconsistent: samples={cursor.samples}, "
                    f"batches={cursor.batches}, source={source!r} for batches of {step}"
                )
            return
        workers = source.get("workers") if isinstance(source, dict) else None
        if not isinstance(workers, list) or not isinstance(source.get("next"), int):
            raise ValueError(f"{what} state field 'source': expected {{'workers': [...], 'next': int}}, "
                             f"got {source!r}")
        if len(workers) != self.workers:
            raise ValueError(
                f"{what}: the state was saved with num_workers={len(workers) if len(workers) > 1 else 0} "
                f"({len(workers)} dataset replicas) but this loader has {self.workers}. An iterable "
                "dataset's state is per worker replica and cannot be redistributed: resume with the "
                "same num_workers."
            )
        for entry in workers:
            ok = isinstance(entry, dict) and set(entry) == {"state", "items", "exhausted"} and \
                isinstance(entry["items"], int) and entry["items"] >= 0 and isinstance(entry["exhausted"], bool)
            if not ok:
                raise ValueError(f"{what} state field 'source': malformed worker entry {entry!r}")
        if not 0 <= source["next"] < len(workers):
            raise ValueError(f"{what} state field 'source': next={source['next']} is not a worker")
        if self.resumes_by == "replay" and any(e["items"] for e in workers):
            warnings.warn(
                f"unbroken: {type(self.dataset).__qualname__} has no state_dict()/load_state_dict(), "
                "so resuming re-reads and skips the items each worker had consumed: this costs O(k) "
                "and is exact only if the dataset yields the same items again. Give it "
                "state_dict/load_state_dict to resume in O(1).",
                stacklevel=4,
            )

    def receive(self, cursor: Any, tagged: Tagged) -> Any:
        """Record a yielded batch's worker state; placeholders are dropped (``SKIP``)."""
        if tagged.items == PLACEHOLDER:
            return SKIP
        if self.resumes_by == "range":
            cursor.samples = tagged.items
            return tagged.batch
        source = cursor.source
        workers = list(source["workers"])
        count, worker = len(workers), tagged.worker
        # Round-robin: live workers whose turn came before this one's without a batch are done.
        position = source["next"]
        while position != worker:
            if not workers[position]["exhausted"]:
                workers[position] = dict(workers[position], exhausted=True)
            position = (position + 1) % count
        added = tagged.items - workers[worker]["items"]
        workers[worker] = {"state": tagged.state, "items": tagged.items, "exhausted": False}
        following = (worker + 1) % count
        while workers[following]["exhausted"] and following != worker:
            following = (following + 1) % count
        cursor.source = {"workers": workers, "next": following}
        cursor.samples += added
        return tagged.batch

    def plan(self, seed: int, epoch: int, cursor: Any) -> dict:
        """What every worker needs for this epoch; called just before the workers start.

        The epoch is also set on the dataset here, in the main process, before the workers are
        forked: Hugging Face keeps it in shared memory and updates it with a non-atomic ``+=``,
        so two workers setting it at once could leave it wrong. Set beforehand, the workers'
        own ``set_epoch`` calls change nothing.
        """
        _set_epoch(self.dataset, epoch)
        if self.resumes_by == "range":
            return {"seed": seed, "epoch": epoch, "first_batch": cursor.batches}
        source = cursor.source
        return {"seed": seed, "epoch": epoch, "workers": source["workers"], "next": source["next"]}
