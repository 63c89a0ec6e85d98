"""``resumable(make_iterable)``: checkpoint the position of any iterable, exactly.

Wraps a third-party iterable (a list of batches, a generator function, a DALI- or FFCV-style
loader, torchdata's ``StatefulDataLoader``) in an object with unbroken's loader protocol:
``__iter__`` (each ``iter()`` is the next epoch), ``epoch``, ``state_dict()`` (plain JSON),
``load_state_dict()``, ``set_epoch()`` and ``__len__`` when the iterable has one.
``make_iterable(epoch)`` makes the stream of an epoch; it must give the same stream for the
same epoch (seed its shuffle with the epoch), since an epoch's start is always re-made by it.

Two ways to resume inside an epoch, chosen by what ``make_iterable`` returns:

- **Its own state** (an object with ``state_dict()``/``load_state_dict()``, torch's Stateful
  protocol): its state is taken right after each ``next()``, so it describes what the loop
  received, and is restored through ``load_state_dict`` before iterating. Cost: one
  ``state_dict()`` and its JSON encoding per item (row ``resumable_state_item`` of
  docs/benchmarks/unit-costs.md); the resume costs
  what the object's own restore costs.
- **Skipping**: otherwise the epoch's iterable is re-made and the k items already received are
  read again and dropped: O(k) in the iterable's own time per item (row ``resumable_skip_item``
  of the unit costs), with a tqdm
  bar on a terminal when k > 1000; exact only if the iterable is deterministic, and a warning
  says so once. Iterating costs a generator step per item (row ``resumable_item``).

Each item is read one step ahead, to know whether it is the epoch's last: a state taken inside
the loop right after the last item resumes into an empty remainder without re-reading the
epoch, and a state taken after the ``for`` loop starts the next epoch.

State: ``{"format", "version", "name", "epoch", "items", "end", "inner"}`` where ``items``
counts what the loop received this epoch and ``inner`` is the object's own state (or null).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

from .._state import (
    StateReader,
    Unsaveable,
    check_user_state,
    encode_or_defer,
    from_jsonable,
    has_state,
    raise_if_unsaveable,
    same,
)
from ..errors import CorruptState, StateMismatch
from .epochs import EpochIterable
from .states import RESUMABLE, ResumableState

_PROGRESS_AFTER = 1000  # skips longer than this show a tqdm bar (on a terminal)
_END = object()


def resumable(
    make_iterable: Callable[..., Iterable] | Iterable,
    *,
    name: str | None = None,
    progress: bool = True,
) -> Resumable:
    """Make ``make_iterable``'s stream resumable: see ``Resumable``.

    Args:
        make_iterable: A function of the epoch that makes its iterable, or a re-iterable object.
        name: Stored in the state and checked on load, to tell several streams apart.
        progress: Show a tqdm bar while a resume skips more than 1000 items (on a terminal).

    Returns:
        The ``Resumable`` wrapping it.
    """
    return Resumable(make_iterable, name=name, progress=progress)


def take_state(obj: Any, what: str) -> Any:
    """``obj.state_dict()`` as JSON data (a copy), or an ``Unsaveable`` saying why it is not."""
    path = f"{type(obj).__qualname__}.state_dict()"
    try:
        state = obj.state_dict()
    except ValueError as error:  # e.g. a nested buffer's own refusal: deferred the same way
        return Unsaveable(error)
    return encode_or_defer(state, path, what)


class _ItemPosition:
    """Where the loop is in an epoch: items received, whether the last was the epoch's last,
    and the object's own state right after it (None on the skip path)."""

    __slots__ = ("items", "end", "inner")

    def __init__(self, items: int = 0, end: bool = False, inner: Any = None) -> None:
        self.items, self.end, self.inner = items, end, inner


class Resumable(EpochIterable[_ItemPosition]):
    """An iterable whose position survives a restart.

    ``iter()`` continues the epoch ``load_state_dict`` restored and otherwise starts the next
    epoch (the first is 0). As with ``unbroken.DataLoader``, a ``break`` ends the epoch at once
    (a state taken after it starts the next epoch) and an ``iter()`` that yielded nothing
    starts nothing.

    Args:
        make_iterable: Called as ``make_iterable(epoch)`` (or ``make_iterable()`` if it takes no
            argument) at the start of each epoch, and again to resume one. A re-iterable object (a
            list, a loader) may be passed instead and is iterated every epoch; a one-shot iterator
            (a generator object) is refused, since it cannot be made again.
        name: Stored in the state and checked on load, to tell the states of several streams apart.
        progress: Show a tqdm bar while a resume skips more than 1000 items (on a terminal).

    Raises:
        TypeError: ``name`` is not a str, or ``make_iterable`` is a one-shot iterator, not
            callable, or takes arguments other than the epoch.
    """

    def __init__(
        self,
        make_iterable: Callable[..., Iterable] | Iterable,
        *,
        name: str | None = None,
        progress: bool = True,
    ) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {name!r}")
        self._make = _epoch_factory(make_iterable)
        self.name = name
        self.progress = progress
        self._what = "unbroken.resumable" + (f"({name!r})" if name else "")
        self._made: tuple[int, Any] | None = None  # made by __len__, kept for the next iter()
        self._warned = False
        self._init_epochs()

    def __len__(self) -> int:
        """Items in a whole epoch, if the epoch's iterable has ``len()``; else ``TypeError``."""
        obj = self._object(self._epoch, keep=True)
        try:
            return len(obj)
        except TypeError:
            raise TypeError(f"{self._what}: a {type(obj).__qualname__} has no len()") from None

    def _start_position(self, ended: _ItemPosition | None) -> _ItemPosition:
        return _ItemPosition()

    def _move(self, epoch: int, position: _ItemPosition) -> None:
        super()._move(epoch, position)
        self._made = None

    def _run(self, pos: _ItemPosition, epoch: int) -> Generator[Any, None, Any]:
        obj, items = (None, iter(())) if pos.end else self._start(epoch, pos)
        stateful = has_state(obj)
        ahead = [next(items, _END)]  # no local name holds an item once it is yielded
        while ahead[0] is not _END:
            obj_state = take_state(obj, self._what) if stateful else None
            ahead.append(next(items, _END))  # read ahead: is this item the epoch's last?
            pos.items, pos.end, pos.inner = pos.items + 1, ahead[1] is _END, obj_state
            yield ahead.pop(0)

    def _start(self, epoch: int, pos: _ItemPosition) -> tuple[Any, Iterator]:
        obj = self._object(epoch)
        if pos.inner is not None:
            if not has_state(obj):
                raise StateMismatch(
                    self._what,
                    "inner",
                    "a state",
                    None,
                    message=(
                        f"{self._what}: the state holds the state of the epoch's iterable, but the "
                        f"{type(obj).__qualname__} made now has no load_state_dict(); make the "
                        "same kind of iterable that saved it"
                    ),
                )
            obj.load_state_dict(from_jsonable(pos.inner))
            return obj, iter(obj)
        items = iter(obj)
        if pos.items:
            self._skip(items, pos.items, obj)
        return obj, items

    def _object(self, epoch: int, keep: bool = False) -> Any:
        made, self._made = self._made, None
        obj = made[1] if made is not None and made[0] == epoch else self._make(epoch)
        if keep:
            self._made = (epoch, obj)
        return obj

    def _skip(self, items: Iterator, count: int, obj: Any) -> None:
        kind = type(obj).__qualname__
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self._what}: a {kind} has no state_dict()/load_state_dict(), so resuming "
                f"re-reads the {count} items already received this epoch and drops them: this "
                "costs O(k) and is exact only if the iterable yields the same items again for the "
                "same epoch. Give it state_dict/load_state_dict to resume without re-reading.",
                stacklevel=4,
            )
        from tqdm import tqdm  # imported here: only a long skip needs it

        bar = tqdm(
            total=count,
            desc=f"{self._what}: skipping",
            unit="item",
            leave=False,
            disable=None if self.progress and count > _PROGRESS_AFTER else True,
        )
        skipped = 0
        with bar:
            for _ in itertools.islice(items, count):
                skipped += 1
                bar.update()
        if skipped < count:
            raise StateMismatch(
                self._what,
                "items",
                count,
                skipped,
                message=(
                    f"{self._what}: the state says {count} items of epoch {self._epoch} were "
                    f"received, but the re-made {kind} yields only {skipped}; the iterable is not "
                    "deterministic, or shorter than the one that saved the state"
                ),
            )

    def state_dict(self) -> ResumableState:
        """What the loop has received so far.

        Returns:
            The state, JSON-serializable (``json.dumps`` works).

        Raises:
            ValueError: the iterable's own state cannot be saved as JSON (named by its key;
                tensors and numpy arrays can).
        """
        pos = self._pos
        raise_if_unsaveable(pos.inner)
        return {
            "format": RESUMABLE.name,
            "version": RESUMABLE.version,
            "name": self.name,
            "epoch": self._epoch,
            "items": pos.items,
            "end": pos.end,
            "inner": pos.inner,
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` continue right after the last item the saved stream yielded.

        Nothing changes unless the state is valid. Whether the epoch's iterable can load
        ``inner`` is known only once it is made, at ``iter()``.

        Args:
            state: What ``state_dict()`` returned, maybe through JSON.

        Raises:
            CorruptState: the state is malformed (a field of the wrong type or out of range,
                counters that contradict each other). It names the field.
            StateMismatch: the state is from another format or version, or was saved under
                another ``name``.
        """
        reader = StateReader(state, self._what, RESUMABLE)
        if not same(state["name"], self.name):
            raise StateMismatch(
                self._what,
                "name",
                state["name"],
                self.name,
                "Load the state saved by the stream of this name.",
            )
        epoch, items, end = reader.int("epoch"), reader.int("items"), reader.bool("end")
        inner = state["inner"]
        if inner is not None:
            check_user_state(inner, f"{self._what} state field 'inner'")
        if items == 0 and (end or inner is not None):
            raise CorruptState(
                f"{self._what} state is inconsistent: items=0 with end={end!r} and "
                f"inner={'set' if inner is not None else None}; the state is corrupt"
            )
        self._restore(epoch, _ItemPosition(items, end, copy.deepcopy(inner)))


def _epoch_factory(source: Any) -> Callable[[int], Iterable]:
    """``source`` as a function of the epoch."""
    if isinstance(source, Iterator):
        raise TypeError(
            f"unbroken.resumable got a {type(source).__qualname__}, a one-shot iterator: it "
            "cannot be made again for the next epoch or a resume. Pass the function that makes "
            "it instead, e.g. resumable(lambda epoch: my_generator(epoch))"
        )
    if isinstance(source, Iterable):
        return lambda epoch: source
    if not callable(source):
        raise TypeError(
            "unbroken.resumable expects make_iterable(epoch) -> iterable, or a re-iterable "
            f"object; got a {type(source).__qualname__}"
        )
    try:
        signature = inspect.signature(source)
    except (TypeError, ValueError):  # no signature (some builtins): assume it takes the epoch
        return source
    try:
        signature.bind(0)
        return source
    except TypeError:
        pass
    try:
        signature.bind()
    except TypeError:
        raise TypeError(
            f"unbroken.resumable: make_iterable{signature} must take the epoch as its only "
            "argument, or no argument"
        ) from None
    return lambda epoch: source()
