"""The dataset the inner torch DataLoader sees: the user's, with each batch's RNGs seeded.

torch's fetcher hands a whole batch of keys to ``__getitems__``. We seed the chosen global
generators once, from (epoch key, the batch's first position), then call the user's
``__getitem__`` for each sample, telling ``sample_seed()``/``sample_rng()`` which position is
being fetched, so the batch's random transforms do not depend on which worker runs it. A user
dataset with its own ``__getitems__`` (batched reads) keeps it: it is called once per batch,
with ``sample_seed()`` the batch's first position's.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset, get_worker_info

from ..rng import CURRENT, clear_sample, keep_main_torch_rng, make_seeder
from .standin import StandIn

# A batch as the inner torch loader's batch sampler yields it and a worker receives it: the
# dataset indices, the epoch's key and the position of its first sample in the epoch's global
# order. A plain tuple: one is built per batch, and a class of our own costs ~0.5 us more.
Keys = tuple[Sequence[int], int, int]


class SeededDataset(StandIn, Dataset):
    """In a worker, ``get_worker_info().dataset``: it stands in for the user's dataset there
    (``standin``)."""

    _OWN = frozenset(
        ("_unbroken_dataset", "_unbroken_rngs", "_unbroken_seed", "_unbroken_getitems")
    )
    _STOOD_FOR = "_unbroken_dataset"

    def __init__(self, dataset: Any, global_rngs: tuple[str, ...]) -> None:
        self._unbroken_dataset = dataset
        self._unbroken_rngs = global_rngs
        self._unbroken_seed = make_seeder(global_rngs)
        batched = getattr(dataset, "__getitems__", None)
        self._unbroken_getitems = batched if callable(batched) else None

    def __getstate__(self) -> dict:  # the seeder is a closure: rebuild it in each worker
        return {"dataset": self._unbroken_dataset, "global_rngs": self._unbroken_rngs}

    def __setstate__(self, state: dict) -> None:
        SeededDataset.__init__(self, state["dataset"], state["global_rngs"])

    def __len__(self) -> int:
        return len(self._unbroken_dataset)

    def __getitems__(self, keys: Keys) -> list | Failed:
        indices, key, start = keys
        current = CURRENT
        saved = keep_main_torch_rng(self._unbroken_rngs)  # put back below, in the main process
        try:
            self._unbroken_seed(key, start)
            if self._unbroken_getitems is not None:
                return self._unbroken_getitems(list(indices))
            dataset, out = self._unbroken_dataset, []
            for position, index in enumerate(indices, start):
                current.position = position
                out.append(dataset[index])
            return out
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
            return self._unbroken_dataset[index]
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


def collating(collate_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The user's ``collate_fn``, letting a ``Failed`` batch through and catching its own."""
    return functools.partial(_collate, collate_fn)  # picklable, for spawned workers


def _collate(collate_fn: Callable[[Any], Any], batch: Any) -> Any:
    if type(batch) is Failed:
        return batch
    try:
        return collate_fn(batch)
    except StopIteration:
        raise
    except Exception as error:
        return Failed(error)
