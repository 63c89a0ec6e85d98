"""Where an epoch's batches come from: the ``BatchSource`` protocol ``DataLoader`` is built on.

``unbroken.DataLoader`` is one loop around a real ``torch.utils.data.DataLoader``; what varies
with the dataset and its options is the *source*, chosen once at construction: the first class
of ``sources.SOURCES`` whose ``matches`` takes torch's ``Arguments`` builds it (``build``):

===========================  =============================================  ================
source                       for                                            module
===========================  =============================================  ================
``ShardedRangeStream``       a ``read_range`` stream, one rank's share       ``sharding``
``RangeStream``              an iterable with ``read_range`` (global cursor)  ``streams``
``StatefulStream``           an iterable with ``state_dict``                 ``replicas``
``SamplerPatternStream``     an iterable with ``sampler``/``sampler_iter``   ``replicas``
``ReplayStream``             any other iterable (re-read and skip)           ``replicas``
``UserBatchSampler``         map-style with a ``batch_sampler``              ``samplers``
``UserSampler``              map-style with a ``sampler``                    ``samplers``
``ShardedOrder``             map-style in unbroken's order, a rank's share   ``sharding``
``NativeOrder``              map-style, ``shuffle`` on or off                ``orders``
===========================  =============================================  ================

A source tells the inner torch loader what to iterate (``torch_dataset``), what a fresh
epoch's position is (``fresh``), and, per iteration (``begin``), how to record each batch the
user receives in the loader's ``Cursor``. It checks a loaded cursor (``check_cursor``) and
says what must match on load (``fingerprint``). What the loader does differently for some
sources, the source says (class attributes and methods with a default): whether it plans the
dataset's reads (``plan_reads``), follows the dataset's length at each epoch
(``follow_length``, ``ordered_length``), allows persistent workers, warns like torch when a
stream yields more than its ``len()``, lists its indices for ``loader.sampler``
(``lists_indices``) and is shared by ranks.

Adding a source is one class, registered (``sources.register``): e.g. a rank's slice of a
global order is an ``IndexSource`` whose ``batches`` yields that rank's share:

    class EveryOther(IndexSource):                  # the even positions of [0, n)
        @classmethod
        def matches(cls, a):                        # a: torch's Arguments
            return isinstance(a.dataset, MyDataset)
        @classmethod
        def build(cls, a):
            return cls(len(a.dataset))
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

    unbroken.data.sources.register(EveryOther, first=True)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch.utils.data import Dataset

SKIP = object()  # what a receiver returns for a batch the user never sees (a placeholder)

Receiver = Callable[["Cursor", Any], Any]


class Cursor:
    """Where the user is in an epoch: samples and batches received, and the source's part;
    ``before_last``: these three as they were before the last batch was received here (None
    until one is), for a consumer that fetches a batch ahead of its user (``unbroken.lightning``).
    """

    __slots__ = ("batches", "before_last", "samples", "source")

    def __init__(self, samples: int = 0, batches: int = 0, source: Any = None) -> None:
        self.samples, self.batches, self.source = samples, batches, source
        self.before_last: tuple[int, int, Any] | None = None

    def copy(self) -> Cursor:
        """The same place, with no batch received at it."""
        return Cursor(self.samples, self.batches, self.source)


@dataclass(frozen=True)
class Arguments:
    """torch's arguments that choose the source, after torch's own checks of them."""

    stream: bool  # an iterable dataset (``streams.is_stream``)
    dataset: Any
    batch_size: int | None
    shuffle: bool | None
    sampler: Any
    batch_sampler: Any
    drop_last: bool
    num_workers: int
    ranks: tuple[int, int] | None  # (rank, world size) of a data-parallel job


class BatchSource(ABC):
    """The batches of each epoch, from any cursor, and how a received batch moves the cursor."""

    # What the loader asks of the source class (a default here, the exceptions in subclasses).
    # True for a rank's share of one global order (``unbroken.distributed``): its state is the
    # global cursor, the same on every rank, and resumes on any number of ranks. False: on
    # several ranks each rank iterates its own, so the loader records the rank and world size
    # in the fingerprint and a state resumes only where it was saved.
    shared_by_ranks: ClassVar[bool] = False
    # False: each epoch must start every worker afresh (from another state of its replica),
    # so the loader runs torch's loader without persistent workers whatever it was given.
    allows_persistent_workers: ClassVar[bool] = True
    # True: ``len()`` is the iterable dataset's, and as torch's loader does, once ``len(loader)``
    # was asked the loader warns when the stream yields more samples than that.
    warns_past_length: ClassVar[bool] = False
    # True: ``epoch_indices`` lists the dataset indices of an epoch, which the loader shows as
    # torch's ``loader.sampler`` (``torch_api.OrderView``).
    lists_indices: ClassVar[bool] = False

    @classmethod
    def matches(cls, arguments: Arguments) -> bool:
        """Whether this class reads the loader's dataset with these arguments (``SOURCES`` asks
        each class in turn; the first that matches builds the source)."""
        raise NotImplementedError(
            f"{cls.__qualname__} is registered as a source but does not say which datasets it "
            "reads: define the classmethod matches(cls, arguments) -> bool"
        )

    @classmethod
    def build(cls, arguments: Arguments) -> BatchSource:
        """The source for the arguments ``matches`` took."""
        raise NotImplementedError(
            f"{cls.__qualname__} is registered as a source but cannot be built: define the "
            "classmethod build(cls, arguments) returning an instance"
        )

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

    # What only some sources do: a default that does nothing.
    def plan_reads(self, seed: int, epoch: int, cursor: Cursor) -> Any:
        """Tell the dataset the iteration's exact future reads from ``cursor`` (the live one,
        which moves as batches are received), once the workers exist; return what the loader
        closes when the iteration ends, or None (a dataset that plans no reads)."""
        return None

    def follow_length(self, dataset: Any) -> None:
        """At an epoch's start: order the dataset's length now, if the source orders it (a
        dataset may grow or shrink between epochs; torch's samplers read ``len()`` each pass)."""
        return None  # a source of a fixed length, or of none

    def ordered_length(self) -> int | None:
        """The dataset length the current epoch is ordered over, if ``follow_length`` fixes it
        (None: the loader reads ``len(dataset)`` when it needs it)."""
        return None

    def epoch_indices(self, seed: int, epoch: int) -> Iterator[Sequence[int]]:
        """This rank's batches of dataset indices in ``epoch``, from its first, in the order
        read (``loader.sampler``); only for a source that ``lists_indices``."""
        raise NotImplementedError(f"{type(self).__qualname__} lists no indices")

    def epoch_length(self, seed: int, epoch: int) -> int:
        """How many indices ``epoch_indices`` lists (a source may know it without listing)."""
        return sum(len(indices) for indices in self.epoch_indices(seed, epoch))
