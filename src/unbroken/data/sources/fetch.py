"""The dataset the inner torch DataLoader sees: the user's, with each batch's RNGs seeded.

torch's fetcher hands a whole batch of keys to ``__getitems__``. We seed the chosen global
generators once, from (epoch key, the batch's first position), then call the user's
``__getitem__`` for each sample, telling ``sample_seed()``/``sample_rng()`` which position is
being fetched, so the batch's random transforms do not depend on which worker runs it. A user
dataset with its own ``__getitems__`` (batched reads) keeps it: it is called once per batch,
with ``sample_seed()`` the batch's first position's.

The user's ``collate_fn`` runs there too, through ``SeededCollate``, which seeds the
generators for it from the same key and position (``rng.collate_seeds``): so its draws (a
masking collator's) follow the batch, not the process it runs in, and torch's own
``collate_fn`` only passes the batch on. Iterable datasets' workers call a ``SeededCollate``
likewise (``streams``).

The dataset the inner torch loader holds stands in for the user's dataset (``StandIn``).

Inside a worker, torch's ``get_worker_info().dataset`` is the dataset the inner torch loader
was given: unbroken's wrapper (``SeededDataset``, ``StreamWorker``), not the user's. Code
written for torch's DataLoader reads and configures the user's dataset there: torch's recipe
splits an ``IterableDataset`` across workers in ``worker_init_fn`` by setting
``get_worker_info().dataset.start``, and a map-style dataset may open a file handle per worker.
So the wrapper stands in for the user's dataset copy in that process: ``isinstance`` and
attribute reads and writes go to it (as with ``unittest.mock``'s ``spec``, ``isinstance``
consults ``__class__``); only ``type()`` tells them apart.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import (
    Dataset,
    IterableDataset,
    default_collate,
    default_convert,
    get_worker_info,
)

from ..rng import CURRENT, clear_sample, collate_seeds, keep_main_torch_rng, make_seeder

# A batch as the inner torch loader's batch sampler yields it and a worker receives it: the
# dataset indices, the epoch's key and the position of its first sample in the epoch's global
# order. A plain tuple: one is built per batch, and a class of our own costs more (rows
# ``batch_keys_tuple`` and ``batch_keys_class`` of docs/benchmarks/unit-costs.md).
Keys = tuple[Sequence[int], int, int]

_DUNDER = ("__", "__")


class StandIn:
    """A wrapper that stands in for the user's dataset. Its own attributes are named in
    ``_OWN``, with a prefix no user's dataset has (``_unbroken_``), since every other name
    reads and writes the user's; ``_STOOD_FOR`` names the one that holds the user's dataset."""

    _OWN: frozenset[str] = frozenset()
    _STOOD_FOR: str

    def _user(self) -> Any:
        # From __dict__, not through __getattr__: while unpickling, it is not there yet.
        try:
            return self.__dict__[self._STOOD_FOR]
        except KeyError:
            raise AttributeError("the user's dataset is not set yet") from None

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        mine = type(self)
        try:
            theirs = type(self._user())
        except AttributeError:
            return mine
        # Never a class that would make torch take the wrapper for another kind of dataset.
        if issubclass(theirs, IterableDataset) != issubclass(mine, IterableDataset):
            return mine
        return theirs

    def __getattr__(self, name: str) -> Any:  # only for names the wrapper does not have
        if name.startswith(_DUNDER[0]) and name.endswith(_DUNDER[1]):
            raise AttributeError(name)
        return getattr(self._user(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._user(), name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._OWN:
            object.__delattr__(self, name)
        else:
            delattr(self._user(), name)

    def __reduce__(self) -> tuple:
        # pickle would take __class__ for the class to rebuild: name the wrapper's own.
        state = self.__getstate__() if "__getstate__" in type(self).__dict__ else self.__dict__
        return (_rebuild, (type(self),), state)


def _rebuild(cls: type) -> Any:
    return object.__new__(cls)


class SeededDataset(StandIn, Dataset):
    """In a worker, ``get_worker_info().dataset``: it stands in for the user's dataset there
    (``StandIn``)."""

    _OWN = frozenset(
        (
            "_unbroken_dataset",
            "_unbroken_rngs",
            "_unbroken_seed",
            "_unbroken_getitems",
            "_unbroken_collate",
        )
    )
    _STOOD_FOR = "_unbroken_dataset"

    def __init__(
        self, dataset: Any, global_rngs: tuple[str, ...], collate_fn: Callable[[Any], Any]
    ) -> None:
        self._unbroken_dataset = dataset
        self._unbroken_rngs = global_rngs
        self._unbroken_seed = make_seeder(global_rngs)
        batched = getattr(dataset, "__getitems__", None)
        self._unbroken_getitems = batched if callable(batched) else None
        self._unbroken_collate = SeededCollate(collate_fn, global_rngs)

    def __getstate__(self) -> dict:  # the seeder is a closure: rebuild it in each worker
        return {
            "dataset": self._unbroken_dataset,
            "global_rngs": self._unbroken_rngs,
            "collate_fn": self._unbroken_collate.collate_fn,
        }

    def __setstate__(self, state: dict) -> None:
        SeededDataset.__init__(self, state["dataset"], state["global_rngs"], state["collate_fn"])

    def __len__(self) -> int:
        return len(self._unbroken_dataset)

    def __getitems__(self, keys: Keys) -> Any:
        """The batch at ``keys``, collated (torch's ``collate_fn`` passes it on), or a
        ``Failed`` if the user's code raised."""
        indices, key, start = keys
        current = CURRENT
        # Put back below, in the main process, after the collate: it draws from the generators.
        saved = keep_main_torch_rng(self._unbroken_rngs)
        try:
            self._unbroken_seed(key, start)
            if self._unbroken_getitems is not None:
                samples = self._unbroken_getitems(list(indices))
            else:
                dataset, samples = self._unbroken_dataset, []
                for position, index in enumerate(indices, start):
                    current.position = position
                    samples.append(dataset[index])
            current.key = None  # sample_seed() is a sample's: not defined in collate_fn
            collate = self._unbroken_collate
            if collate.seeds is None:  # torch's collate: called directly, no frame between
                return collate.collate_fn(samples)
            return collate(samples, key, start)
        except StopIteration:
            raise  # torch ends the iteration on it
        except Exception as error:
            return Failed(error)
        finally:
            clear_sample(saved)

    def __getitem__(self, keys: Keys) -> Any:
        # Without automatic batching (batch_size=None) every batch holds one index, fetched
        # with the dataset's __getitem__, as torch does.
        (index,), key, start = keys
        saved = keep_main_torch_rng(self._unbroken_rngs)
        try:
            self._unbroken_seed(key, start)
            sample = self._unbroken_dataset[index]
            CURRENT.key = None
            return self._unbroken_collate(sample, key, start)
        except StopIteration:
            raise
        except Exception as error:
            return Failed(error)
        finally:
            clear_sample(saved)


class Failed:
    """A batch whose fetch raised in the user's code (``__getitem__``, ``__getitems__``,
    ``collate_fn``): handed to the training process like a batch, which counts it as received
    (torch's iterator moves past a failed batch too) and raises the error there
    (``iterator``), as torch raises it."""

    __slots__ = ("kind", "original", "text", "where")

    def __init__(self, error: Exception) -> None:
        self.original: Exception | None = error  # in this process only: it may not pickle
        self.kind, self.text = type(error), "".join(traceback.format_exception(error))
        info = get_worker_info()
        self.where = (
            "in the main process" if info is None else f"in DataLoader worker process {info.id}"
        )

    def __reduce__(self) -> tuple:
        return (_failed, (self.kind, self.text, self.where))

    def error(self) -> BaseException:
        """The exception to raise: the original in its own process; from a worker, one of its
        type with torch's message (the worker's traceback in it), or a RuntimeError."""
        if self.original is not None:
            return self.original
        message: Any = f"Caught {self.kind.__name__} {self.where}.\nOriginal {self.text}"
        if self.kind is KeyError:  # KeyError quotes its argument: torch wraps it the same way
            message = _KeyErrorMessage(message)
        try:
            return self.kind(message)
        except Exception:  # an exception whose constructor wants other arguments
            return RuntimeError(message)


class _KeyErrorMessage(str):
    def __repr__(self) -> str:
        return str(self)


def _failed(kind: type, text: str, where: str) -> Failed:
    failed = Failed.__new__(Failed)
    failed.original, failed.kind, failed.text, failed.where = None, kind, text, where
    return failed


# torch's own collate functions: they draw nothing, so their batches need no seeding.
_DRAW_NOTHING = (default_collate, default_convert)


class SeededCollate:
    """The user's ``collate_fn``, called with the chosen global generators seeded for its
    batch: from the epoch's key and the batch's first position, as its samples, but with
    ``collate_seeds`` (``rng``). Not seeded for torch's ``default_collate``/``default_convert``
    (which draw nothing: three seeding calls a batch saved), nor with ``global_rngs=()``."""

    __slots__ = ("collate_fn", "global_rngs", "seeds")

    def __init__(self, collate_fn: Callable[[Any], Any], global_rngs: tuple[str, ...]) -> None:
        self.collate_fn, self.global_rngs = collate_fn, global_rngs
        draws_nothing = any(collate_fn is known for known in _DRAW_NOTHING)
        self.seeds = (
            make_seeder(global_rngs, collate_seeds) if global_rngs and not draws_nothing else None
        )

    def __reduce__(self) -> tuple:  # the seeder is a closure: rebuilt in each worker
        return (SeededCollate, (self.collate_fn, self.global_rngs))

    def __call__(self, batch: Any, key: int, position: int) -> Any:
        """``collate_fn(batch)`` for the batch starting at ``position`` of the epoch keyed by
        ``key``. In the training process the caller puts torch's generator back afterwards
        (``keep_main_torch_rng``); ``keeping`` does it itself."""
        if self.seeds is not None:
            self.seeds(key, position)
        return self.collate_fn(batch)

    def keeping(self, batch: Any, key: int, position: int) -> Any:
        """Like a call, and in the training process it puts torch's generator back itself."""
        if self.seeds is None:
            return self.collate_fn(batch)
        saved = keep_main_torch_rng(self.global_rngs)
        try:
            return self(batch, key, position)
        finally:
            if saved is not None:
                torch.default_generator.set_state(saved)


def passed(batch: Any) -> Any:
    """torch's ``collate_fn`` where ``SeededDataset`` has collated the batch already."""
    return batch
