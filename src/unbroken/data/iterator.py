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
  Its workers are stopped before the error reaches the caller, even one that keeps the error.
  A dead worker is reported with torch's message ("DataLoader worker (pid N) is killed by
  signal: ..."), also when a batch it had queued found it gone first (``workers``).
- **Workers stop at once when an iteration ends** (unless ``persistent_workers``), however it
  ends: exhausted, closed, dropped, failed in ``next()``, or freed by the garbage collector
  from a reference cycle (``_stop``).

It starts torch's loader through the loader's ``InnerLoader`` (``inner``) and reports to the
epoch bookkeeping through an ``epochs.Iteration``; it reads no private attribute of the loader.
Cost per batch: the source's ``receive``, moving the cursor and one report to the bookkeeping
(benchmarks/RESULTS.md measures the loader's whole overhead per batch).
"""

from __future__ import annotations

import warnings
import weakref
from types import FrameType, FunctionType
from typing import Any

from .epochs import EpochIterable, Iteration, upcoming
from .inner import InnerLoader, Started
from .sources.base import SKIP, Cursor
from .sources.fetch import Failed
from .workers import await_death_report


class Loader(EpochIterable[Cursor]):
    """What an iterator iterates: an ``EpochIterable`` of cursors with a data seed and a length
    (``DataLoader`` is the one; an ``InnerLoader`` runs its batches)."""

    seed: int  # the run's data seed; load_state_dict may change it between iter() and next()

    def __len__(self) -> int:
        raise NotImplementedError


class LoaderIterator:
    """One iteration of an ``unbroken.DataLoader``: what ``iter(loader)`` returns."""

    def __init__(self, loader: Loader, inner: InnerLoader) -> None:
        self._loader, self._inner = loader, inner
        self._iteration: Iteration[Cursor] | None = None
        self._cursor: Cursor | None = None  # the iteration's position, read once per batch
        self._started: Started | None = None
        self._reported: int | None = None  # len(dataset) of a stream, as torch: if asked before
        self._over = False
        # With workers, start them now for the place an iteration would take now (torch starts
        # its workers in iter()); __next__ checks that it is still the one it takes.
        self._primed: Started | None = None
        # The iterations on workers, held from weakref.finalize's registry too: see _stop.
        self._on_workers: list[Started] = []
        if inner.num_workers > 0:
            cursor, epoch = upcoming(loader)
            self._primed = inner.start(loader.seed, epoch, cursor, None)
            self._on_workers.append(self._primed)
            # At exit, torch's and multiprocessing's own handlers end the workers, as before.
            weakref.finalize(self, _stop, self._on_workers).atexit = False

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
        iteration, cursor = self._iteration, self._cursor
        assert iteration is not None and cursor is not None
        while True:
            try:
                batch = next(started.batches)
            except StopIteration:
                self._end(Iteration.finished)
                raise
            except BaseException as error:
                workers = self._inner.num_workers > 0
                holding = _frames_holding(error, started.batches) if workers else []
                try:
                    if workers:
                        await_death_report(error)  # torch's message for a dead worker
                finally:
                    self._end(Iteration.interrupted)
                    # torch's iterator is freed: its workers stop now. Popped, not looped over:
                    # a loop variable would keep the last frame, whose f_back is this frame, a
                    # cycle holding this iterator (and its loader's workers) until a collection.
                    while holding:
                        holding.pop().clear()
                raise
            before = (cursor.samples, cursor.batches, cursor.source)  # receive replaces source
            batch = started.receive(cursor, batch)  # the cursor moves when the user receives it
            if batch is not SKIP:
                break
        cursor.batches += 1
        cursor.before_last = before
        iteration.yielded()
        reported = self._reported
        if reported is not None and cursor.samples > reported:
            self._warn_longer_than_reported(reported, cursor.samples)
        if type(batch) is Failed:  # received and counted: the loop may go on after it
            raise batch.error()
        return batch

    def _begin(self) -> Started:
        loader, inner = self._loader, self._inner
        iteration = self._iteration = Iteration(loader)
        primed, self._primed = self._primed, None
        seed, epoch, cursor = loader.seed, iteration.epoch, iteration.position
        self._cursor = cursor  # an iteration's position object is its own to the end
        started = inner.start(seed, epoch, cursor, primed)
        if inner.num_workers > 0:
            self._on_workers[:] = [started]  # primed, or primed closed and this one started
        self._started, self._reported = started, inner.reported_length
        inner.plan_reads(started, seed, epoch, cursor)
        return started

    def _end(self, report: Any) -> None:
        started, iteration = self._started, self._iteration
        self._started, self._over = None, True
        if started is not None:
            started.close()
        self._on_workers.clear()
        if iteration is not None:
            report(iteration)

    def close(self) -> None:
        """End the iteration here, as a ``break`` out of a loop over it does."""
        self._primed = None
        if self._started is not None:
            self._end(Iteration.abandoned)
        _stop(self._on_workers)  # workers primed for an iteration that never began

    def __del__(self) -> None:
        # An iteration dropped after it yielded ends its epoch there (``epochs``), as when
        # CPython closes a generator a loop broke out of.
        if self.__dict__.get("_started") is not None:
            self.close()

    def _warn_longer_than_reported(self, reported: int, fetched: int) -> None:
        """torch's warning (its words) when an IterableDataset yields more than its ``len()``
        said once ``len(loader)`` was asked; counted in samples, as the message says (torch
        counts batches: the same with its default batch_size=1)."""
        message = (
            f"Length of IterableDataset {self._inner.dataset} was reported to be {reported}"
            f"(when accessing len(dataloader)), but {fetched} samples have been fetched. "
        )
        if self._inner.num_workers > 0:
            message += (
                "For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                "for examples."
            )
        warnings.warn(message, stacklevel=4)


def _stop(on_workers: list[Started]) -> None:
    """Close the iterations on workers: torch's iterators, freed, stop their workers.

    Also run by ``weakref.finalize`` when the garbage collector frees a ``LoaderIterator``
    (one caught in a reference cycle: a frame an exception keeps, say). The finalizer's
    registry holds ``on_workers``, so torch's iterator and its queues are never garbage
    themselves. Were they, the collection would run the queues' finalizers before the
    iterator's ``__del__``: the workers would never get the signal to stop, and each would
    cost a 5 s join, at whatever training step the collection came."""
    for started in on_workers:
        started.close()
    on_workers.clear()


def _frames_holding(error: BaseException, torch_iterator: Any) -> list[FrameType]:
    """The ended frames of ``error``'s traceback that run a method of ``torch_iterator``'s
    class: torch's own frames, to clear once the iteration ended (``frame.clear()``).

    They hold torch's iterator as long as the exception lives. Left so, it is freed only by a
    garbage collection, in which its queues' finalizers run before its ``__del__``: its workers
    never get the signal to stop, and each costs a 5 s join, at whatever step the collection
    comes. Only these frames are cleared: the traceback keeps its lines, and any other frame
    (the user's sampler, a paused generator of an exception raised again) keeps its locals.
    They are found by their code, not by reading their locals: Python before 3.13 keeps a copy
    of the locals it was asked for, which ``frame.clear()`` leaves.
    """
    methods = {
        function.__code__
        for kind in type(torch_iterator).__mro__
        for function in vars(kind).values()
        if isinstance(function, FunctionType)
    }
    frames = []
    entry = error.__traceback__
    entry = entry.tb_next if entry is not None else None  # the first is __next__'s, running
    while entry is not None:
        if entry.tb_frame.f_code in methods:
            frames.append(entry.tb_frame)
        entry = entry.tb_next
    return frames
