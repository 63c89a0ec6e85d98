"""``iter(unbroken.DataLoader)``: torch's iterator API over one iteration of the loader.

What ``iter()`` returns is an object, as torch's is: ``next()``, ``len()`` (the epoch's
batches), and ``close()``. It follows the epoch protocol of ``epochs`` (independent
iterations; the position taken at the first ``next()``), and adds what torch's iterator does:

- **Workers start at ``iter()``**, so that they load while the caller prepares. The position
  is still taken at the first ``next()``: the workers were started for the position the loader
  had at ``iter()``, and if a ``set_epoch`` or ``load_state_dict`` came in between, they are
  shut down and started again for the new one.
- **An error raised by the dataset or ``collate_fn`` for a batch propagates, and the iteration
  goes on**: the next ``next()`` gives the next batch ("skip bad batches" loops). The failed
  batch counts as received, as torch's iterator has moved past it too, so a state taken
  after the error resumes at the batch after it, as the loop does. (``fetch.Failed`` carries
  the error from the worker.) The error is raised as torch raises it: the exception itself
  without workers, and from a worker an exception of its type whose message says
  "Caught ... in DataLoader worker process N" with the worker's traceback.
- **Any other failure** (torch's: a worker that died, a ``timeout``; an iterable dataset's own
  iterator raising, which cannot go on after it) ends this iteration with the position where
  it was: the next ``iter()`` continues from the last batch received, as a resumed run would.
  A dead worker is reported with torch's message ("DataLoader worker (pid N) is killed by
  signal: ..."), also when a batch it had queued found it gone first (``workers``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import keys
from .epochs import Binding
from .sources.base import SKIP, Cursor, Receiver
from .sources.fetch import Failed
from .sources.orders import NativeOrder
from .workers import await_death_report, signals_blocked, worker_init

if TYPE_CHECKING:
    from .loader import DataLoader


class LoaderIterator:
    """One iteration of an ``unbroken.DataLoader``: what ``iter(loader)`` returns."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._binding: Binding[Cursor] | None = None
        self._started: Started | None = None
        self._reported: int | None = None  # len(dataset) of a stream, as torch: if asked before
        self._over = False
        # With workers, start them now for the position the loader has now (torch starts its
        # workers in iter()); __next__ checks that it is still the one it takes.
        self._primed = prime(loader) if loader.num_workers > 0 else None

    def __iter__(self) -> LoaderIterator:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        started = self._started
        if started is None:
            if self._over:
                raise StopIteration
            started = self._begin()
        loader, binding = self._loader, self._binding
        assert binding is not None
        cursor = binding.position
        while True:
            try:
                batch = next(started.batches)
            except StopIteration:
                self._end(loader._finished)
                raise
            except BaseException as error:
                try:
                    if loader.num_workers > 0:
                        await_death_report(error)  # torch's message for a dead worker
                finally:
                    self._end(loader._interrupted)
                raise
            before = (cursor.samples, cursor.batches, cursor.source)  # receive replaces source
            batch = started.receive(cursor, batch)  # the cursor moves when the user receives it
            if batch is not SKIP:
                break
        cursor.batches += 1
        loader._before_last = (cursor, before)
        loader._yielded(binding)
        reported = self._reported
        if reported is not None and cursor.samples > reported:
            warn_longer_than_reported(loader, reported, cursor.samples)
        if type(batch) is Failed:  # received and counted: the loop may go on after it
            raise batch.error()
        return batch

    def _begin(self) -> Started:
        loader = self._loader
        binding = self._binding = loader._bind()
        primed, self._primed = self._primed, None
        started = start(loader, binding, primed)
        self._started, self._reported = started, loader._reported_length
        plan_reads(loader, started, binding)
        return started

    def _end(self, report: Any) -> None:
        started, binding = self._started, self._binding
        self._started, self._over = None, True
        if started is not None:
            started.close()
        if binding is not None:
            report(binding)

    def close(self) -> None:
        """End the iteration here, as a ``break`` out of a loop over it does."""
        self._primed = None
        if self._started is not None:
            self._end(self._loader._abandoned)

    def __del__(self) -> None:
        # An iteration dropped after it yielded ends its epoch there (``epochs``), as when
        # CPython closes a generator a loop broke out of.
        if self.__dict__.get("_started") is not None:
            self.close()


# The inner torch loader started for a place (``Started``), for an iteration.
def prime(loader: DataLoader) -> Started:
    """Start the workers for the place an iteration would take now (``_bind``'s rule)."""
    fresh = loader._owner is not None  # held by another iteration: the epoch afresh
    return _launch(loader, loader._start_position(None) if fresh else loader._pos, loader._epoch)


def start(loader: DataLoader, binding: Binding[Cursor], primed: Started | None) -> Started:
    """The inner iteration for ``binding``: the primed one if it reads the same batches."""
    cursor, epoch = binding.position, binding.epoch
    if cursor.batches == 0:
        loader._follow_length()
    if primed is not None:
        if primed.key == _key(loader, cursor, epoch):
            return primed
        primed.close()  # a set_epoch or load_state_dict came between iter() and next()
        # torch warned of too many workers as iter() started them; it would not warn again.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _TOO_MANY_WORKERS, UserWarning)
            return _launch(loader, cursor, epoch)
    return _launch(loader, cursor, epoch)


# The start of torch's warning as it creates an iterator with more workers than CPUs.
_TOO_MANY_WORKERS = r"This DataLoader will create \d+ worker processes in total"


def _key(loader: DataLoader, cursor: Cursor, epoch: int) -> tuple:
    """What an inner iteration's batches are a function of."""
    n = loader._source.n if isinstance(loader._source, NativeOrder) else None
    return (loader.seed, epoch, cursor.samples, cursor.batches, repr(cursor.source), n)


def _launch(loader: DataLoader, cursor: Cursor, epoch: int) -> Started:
    if cursor.batches == 0:
        loader._follow_length()
    key = _key(loader, cursor, epoch)
    loader._worker_seeds.manual_seed(keys.torch_workers(loader.seed, epoch))
    receive = loader._source.begin(loader.seed, epoch, cursor)
    if loader.num_workers == 0:
        batches = iter(loader._inner)
    else:
        # Workers ignore the preemption signals, which the training process may handle now
        # but not when the loader was built; see workers.
        loader._inner.worker_init_fn = worker_init(loader._user_worker_init)
        with signals_blocked():
            batches = iter(loader._inner)
    started = Started(key, batches, receive)
    if loader._inner.persistent_workers:  # one torch iterator, reset by every iter()
        previous, loader._on_workers = loader._on_workers, started
        if previous is not None and previous.batches is batches:
            previous.batches = DETACHED
    return started


def plan_reads(loader: DataLoader, started: Started, binding: Binding[Cursor]) -> None:
    """A dataset that plans its reads (a streaming dataset's prefetch) is told the exact
    future order once the workers exist (so no thread of it is forked into them), from
    the cursor the user's batches move."""
    plans = loader._plans_reads
    if plans is not None:
        started.plan = plans.plan_reads(loader.seed, binding.epoch, binding.position)


def warn_longer_than_reported(loader: DataLoader, reported: int, fetched: int) -> None:
    """torch's warning (its words) when an IterableDataset yields more than its ``len()``
    said once ``len(loader)`` was asked; counted in samples, as the message says (torch
    counts batches: the same with its default batch_size=1)."""
    message = (
        f"Length of IterableDataset {loader.dataset} was reported to be {reported}"
        f"(when accessing len(dataloader)), but {fetched} samples have been fetched. "
    )
    if loader.num_workers > 0:
        message += (
            "For multiprocessing data-loading, this could be caused by not properly "
            "configuring the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
            "for examples."
        )
    warnings.warn(message, stacklevel=4)


class Started:
    """An iteration of the inner torch loader, started for one (seed, epoch, cursor): ``key``."""

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
