"""``shuffle_buffer(stream, size, seed=...)``: a buffer shuffle for streams that resumes exactly.

Buffer shuffles usually lose their buffer on resume (Hugging Face ``datasets`` drops those
samples) or save all of it (tf.data: the state can be huge). This one needs neither: the stream
is cut into windows of ``size`` items; each window is read whole, permuted by a permutation that
is a pure function of (seed, epoch, window index) (numpy's Philox), and emitted. The state is
the upstream's state at the start of the current window plus how many of its items were emitted,
so a resume re-reads fewer than ``size`` items of the upstream (the window's emitted ones) and
drops them, and the state stays as small as the upstream's. Each epoch gets new permutations.

Shuffle quality, honestly: within a window every order is equally likely, which a classic
(sliding) buffer of the same size does not give (its first output is always one of the first
``size`` items, and it keeps early items early). But no item leaves its window, while a sliding
buffer lets items drift arbitrarily late with geometrically falling odds. Measured on 200,000
items with size 1000 (position out - position in): sliding buffer mean |shift| 735, sd 1000,
up to +10,000; windows mean 334, sd 408, at most 999. For the spread of a sliding buffer of size
B use a window of about 2.5 B. A sliding buffer cannot resume this cheaply: it may hold an item
read arbitrarily long ago, so it must save its items or re-read the stream from the oldest one.

Costs: memory is one window of items (emitted items are released as they go); per window one
permutation and one upstream ``state_dict()`` (docs/benchmarks/unit-costs.md, rows
``window_permutation_100``, ``window_permutation_10000``, ``upstream_state`` and the per-item
``shuffle_buffer_item_100`` and ``shuffle_buffer_item_10000``); a resume costs the
upstream's own restore plus re-reading at most ``size - 1`` items.

State: ``{"format", "version", "size", "seed", "epoch", "window", "emitted", "end",
"upstream"}``; ``end`` marks a state taken right after the epoch's last item, when the
upstream has ended its epoch.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import numpy as np

from .._checks import check_seed, is_int
from .._state import (
    COUNT_LIMIT,
    StateReader,
    check_user_state,
    from_jsonable,
    has_state,
    raise_if_unsaveable,
    same,
)
from ..errors import CorruptState, StateMismatch, prefixed
from . import keys
from .epochs import EpochIterable
from .iterable import Resumable, take_state
from .states import SHUFFLE_BUFFER, ShuffleBufferState

_LIVE = object()  # the upstream has not been read since it was made: ask it for its state
_NEXT = object()  # the upstream was left mid-epoch: its next iter() starts the next epoch
_WHAT = "unbroken.shuffle_buffer"


def shuffle_buffer(iterable: Any, size: int, *, seed: int) -> ShuffleBuffer:
    """Shuffle a stream in windows of ``size`` items, resumably: see ``ShuffleBuffer``.

    Args:
        iterable: The upstream: a stateful loader used as is, or anything ``resumable`` wraps.
        size: Items per window (memory: one window of items).
        seed: The shuffle's seed, an int in [0, 2**64); checked on load.

    Returns:
        The ``ShuffleBuffer``.
    """
    return ShuffleBuffer(iterable, size, seed=seed)


class _WindowPosition:
    """The current window, how many of its items were emitted, and the upstream's state at its
    start (after the epoch's end when ``end``); ``after``: the upstream's state once the epoch
    ended (its last window read, or its iterator closed by a ``break``), for the next epoch."""

    __slots__ = ("after", "emitted", "end", "upstream", "window")

    def __init__(
        self, window: int = 0, emitted: int = 0, end: bool = False, upstream: Any = _LIVE
    ) -> None:
        self.window, self.emitted, self.end, self.upstream = window, emitted, end, upstream
        self.after: Any = _NEXT


class ShuffleBuffer(EpochIterable[_WindowPosition]):
    """A windowed shuffle of ``iterable`` with unbroken's loader protocol.

    ``iter()`` and epochs work as for ``unbroken.DataLoader``; each ``iter()`` of the buffer
    iterates the upstream once.

    Args:
        iterable: The upstream. An object with ``state_dict``/``load_state_dict`` and ``__iter__``
            where each ``iter()`` is its next epoch (``unbroken.resumable(...)``,
            ``unbroken.DataLoader``, torchdata's ``StatefulDataLoader``) is used as is, and must
            have no other consumer; anything else (a list, ``make_iterable(epoch)``) is wrapped in
            ``unbroken.resumable``.
        size: Items per window (memory: one window of items).
        seed: The shuffle's seed, an int in [0, 2**64); checked on load.

    Raises:
        ValueError: ``size`` is not an int >= 1, or ``seed`` not an int in [0, 2**64).
    """

    def __init__(self, iterable: Any, size: int, *, seed: int) -> None:
        if not is_int(size) or size < 1:
            raise ValueError(f"size must be an int >= 1 (items per window), got {size!r}")
        check_seed("seed", seed)
        stateful = has_state(iterable) and isinstance(iterable, Iterable)
        self.upstream = iterable if stateful else Resumable(iterable)
        # An upstream made here has no other consumer: its position is the buffer's, checked on
        # load (a user's may have been iterated before, or count in batches of its own).
        self._own_upstream = not stateful
        self.size, self.seed = size, seed
        self._stash: Iterator | None = None  # the upstream's iterator for the next iter()
        self._init_epochs()

    def __len__(self) -> int:
        """Items in a whole epoch: the upstream's ``len()`` (``TypeError`` if it has none)."""
        return len(self.upstream)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` start ``epoch`` from its first item.

        Args:
            epoch: The epoch to start.

        Raises:
            TypeError: the upstream has no ``set_epoch`` (``unbroken.resumable`` and
                ``unbroken.DataLoader`` have one).
        """
        if not callable(getattr(self.upstream, "set_epoch", None)):
            raise TypeError(
                f"{_WHAT}.set_epoch needs an upstream with set_epoch(); "
                f"a {type(self.upstream).__qualname__} has none"
            )
        self.upstream.set_epoch(epoch)
        super().set_epoch(epoch)

    def _start_position(self, ended: _WindowPosition | None) -> _WindowPosition:
        # After set_epoch (and at first) the upstream is at its epoch's start (_LIVE); after an
        # epoch, wherever that epoch left it (its state, or _NEXT if it was left mid-way).
        return _WindowPosition() if ended is None else _WindowPosition(upstream=ended.after)

    def _move(self, epoch: int, position: _WindowPosition) -> None:
        super()._move(epoch, position)
        self._stash = None

    def _upstream_state(self) -> Any:
        """The upstream's state at the start of the current window (or after the epoch)."""
        pos = self._pos
        if pos.upstream is _NEXT:
            # The upstream's epoch was left mid-way and may end only at its next iter(): iterate
            # it now (the next loop uses this iterator), so the state describes its next epoch.
            self._stash = iter(self.upstream)
            pos.upstream = take_state(self.upstream, _WHAT)
        elif pos.upstream is _LIVE:
            pos.upstream = take_state(self.upstream, _WHAT)
        return pos.upstream

    def _run(self, pos: _WindowPosition, epoch: int) -> Generator[Any, None, Any]:
        if pos.end:  # saved right after the epoch's last item: nothing remains
            pos.after = pos.upstream
            return
        upstream_items, self._stash = self._stash, None
        if upstream_items is None:
            upstream_items = iter(self.upstream)
        if pos.upstream is _NEXT:
            pos.upstream = _LIVE  # iterated just now: its state is the new epoch's start
        self._upstream_state()
        try:
            pos.after = yield from self._windows(pos, epoch, self.size, upstream_items)
        except GeneratorExit:  # dropped mid-epoch (a `break`): the next epoch starts from here
            if pos is self._pos:
                pos.after = self._after_break(upstream_items)
            raise

    def _windows(
        self, pos: _WindowPosition, epoch: int, size: int, upstream_items: Iterator
    ) -> Generator[Any, None, Any]:
        """Emit the epoch's windows from ``pos``; return the upstream's state after its end."""
        window, skip = pos.window, pos.emitted
        while True:
            items = list(itertools.islice(upstream_items, size))
            after = take_state(self.upstream, _WHAT)
            if skip and len(items) <= skip:
                raise StateMismatch(
                    _WHAT,
                    "emitted",
                    skip,
                    len(items),
                    message=(
                        f"{_WHAT}: the state says {skip} items of window {window} of epoch "
                        f"{epoch} were emitted, but the upstream now yields {len(items)} for "
                        "it; the upstream is not deterministic, or not the one that saved it"
                    ),
                )
            if not items:
                return after
            count = len(items)
            exhausted = count < size
            # The rest of the window in reverse order, so that pop() emits it and drops it.
            rest = [items[k] for k in reversed(self._permutation(epoch, window, count)[skip:])]
            del items
            for j in range(skip, count):
                if j + 1 < count:
                    pos.window, pos.emitted = window, j + 1
                elif exhausted:  # the epoch's last item; the upstream's epoch has ended
                    pos.emitted, pos.end, pos.upstream = j + 1, True, after
                else:  # the window's last item: the next window starts where it ended
                    pos.window, pos.emitted, pos.upstream = window + 1, 0, after
                yield rest.pop()
            if exhausted:
                return after
            window, skip = window + 1, 0

    def _after_break(self, upstream_items: Iterator) -> Any:
        """Close the upstream's iterator; its state if that ended its epoch, else ``_NEXT``."""
        before = getattr(self.upstream, "epoch", None)
        close = getattr(upstream_items, "close", None)
        if callable(close):
            close()  # unbroken's loaders end their epoch when their iterator is dropped
        ended = before is not None and getattr(self.upstream, "epoch", None) != before
        return take_state(self.upstream, _WHAT) if ended else _NEXT

    def _permutation(self, epoch: int, window: int, n: int) -> list[int]:
        key = keys.window(self.seed, epoch, window)
        return np.random.Generator(np.random.Philox(key=key)).permutation(n).tolist()

    def _check_window(self, epoch: int, window: int, end: bool, upstream: dict) -> None:
        """The upstream's state is taken at the start of the current window, or after its epoch
        when ``end``; a window (or epoch) edited apart from it would emit another window's
        permutation over these items: one item twice and another never."""
        read, its_epoch = upstream.get("items"), upstream.get("epoch")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (read, its_epoch)):
            return  # malformed: the upstream's own load_state_dict names the field
        expected = (0, epoch + 1) if end else (window * self.size, epoch)
        if (read, its_epoch) != expected:
            raise CorruptState(
                f"{_WHAT} state field 'window': window={window} of epoch={epoch} (end={end}) "
                f"in windows of {self.size} expects the upstream at items={expected[0]} of its "
                f"epoch {expected[1]}, but its state says items={read} of epoch {its_epoch}; the "
                "state is corrupt"
            )

    def state_dict(self) -> ShuffleBufferState:
        """The buffer's position.

        Returns:
            The state, JSON-serializable and as small as the upstream's state.

        Raises:
            ValueError: the upstream's state cannot be saved as JSON (named by its key).
        """
        pos = self._pos
        upstream = self._upstream_state()
        raise_if_unsaveable(upstream)
        return {
            "format": SHUFFLE_BUFFER.name,
            "version": SHUFFLE_BUFFER.version,
            "size": self.size,
            "seed": self.seed,
            "epoch": self._epoch,
            "window": pos.window,
            "emitted": pos.emitted,
            "end": pos.end,
            "upstream": upstream,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the upstream to the current window's start and the position in it.

        Nothing changes unless the whole state is valid. The upstream checks its own part,
        and its refusal keeps its type.

        Args:
            state: What ``state_dict()`` returned, maybe through JSON.

        Raises:
            CorruptState: the state is malformed: a field of the wrong type or out of range, or
                (when the buffer made the upstream) a window apart from the upstream's state.
            StateMismatch: the state is from another format or version, or was saved with
                another ``size`` or ``seed``.
        """
        reader = StateReader(state, _WHAT, SHUFFLE_BUFFER)
        for field in ("size", "seed"):
            if not same(state[field], getattr(self, field)):
                raise StateMismatch(
                    _WHAT,
                    field,
                    state[field],
                    getattr(self, field),
                    "Build the buffer with the saved setting, or start a new run.",
                )
        end = reader.bool("end")
        epoch = reader.int("epoch")
        window = reader.int("window", 0, COUNT_LIMIT // self.size)
        # A state after the epoch's last item (end) has emitted some of a last, partial window.
        try:
            emitted = reader.int("emitted", 1 if end else 0, self.size - 1)
        except CorruptState as error:
            raise CorruptState(f"{error}, with end={end}", "emitted") from None
        upstream = state["upstream"]
        check_user_state(upstream, f"{_WHAT} state field 'upstream'")
        if self._own_upstream:
            self._check_window(epoch, window, end, upstream)
        try:
            self.upstream.load_state_dict(from_jsonable(state["upstream"]))
        except ValueError as error:
            raise prefixed(error, f"{_WHAT} state field 'upstream': ") from None
        self._restore(
            epoch, _WindowPosition(window, emitted, end, copy.deepcopy(state["upstream"]))
        )
