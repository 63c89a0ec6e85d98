"""The torch DataLoader inside an ``unbroken.DataLoader``, and how it is started for a place.

``InnerLoader`` owns what runs the batches: the source (``sources``), the real
``torch.utils.data.DataLoader`` iterating it, the private generator that loader draws its
workers' base seed from, the user's ``worker_init_fn``, the hand-off of persistent workers
between iterations, and the dataset's read plan. ``start`` gives a ``Started`` iteration of the
torch loader for one (seed, epoch, cursor); the loader's iterator (``iterator``) moves the
cursor as batches are received.

Cost, once per iteration: one generator seeded, the source's ``begin``, torch's ``iter()``
(which starts the workers) and, for a dataset that plans its reads, its ``plan_reads``. Nothing
per batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from . import keys
from .sources.base import BatchSource, Cursor, Receiver
from .workers import signals_blocked, worker_init

# The start of torch's warning as it creates an iterator with more workers than CPUs.
_TOO_MANY_WORKERS = r"This DataLoader will create \d+ worker processes in total"


class InnerLoader:
    """torch's loader around ``source``, started for a place of an epoch (``start``)."""

    def __init__(
        self,
        source: BatchSource,
        dataset: Any,
        batch_size: int | None,
        collate_fn: Any,
        global_rngs: tuple[str, ...],
        **torch_arguments: Any,
    ) -> None:
        """``torch_arguments``: torch's DataLoader arguments that are not about batching
        (``num_workers``, ``pin_memory``, ..., ``persistent_workers``), as the user gave them."""
        self.source, self.dataset = source, dataset
        self.num_workers: int = torch_arguments["num_workers"]
        if not source.allows_persistent_workers:
            torch_arguments["persistent_workers"] = False
        # The torch loader draws its workers' base seed from this private generator, never from
        # torch's global one, so iterating a loader leaves the training process's RNG untouched.
        self._worker_seeds = torch.Generator()
        self._user_worker_init = torch_arguments["worker_init_fn"]
        torch_dataset, batching = source.torch_dataset(dataset, collate_fn, batch_size, global_rngs)
        self.torch = torch.utils.data.DataLoader(
            torch_dataset, **batching, **torch_arguments, generator=self._worker_seeds
        )
        self._on_workers: Started | None = None  # the iteration on persistent workers
        self.reported_length: int | None = None  # len(dataset) of a stream, once len() asked

    def __getstate__(self) -> dict[str, Any]:
        # A copy has no iteration open, so none of its iterations runs on these workers.
        return {**self.__dict__, "_on_workers": None}

    def length_asked(self) -> None:
        """``len(loader)`` was asked: torch warns, from then on, when a stream yields more."""
        if self.source.warns_past_length:
            self.reported_length = len(self.dataset)

    def follow_length(self) -> None:
        """An epoch starts: the source orders the dataset's length now, if it orders it."""
        self.source.follow_length(self.dataset)

    def start(self, seed: int, epoch: int, cursor: Cursor, primed: Started | None) -> Started:
        """The torch loader's iteration of ``epoch`` from ``cursor``: ``primed`` (started ahead,
        at ``iter()``) if it reads the same batches, else a new one."""
        if cursor.batches == 0:
            self.follow_length()
        if primed is None:
            return self._launch(seed, epoch, cursor)
        if primed.key == self._key(seed, epoch, cursor):
            return primed
        primed.close()  # a set_epoch or load_state_dict came between iter() and next()
        # torch warned of too many workers as iter() started them; it would not warn again.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _TOO_MANY_WORKERS, UserWarning)
            return self._launch(seed, epoch, cursor)

    def plan_reads(self, started: Started, seed: int, epoch: int, cursor: Cursor) -> None:
        """Tell a dataset that plans its reads (a streaming dataset's prefetch) the exact future
        order, once the workers exist (so no thread of it is forked into them), from the cursor
        the user's batches move; the plan is closed with ``started``."""
        started.plan = self.source.plan_reads(seed, epoch, cursor)

    def _key(self, seed: int, epoch: int, cursor: Cursor) -> tuple:
        """What an iteration's batches are a function of."""
        n = self.source.ordered_length()
        return (seed, epoch, cursor.samples, cursor.batches, repr(cursor.source), n)

    def _launch(self, seed: int, epoch: int, cursor: Cursor) -> Started:
        if cursor.batches == 0:
            self.follow_length()
        key = self._key(seed, epoch, cursor)
        self._worker_seeds.manual_seed(keys.torch_workers(seed, epoch))
        receive = self.source.begin(seed, epoch, cursor)
        if self.num_workers == 0:
            batches = iter(self.torch)
        else:
            # Workers ignore the preemption signals, which the training process may handle now
            # but not when the loader was built; see workers.
            self.torch.worker_init_fn = worker_init(self._user_worker_init)
            with signals_blocked():
                batches = iter(self.torch)
        started = Started(key, batches, receive)
        if self.torch.persistent_workers:  # one torch iterator, reset by every iter()
            previous, self._on_workers = self._on_workers, started
            if previous is not None and previous.batches is batches:
                previous.batches = DETACHED
        return started


class Started:
    """An iteration of the torch loader, started for one (seed, epoch, cursor): ``key``."""

    def __init__(self, key: tuple, batches: Iterator[Any], receive: Receiver) -> None:
        self.key, self.batches, self.receive = key, batches, receive
        self.plan: Any = None  # the dataset's plan_reads of it, closed with it

    def close(self) -> None:
        plan, self.plan = self.plan, None
        if plan is not None:
            plan.close()
        self.batches = _CLOSED  # torch's iterator, freed, shuts its workers down


class _Detached:
    """``batches`` of a started iteration whose persistent workers a newer one took over."""

    def __init__(self, closed: bool = False) -> None:
        self.closed = closed

    def __iter__(self) -> _Detached:
        return self

    def __next__(self) -> Any:
        if self.closed:
            raise StopIteration
        raise RuntimeError(
            "unbroken.DataLoader: with persistent_workers=True the loader has one set of "
            "workers, and a newer iteration of it has taken them over (torch's loader resets "
            "them too): this iteration cannot go on. Finish or drop an iteration before "
            "starting another, or build the loader with persistent_workers=False to iterate "
            "it twice at once"
        )


_CLOSED = _Detached(closed=True)
DETACHED = _Detached()
