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

- ``state_dict``/``load_state_dict`` (torch's Stateful protocol): restored in O(1), before
  ``iter()``, or after it for a dataset that is its own iterator (``__next__``; its ``__iter__``
  sets up the iteration state, as in torchdata's tests). A fresh epoch starts from the state
  the dataset had when the loader first iterated it (none, if ``state_dict()`` needs an
  attribute that ``__iter__`` creates). A state JSON cannot hold is refused by the loader's
  ``state_dict()``, not while iterating;
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

import copy
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate, default_convert, get_worker_info

from .rng import clear_sample, keep_main_torch_rng, make_seeder, sample_seed_at
from .shuffle import derive_key
from .._state import (COUNT_LIMIT, Unsaveable, check_int, check_user_state, encode_or_defer,
                     from_jsonable, has_state)

SKIP = object()  # what receive() returns for a placeholder (main process only: never pickled)
PLACEHOLDER = -1  # Tagged.items of a placeholder
_END = object()
_UNTAKEN = object()


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
        # A dataset that is its own iterator (``__iter__`` returns self, like torchdata's
        # CountIterCallsIter) sets up its iteration state in ``__iter__``: a saved state is
        # loaded after ``iter()``, or ``__iter__`` would overwrite it. Any other dataset's
        # iterator reads the dataset's state, which is therefore loaded before ``iter()``.
        self.self_iterating = callable(getattr(dataset, "__next__", None))
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
        items = self._start(plan, saved)
        counter = None
        count = saved["items"]
        seed = make_seeder(self.global_rngs)
        epoch_key = derive_key(plan["seed"], plan["epoch"], worker)
        step = self.batch_size or 1
        try:
            if self.kind == "sampler":
                dataset.sampler_iter = counter = _CountingIterator(dataset.sampler_iter)
                drawn = saved["state"]["sampler_indices"] if saved["state"] else 0
                for skipped in range(drawn):
                    if next(counter, _END) is _END:
                        raise self._shorter(worker, drawn, "sampler indices", skipped)
            elif self.kind == "replay":
                saved_rng = keep_main_torch_rng(self.global_rngs)
                for skipped in range(count):
                    seed(sample_seed_at(epoch_key, skipped))
                    if next(items, _END) is _END:
                        raise self._shorter(worker, count, "items", skipped)
                clear_sample(saved_rng)
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
                    # Refused only when the user asks for the state, never while iterating.
                    state = encode_or_defer(dataset.state_dict(), "dataset.state_dict()",
                                            "unbroken.DataLoader")
                elif counter is not None:
                    state = {"sampler_indices": counter.count}
                else:
                    state = None
                collated = self.collate_fn(batch if self.batch_size is not None else batch[0])
                yield Tagged(collated, worker, count, state)
        finally:
            clear_sample()

    def _start(self, plan: dict, saved: dict) -> Iterator:
        """Set the epoch and the worker's state on the dataset; return its iterator."""
        dataset, epoch = self.dataset, plan["epoch"]
        if self.kind != "stateful":
            _set_epoch(dataset, epoch)
            return iter(dataset)
        if saved["state"] is None:
            # A fresh epoch: the state as it was before the loader first iterated the dataset
            # (with num_workers=0 the same object would otherwise carry on), then the epoch.
            # None: the dataset had no state before its first __iter__, which sets it up.
            if plan["initial"] is not None:
                dataset.load_state_dict(copy.deepcopy(plan["initial"]))
            _set_epoch(dataset, epoch)
            return iter(dataset)
        # A resumed epoch: the epoch, then the saved state (which may carry an epoch of its own
        # and must win).
        _set_epoch(dataset, epoch)
        state = from_jsonable(saved["state"])
        if self.self_iterating:
            items = iter(dataset)
            dataset.load_state_dict(state)
            return items
        dataset.load_state_dict(state)
        return iter(dataset)

    def _shorter(self, worker: int, count: int, unit: str, found: int) -> ValueError:
        return ValueError(
            f"unbroken: the state says worker {worker} of {type(self.dataset).__qualname__} had "
            f"{'drawn' if unit != 'items' else 'yielded'} {count} {unit} this epoch, but it now "
            f"yields only {found}; the dataset is not deterministic, or shorter than the one that "
            "saved the state"
        )

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
        self._initial: Any = _UNTAKEN
        warn_if_buffer_shuffled(dataset)

    def fingerprint(self) -> dict:
        return {"sampler": f"stream:{self.resumes_by}", "shuffle": None}

    def __len__(self) -> int:
        n, step = len(self.dataset), self.batch_size or 1
        return n // step if self.drop_last else math.ceil(n / step)

    def fresh(self) -> dict | None:
        return None if self.resumes_by == "range" else fresh_workers(self.workers)

    def check_cursor(self, cursor: Any, what: str) -> None:
        """Refuse a source that no run of this loader saves; ``cursor``'s counters are ints."""
        source, step = cursor.source, self.batch_size or 1
        if self.resumes_by == "range":  # a global cursor: any number of workers resumes it
            consistent = (cursor.batches - 1) * step < cursor.samples <= cursor.batches * step
            if self.drop_last:
                consistent = cursor.samples == cursor.batches * step
            if source is not None or not (consistent or cursor.samples == cursor.batches == 0):
                raise ValueError(
                    f"{what} state is inconsistent: samples={cursor.samples}, "
                    f"batches={cursor.batches}, source={source!r:.100} for batches of {step}"
                )
            return
        field = f"{what} state field 'source"
        if not isinstance(source, dict) or set(source) != {"workers", "next"} or \
                not isinstance(source["workers"], list):
            raise ValueError(f"{field}': expected {{'workers': [...], 'next': int}}, "
                             f"got {source!r:.200}")
        workers = source["workers"]
        if len(workers) != self.workers:
            raise ValueError(
                f"{what}: the state was saved with num_workers={len(workers) if len(workers) > 1 else 0} "
                f"({len(workers)} dataset replicas) but this loader has {self.workers}. An iterable "
                "dataset's state is per worker replica and cannot be redistributed: resume with the "
                "same num_workers."
            )
        following = check_int(source["next"], f"{field}.next'", 0, len(workers) - 1)
        for i, entry in enumerate(workers):
            self._check_worker(entry, f"{field}.workers[{i}]")
        items = [entry["items"] for entry in workers]
        # Only a worker's last batch may be partial, and drop_last drops it: its batches are
        # its items in batches of `step`, rounded up.
        counts = [-(-n // step) for n in items]
        if self.drop_last and any(n % step for n in items):
            raise ValueError(f"{what} state is inconsistent: with drop_last, every worker's items "
                             f"{items} are whole batches of {step}; the state is corrupt")
        if cursor.samples != sum(items) or cursor.batches != sum(counts):
            raise ValueError(
                f"{what} state is inconsistent: samples={cursor.samples} and "
                f"batches={cursor.batches}, but the workers' items {items} make {sum(items)} "
                f"samples in {sum(counts)} batches of {step}; the state is corrupt"
            )
        self._check_round_robin(workers, counts, following, f"{field}'")
        if self.resumes_by == "replay" and any(items):
            warnings.warn(
                f"unbroken: {type(self.dataset).__qualname__} has no state_dict()/load_state_dict(), "
                "so resuming re-reads and skips the items each worker had consumed: this costs O(k) "
                "and is exact only if the dataset yields the same items again. Give it "
                "state_dict/load_state_dict to resume in O(1).",
                stacklevel=4,
            )

    def _check_worker(self, entry: Any, where: str) -> None:
        if not isinstance(entry, dict) or set(entry) != {"state", "items", "exhausted"}:
            raise ValueError(f"{where}': expected {{'state', 'items', 'exhausted'}}, "
                             f"got {entry!r:.200}")
        items = check_int(entry["items"], f"{where}.items'")
        if not isinstance(entry["exhausted"], bool):
            raise ValueError(f"{where}.exhausted': expected a bool, "
                             f"got {entry['exhausted']!r:.100}")
        state = entry["state"]
        if self.resumes_by == "replay":
            expected, ok = "null (the dataset has no state)", state is None
        elif self.resumes_by == "sampler":
            expected = "null before the worker's first item, then {'sampler_indices': int}"
            ok = state is None if items == 0 else (
                isinstance(state, dict) and set(state) == {"sampler_indices"}
                and not isinstance(state["sampler_indices"], bool)
                and isinstance(state["sampler_indices"], int)
                and 0 <= state["sampler_indices"] <= COUNT_LIMIT)
        else:  # the dataset's own state, taken after each of the worker's batches
            expected = "null before the worker's first item, then the dataset's state_dict()"
            ok = (state is None) == (items == 0)
            if state is not None:
                check_user_state(state, f"{where}.state'")
        if not ok:
            raise ValueError(f"{where}.state': expected {expected} with items={items}, "
                             f"got {state!r:.200}")

    @staticmethod
    def _check_round_robin(workers: list, counts: list, following: int, where: str) -> None:
        """Workers take turns by index, starting each cycle at worker 0, and the one at ``next``
        is live. With k the batches of that worker: live workers before it have k + 1, live
        ones after it k; an exhausted one found empty in this cycle (before it) at most k, one
        found empty in an earlier cycle (after it) at most k - 1."""
        live = [not entry["exhausted"] for entry in workers]
        k = counts[following]
        ok = live[following] and all(
            (count == k + (i < following)) if live[i] else (count <= k - (i > following))
            for i, count in enumerate(counts)
        )
        if not ok:
            exhausted = [entry["exhausted"] for entry in workers]
            raise ValueError(
                f"{where}: next={following}, the workers' batches {counts} and exhausted "
                f"{exhausted} are not a position of torch's round-robin over workers; the state "
                "is corrupt"
            )

    def check_saveable(self, source: Any) -> None:
        """Raise the refusal of a worker's dataset state that JSON cannot hold."""
        for entry in source["workers"] if isinstance(source, dict) else ():
            if isinstance(entry["state"], Unsaveable):
                raise entry["state"].error

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
        initial = self._initial_state()
        _set_epoch(self.dataset, epoch)
        if self.resumes_by == "range":
            return {"seed": seed, "epoch": epoch, "first_batch": cursor.batches}
        source = cursor.source
        return {"seed": seed, "epoch": epoch, "workers": source["workers"], "next": source["next"],
                "initial": initial}

    def _initial_state(self) -> Any:
        """The dataset's state before the loader first iterates it, from which each fresh epoch
        starts; taken at the first ``iter()``, not at construction, because torchdata-style
        datasets create the attributes their ``state_dict`` reads in ``__iter__``. ``None``
        (for those datasets): no state to restore, ``__iter__`` sets the epoch's start up."""
        if self._initial is _UNTAKEN:
            self._initial = None
            if self.resumes_by == "stateful":
                try:
                    self._initial = self.dataset.state_dict()
                except AttributeError:  # an attribute that __iter__ creates
                    pass
        return self._initial
