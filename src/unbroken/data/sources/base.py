"""Where an epoch's batches come from: the ``BatchSource`` protocol ``DataLoader`` is built on.

``unbroken.DataLoader`` is one loop around a real ``torch.utils.data.DataLoader``; what varies
with the dataset and its options is the *source*, chosen once at construction by the table
``sources.SOURCES``:

===========================  =============================================  ================
source                       for                                            module
===========================  =============================================  ================
``NativeOrder``              map-style, ``shuffle`` on or off                ``orders``
``ShardedOrder``             the same, one rank's share of it                ``sharding``
``ShardedRangeStream``       a ``read_range`` stream, one rank's share       ``sharding``
``UserSampler``              map-style with a ``sampler``                    ``samplers``
``UserBatchSampler``         map-style with a ``batch_sampler``              ``samplers``
``RangeStream``              an iterable with ``read_range`` (global cursor)  ``streams``
``StatefulStream``           an iterable with ``state_dict``                 ``replicas``
``SamplerPatternStream``     an iterable with ``sampler``/``sampler_iter``   ``replicas``
``ReplayStream``             any other iterable (re-read and skip)           ``replicas``
===========================  =============================================  ================

A source tells the inner torch loader what to iterate (``torch_dataset``), what a fresh
epoch's position is (``fresh``), and, per iteration (``begin``), how to record each batch the
user receives in the loader's ``Cursor``. It checks a loaded cursor (``check_cursor``) and
says what must match on load (``fingerprint``). Adding a source is one class: e.g. a rank's
slice of a global order is an ``IndexSource`` whose ``batches`` yields that rank's share:

    class EveryOther(IndexSource):                  # the even positions of [0, n)
        def __init__(self, n):
            super().__init__()
            self.n = n
        def __len__(self):
            return (self.n + 1) // 2
        def fingerprint(self):
            return {"sampler": "every-other", "shuffle": None}
        def check_cursor(self, cursor, what):
            ...                                     # counters that no run saves: CorruptState
        def batches(self, seed, epoch, cursor, done):
            key = keys.samples(seed, epoch)
            for k in range(cursor.samples, len(self)):
                done.append((k + 1, None))          # what the cursor says once it is received
                yield [2 * k], key, k
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

SKIP = object()  # what a receiver returns for a batch the user never sees (a placeholder)

Receiver = Callable[["Cursor", Any], Any]


class Cursor:
    """Where the user is in an epoch: samples and batches received, and the source's part."""

    __slots__ = ("batches", "samples", "source")

    def __init__(self, samples: int = 0, batches: int = 0, source: Any = None) -> None:
        self.samples, self.batches, self.source = samples, batches, source

    def copy(self) -> Cursor:
        return Cursor(self.samples, self.batches, self.source)


class BatchSource(ABC):
    """The batches of each epoch, from any cursor, and how a received batch moves the cursor."""

    # True for a rank's share of one global order (``unbroken.distributed``): its state is the
    # global cursor, the same on every rank, and resumes on any number of ranks. False: on
    # several ranks each rank iterates its own, so the loader records the rank and world size
    # in the fingerprint and a state resumes only where it was saved.
    shared_by_ranks = False

    @abstractmethod
    def __len__(self) -> int:
        """Batches in a whole epoch (``TypeError`` if unknown)."""

    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """Settings saved in the state that must match on load: ``sampler`` and ``shuffle``."""

    def fresh(self) -> Any:
        """The source's part of the cursor at the start of an epoch."""
        return None

    @abstractmethod
    def check_cursor(self, cursor: Cursor, what: str) -> None:
        """Refuse (``CorruptState``, ``StateMismatch``) a loaded cursor that no run of this
        loader saves; its counters are already known to be ints in range."""

    def check_saveable(self, source: Any) -> None:
        """Raise the deferred refusal of a user object's state that JSON cannot hold."""
        return None  # sources that hold no user state have nothing to refuse

    @abstractmethod
    def torch_dataset(
        self, dataset: Any, collate_fn: Any, batch_size: int | None, global_rngs: tuple[str, ...]
    ) -> tuple[Dataset, dict[str, Any]]:
        """What the inner torch loader iterates, and its batching arguments
        (``batch_size``, ``sampler``, ``batch_sampler``, ``collate_fn``)."""

    @abstractmethod
    def begin(self, seed: int, epoch: int, cursor: Cursor) -> Receiver:
        """Prepare an iteration of ``epoch`` from ``cursor`` (called just before the inner
        loader starts its workers); return what records each batch as it is received:
        ``receive(cursor, batch)`` moves the cursor and returns the user's batch, or ``SKIP``."""
