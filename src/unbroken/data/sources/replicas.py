"""How one worker replica of an iterable dataset resumes inside an epoch: one class each.

- ``StatefulStream``: ``state_dict``/``load_state_dict`` (torch's Stateful protocol), restored
  in O(1), before ``iter()``, or after it for a dataset that is its own iterator (``__next__``;
  its ``__iter__`` sets up the iteration state, as in torchdata's tests). A fresh epoch starts
  from the state the dataset had when the loader first iterated it (none, if ``state_dict()``
  needs an attribute that ``__iter__`` creates).
- ``SamplerPatternStream``: ``self.sampler`` with ``__iter__`` setting ``self.sampler_iter``:
  the sampler iterator is wrapped to count indices, and a resume skips that many indices.
- ``ReplayStream``: neither: a resume re-reads and skips the worker's consumed items (O(k),
  with a warning).

``sources.SOURCES`` picks the source of an iterable dataset (these, or ``RangeStream``), each
class saying which datasets it reads (``matches``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

from ..._state import COUNT_LIMIT, check_user_state, encode_or_defer, from_jsonable, has_state
from ...errors import CorruptState
from ..rng import clear_sample, keep_main_torch_rng
from .base import Arguments
from .streams import set_epoch
from .worker_streams import Opened, PerWorkerStream, ReplicaStart

_END = object()


class StatefulStream(PerWorkerStream):
    """A replica with ``state_dict``/``load_state_dict``: restored in O(1)."""

    tag = "stateful"

    @classmethod
    def matches(cls, a: Arguments) -> bool:
        return a.stream and has_state(a.dataset)

    _UNTAKEN = object()

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # A dataset that is its own iterator (``__iter__`` returns self, like torchdata's
        # CountIterCallsIter) sets up its iteration state in ``__iter__``: a saved state is
        # loaded after ``iter()``, or ``__iter__`` would overwrite it. Any other dataset's
        # iterator reads the dataset's state, which is therefore loaded before ``iter()``.
        self.self_iterating = callable(getattr(self.dataset, "__next__", None))
        self._initial: Any = self._UNTAKEN

    def initial_state(self) -> Any:
        """The dataset's state before the loader first iterates it, from which each fresh epoch
        starts; taken at the first ``iter()``, not at construction, because torchdata-style
        datasets create the attributes their ``state_dict`` reads in ``__iter__``. ``None``
        (for those datasets): no state to restore, ``__iter__`` sets the epoch's start up."""
        if self._initial is self._UNTAKEN:
            self._initial = None
            try:
                self._initial = self.dataset.state_dict()
            except AttributeError:  # an attribute that __iter__ creates
                pass
        return self._initial

    def open(self, start: ReplicaStart) -> Opened:
        plan, saved = start.plan, start.saved
        dataset, epoch = self.dataset, plan["epoch"]
        if saved["state"] is None:
            # A fresh epoch: the state as it was before the loader first iterated the dataset
            # (with num_workers=0 the same object would otherwise carry on), then the epoch.
            if plan["initial"] is not None:
                dataset.load_state_dict(copy.deepcopy(plan["initial"]))
            set_epoch(dataset, epoch)
            items = iter(dataset)
        else:
            # A resumed epoch: the epoch, then the saved state (which may carry an epoch of its
            # own and must win).
            set_epoch(dataset, epoch)
            state = from_jsonable(saved["state"])
            if self.self_iterating:
                items = iter(dataset)
                dataset.load_state_dict(state)
            else:
                dataset.load_state_dict(state)
                items = iter(dataset)
        # Refused only when the user asks for the state, never while iterating.
        return items, lambda: encode_or_defer(
            dataset.state_dict(), "dataset.state_dict()", "unbroken.DataLoader"
        )

    def check_state(self, state: Any, items: int, where: str) -> None:
        if state is not None:
            check_user_state(state, where)
        if (state is None) != (items == 0):
            raise CorruptState(
                f"{where}: expected null before the worker's first item, then the "
                f"dataset's state_dict() with items={items}, got {state!r:.200}",
                "source",
            )


class _CountingIterator:
    """Counts what the dataset draws from its ``sampler_iter`` (the sampler pattern)."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator, self.count = iterator, 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        value = next(self.iterator)
        self.count += 1
        return value


class SamplerPatternStream(PerWorkerStream):
    """A replica that draws indices from ``self.sampler_iter``: resumed by skipping indices."""

    tag = "sampler"

    @classmethod
    def matches(cls, a: Arguments) -> bool:
        return (
            a.stream
            and hasattr(a.dataset, "sampler")
            and callable(getattr(a.dataset, "__next__", None))
        )

    def open(self, start: ReplicaStart) -> Opened:
        plan, saved, worker = start.plan, start.saved, start.worker
        dataset = self.dataset
        set_epoch(dataset, plan["epoch"])
        items = iter(dataset)
        dataset.sampler_iter = counter = _CountingIterator(dataset.sampler_iter)
        drawn = saved["state"]["sampler_indices"] if saved["state"] else 0
        for skipped in range(drawn):
            if next(counter, _END) is _END:
                raise self.shorter(worker, drawn, "sampler indices", skipped)
        return items, lambda: {"sampler_indices": counter.count}

    def check_state(self, state: Any, items: int, where: str) -> None:
        ok = (
            state is None
            if items == 0
            else (
                isinstance(state, dict)
                and set(state) == {"sampler_indices"}
                and not isinstance(state["sampler_indices"], bool)
                and isinstance(state["sampler_indices"], int)
                and 0 <= state["sampler_indices"] <= COUNT_LIMIT
            )
        )
        if not ok:
            raise CorruptState(
                f"{where}: expected null before the worker's first item, then "
                f"{{'sampler_indices': int}} with items={items}, got "
                f"{state!r:.200}",
                "source",
            )


class ReplayStream(PerWorkerStream):
    """A replica with no state: resumed by re-reading and dropping its consumed items."""

    tag = "replay"

    @classmethod
    def matches(cls, a: Arguments) -> bool:
        return a.stream  # any iterable: the last of the streams in ``SOURCES``

    def open(self, start: ReplicaStart) -> Opened:
        plan, saved, worker, seed, key, global_rngs = start
        set_epoch(self.dataset, plan["epoch"])
        items, count = iter(self.dataset), saved["items"]
        saved_rng = keep_main_torch_rng(global_rngs)
        step = self.batch_size or 1
        for skipped in range(count):  # seeded as when they were read, for their side effects
            if skipped % step == 0:  # a batch's first item (every batch but the last is full)
                seed(key, skipped)
            if next(items, _END) is _END:
                raise self.shorter(worker, count, "items", skipped)
        clear_sample(saved_rng)
        return items, lambda: None

    def check_state(self, state: Any, items: int, where: str) -> None:
        if state is not None:
            raise CorruptState(
                f"{where}: expected null (the dataset has no state) with "
                f"items={items}, got {state!r:.200}",
                "source",
            )

    def warn_resume(self) -> None:
        warnings.warn(
            f"unbroken: {type(self.dataset).__qualname__} has no state_dict()/load_state_dict(), "
            "so resuming re-reads and skips the items each worker had consumed: this costs O(k) "
            "and is exact only if the dataset yields the same items again. Give it "
            "state_dict/load_state_dict to resume in O(1).",
            stacklevel=4,  # warn_resume, check_cursor, load_state_dict, the caller
        )
