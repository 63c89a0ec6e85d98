"""``unbroken.DataLoader``: torch's DataLoader, resumable exactly; O(1) for map-style datasets.

It wraps a real ``torch.utils.data.DataLoader`` (workers, pinning, prefetching are torch's)
and gives it, for map-style datasets, a batch sampler that starts each epoch at a cursor and a
dataset wrapper that seeds every sample's RNGs from (seed, epoch, position); for iterable
datasets, a worker-side wrapper that batches, seeds and tags each batch with the worker's
dataset state (see the README, "Iterable datasets and other iterables"). The loader itself only
counts what it *yields*; batches prefetched by workers are never counted, so
``state_dict()`` describes exactly what the user received.

State: ``{"format", "version", "seed", "epoch", "samples", "batches", "source",
"fingerprint"}``, a few integers plus a user sampler's own state if it has one.
Per-batch cost, measured alone (benchmarks/RESULTS.md): ~1.7 us for a batch of 2 (the batch
sampler's generator, the fetch wrapper, a deque append/pop), plus the per-sample seeding
described in the README's "Randomness" section (``global_rngs`` chooses it) and, with
``num_workers=0``, ~1.2 us to put the training process's torch generator back.
"""

from __future__ import annotations

import secrets
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import SequentialSampler

from .fetch import SeededDataset
from .orders import Cursor, NativeOrder, UserBatchSampler, UserSampler
from .rng import GLOBAL_RNGS, check_global_rngs
from .shuffle import derive_key
from .._state import StateReader, mismatch, same
from .streams import SKIP, StreamSource, StreamWorker, _identity, is_stream
from .workers import signals_blocked, worker_init

FORMAT = "unbroken.DataLoader"
VERSION = 1
_FIELDS = {"format", "version", "seed", "epoch", "samples", "batches", "source", "fingerprint"}
_SEED_LIMIT = 1 << 64


class DataLoader:
    """A drop-in for ``torch.utils.data.DataLoader`` whose position survives a restart.

    Takes torch's arguments plus keyword-only ``seed`` and ``global_rngs``:

    - ``seed``: the run's data seed (an int in [0, 2**64)). The shuffle order and every
      sample's randomness derive from it. ``None`` picks a random one (or
      ``generator.initial_seed()`` if a ``generator`` is given); ``load_state_dict`` then
      adopts the saved seed, so a restarted run continues the same order.
    - ``global_rngs``: which process-global generators are seeded before each sample:
      any of ``("torch", "numpy", "random")`` (the default, all three). Leaving one out saves
      its seeding cost (about 1 us per sample for torch, 1.3 us for numpy, 3.5 us for
      ``random``; the README's "Randomness" section) but makes draws from it inside
      ``__getitem__`` depend on the worker, so they no longer repeat after a resume;
      ``unbroken.sample_rng()`` and ``unbroken.sample_seed()`` stay exact either way.

    ``iter(loader)`` continues the epoch a ``load_state_dict`` restored, and otherwise starts
    the next epoch (the first is epoch 0).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Iterable | None = None,
        batch_sampler: Iterable | None = None,
        num_workers: int = 0,
        collate_fn=None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        global_rngs: Iterable[str] = GLOBAL_RNGS,
    ) -> None:
        if not in_order:
            raise ValueError(
                "unbroken.DataLoader needs in_order=True: batches delivered out of order would make "
                "the received position ambiguous, so a resume could repeat or skip batches"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.global_rngs = check_global_rngs(global_rngs)
        self.seed = _check_seed(seed, generator)
        self._seed_given = seed is not None or generator is not None
        self.sampler, self.batch_sampler = sampler, batch_sampler
        stream = is_stream(dataset)
        if stream:
            self._order = _make_stream(dataset, batch_size, shuffle, sampler, batch_sampler,
                                       drop_last, num_workers)
            persistent_workers = False  # each epoch starts every worker from another state
        else:
            self._order = _make_order(dataset, batch_size, shuffle, sampler, batch_sampler, drop_last)

        # Progress: the epoch, what of it the user received, and whether an iteration of it is
        # open (started and not finished) or a loaded state waits for the next iter().
        self._epoch = 0
        self._cursor = self._new_cursor()
        self._open = False
        self._resume_pending = False
        self._done: deque = deque()  # (samples, sampler state) per batch drawn, not yet yielded

        # The inner loader draws its workers' base seed from this private generator, never from
        # torch's global one, so iterating a loader leaves the training process's RNG untouched.
        self._worker_seeds = torch.Generator()
        self._user_worker_init = worker_init_fn
        if stream:
            self._worker = StreamWorker(dataset, batch_size, drop_last, collate_fn, self.global_rngs)
            self._receive = self._order.receive
            batching = {"batch_size": None, "collate_fn": _identity}  # the worker batches itself
        else:
            self._worker, self._receive = SeededDataset(dataset, self.global_rngs), None
            plan = _EpochPlan(self)
            auto_batch = batch_size is not None or batch_sampler is not None
            batching = {
                "batch_size": 1 if auto_batch else None,  # torch's default, needed with batch_sampler
                "sampler": None if auto_batch else plan,
                "batch_sampler": plan if auto_batch else None,
                "collate_fn": collate_fn,
            }
        self._inner = torch.utils.data.DataLoader(
            self._worker,
            **batching,
            num_workers=num_workers,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,  # wrapped by __iter__, which starts the workers
            multiprocessing_context=multiprocessing_context,
            generator=self._worker_seeds,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )

    def __len__(self) -> int:
        """Batches in a whole epoch (like torch's DataLoader), not in what remains of it."""
        return len(self._order)

    @property
    def epoch(self) -> int:
        """The epoch the loader is in, or will start at the next ``iter()``."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` start ``epoch`` from its first batch.

        Whatever was open or restored is dropped. For code that numbers epochs itself (like
        ``DistributedSampler.set_epoch``) and for wrappers that end an epoch early, e.g.
        ``CombinedLoader`` in ``min_size`` mode.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch, self._cursor = epoch, self._new_cursor()
        self._open = self._resume_pending = False

    def _new_cursor(self) -> Cursor:
        return Cursor(source=self._order.fresh())

    def __iter__(self) -> Iterator:
        # An iteration that yielded a batch and was abandoned (a `break`) ends its epoch, as with
        # torch's DataLoader. One that yielded nothing does not: a loaded state stays pending and
        # an unstarted epoch stays unstarted, so an extra iter() (tqdm.auto makes one) is harmless.
        if self._open:
            self._end_epoch()
        self._done.clear()
        self._worker_seeds.manual_seed(derive_key(self.seed, self._epoch, 2))
        if self._receive is not None:  # iterable datasets: the workers need the epoch's plan
            self._worker.plan = self._order.plan(self.seed, self._epoch, self._cursor)
        if self.num_workers == 0:
            return self._yield(iter(self._inner))
        # Workers ignore the preemption signals, which the training process may handle now
        # but not when the loader was built; see _workers.
        self._inner.worker_init_fn = worker_init(self._user_worker_init)
        with signals_blocked():
            return self._yield(iter(self._inner))

    def _yield(self, batches: Iterator) -> Iterator:
        cursor, done, receive = self._cursor, self._done, self._receive
        try:
            for batch in batches:
                if receive is None:  # map-style: what the batch sampler recorded when drawn
                    cursor.samples, cursor.source = done.popleft()
                else:  # iterable: what the worker sent along with the batch
                    batch = receive(cursor, batch)
                    if batch is SKIP:
                        continue
                cursor.batches += 1
                self._open, self._resume_pending = True, False
                yield batch
        except GeneratorExit:
            # The loop let go of this iterator mid-epoch (a `break`; CPython closes it at once):
            # the epoch ends now, so a state taken after the loop starts the next one, as the
            # uninterrupted run's next iter() will.
            if cursor is self._cursor and self._open:
                self._end_epoch()
            raise
        # Only reached when the user's for-loop asks past the last batch: the epoch is over,
        # and a state taken now starts the next epoch (inside the loop it would not).
        if cursor is self._cursor:
            self._end_epoch()

    def _end_epoch(self) -> None:
        self._epoch += 1
        self._cursor = self._new_cursor()
        self._open = self._resume_pending = False

    def state_dict(self) -> dict:
        """What the user has received so far: JSON-serializable (``json.dumps`` works).

        Raises ``ValueError`` naming the key if a sampler's or dataset's own state cannot be
        saved as JSON (iterating never fails for it).
        """
        cursor = self._cursor
        self._order.check_saveable(cursor.source)
        return {
            "format": FORMAT,
            "version": VERSION,
            "seed": self.seed,
            "epoch": self._epoch,
            "samples": cursor.samples,
            "batches": cursor.batches,
            "source": cursor.source,
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` continue right after the last batch the saved loader yielded.

        Raises ``ValueError`` naming the field if the state is malformed (a field of the wrong
        type or out of range, counters that describe no position of an epoch, a source of
        another shape than this loader's order saves), from another version, or was saved
        with a different dataset length, seed, batch size, drop_last, shuffle or sampler.
        Nothing changes unless the whole state is valid.
        """
        what = "unbroken.DataLoader"
        reader = StateReader(state, what, _FIELDS, FORMAT, VERSION)
        saved_seed = reader.int("seed", 0, _SEED_LIMIT - 1)
        if self._seed_given and saved_seed != self.seed:
            raise mismatch(what, "seed", saved_seed, self.seed,
                           "Pass the saved seed, or seed=None to adopt it.")
        saved_print = reader.dict("fingerprint")
        current_print = self._fingerprint()
        for field, current in current_print.items():
            if field not in saved_print:
                raise ValueError(f"{what} state is malformed: fingerprint lacks '{field}'")
            if not same(saved_print[field], current):  # strictly: True is not 1
                raise mismatch(what, field, saved_print[field], current)
        if set(saved_print) != set(current_print):
            raise ValueError(f"{what} state field 'fingerprint': unexpected fields "
                             f"{sorted(set(saved_print) - set(current_print))}")
        cursor = Cursor(reader.int("samples"), reader.int("batches"), state["source"])
        self._order.check_cursor(cursor, what)
        epoch = reader.int("epoch")

        self.seed = saved_seed
        self._epoch, self._cursor = epoch, cursor
        self._resume_pending, self._open = True, False

    def _fingerprint(self) -> dict:
        return {
            "dataset_length": _length(self.dataset),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "global_rngs": list(self.global_rngs),
            **self._order.fingerprint(),
        }


class _EpochPlan(torch.utils.data.Sampler):
    """The batch sampler the inner torch loader iterates: the current epoch from its cursor."""

    def __init__(self, loader: DataLoader) -> None:
        # A weak reference: a cycle would leave freeing the loader (and shutting down persistent
        # workers, 5 s each) to the cycle collector, at some random later moment.
        self._loader = weakref.ref(loader)

    def __iter__(self) -> Iterator:
        loader = self._loader()
        # A copy: the loader's cursor moves as batches are yielded, this plan's start does not.
        start = Cursor(loader._cursor.samples, loader._cursor.batches, loader._cursor.source)
        return loader._order.batches(loader.seed, loader._epoch, start, loader._done)

    def __len__(self) -> int:
        return len(self._loader()._order)


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # a map-style dataset may lack __len__ when a sampler drives it
        return None


def _check_seed(seed: int | None, generator: torch.Generator | None) -> int:
    if seed is None:
        if generator is not None:
            return generator.initial_seed() % _SEED_LIMIT
        return secrets.randbits(63)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed


def _make_stream(dataset, batch_size, shuffle, sampler, batch_sampler, drop_last, num_workers):
    if shuffle or sampler is not None or batch_sampler is not None:
        raise ValueError(
            "an IterableDataset orders itself: shuffle, sampler and batch_sampler must be left "
            "unset (for an exact shuffle of a stream, see unbroken.shuffle_buffer)"
        )
    _check_batch_size(batch_size)
    return StreamSource(dataset, batch_size, drop_last, num_workers)


def _check_batch_size(batch_size: Any) -> None:
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size <= 0):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")


def _make_order(dataset, batch_size, shuffle, sampler, batch_sampler, drop_last):
    _check_batch_size(batch_size)
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
        if isinstance(sampler, SequentialSampler) and sampler.data_source is dataset:
            return NativeOrder(len(dataset), batch_size, drop_last, shuffle=False)
        return UserSampler(sampler, batch_size, drop_last)
    return NativeOrder(len(dataset), batch_size, drop_last, shuffle=bool(shuffle))
