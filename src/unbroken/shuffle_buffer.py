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
permutation (~20 us + 0.1 us per item) and one upstream ``state_dict()`` (about 0.3-0.5 us per
item in all for windows of 100-10,000 over ``unbroken.resumable``); a resume costs the
upstream's own restore plus re-reading at most ``size - 1`` items.

State: ``{"format", "version", "size", "seed", "epoch", "window", "emitted", "end",
"upstream"}``; ``end`` marks a state taken right after the epoch's last item, when the
upstream has ended its epoch.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ._shuffle import derive_key
from ._state import StateReader, from_jsonable, mismatch
from .resumable import Resumable, Unsaveable, has_state, snapshot

FORMAT = "unbroken.shuffle_buffer"
VERSION = 1
_FIELDS = {"format", "version", "size", "seed", "epoch", "window", "emitted", "end", "upstream"}
_DOMAIN = 0x5348554646  # keeps these permutations apart from other uses of the same seed
_LIVE = object()  # the upstream has not been read since it was made: ask it for its state
_WHAT = "unbroken.shuffle_buffer"


def shuffle_buffer(iterable: Any, size: int, *, seed: int) -> ShuffleBuffer:
    """Shuffle a stream in windows of ``size`` items, resumably: see ``ShuffleBuffer``."""
    return ShuffleBuffer(iterable, size, seed=seed)


class _Position:
    """The current window, how many of its items were emitted, and the upstream's state at its
    start (after the epoch's end when ``end``)."""

    __slots__ = ("window", "emitted", "end", "upstream")

    def __init__(self, window: int = 0, emitted: int = 0, end: bool = False,
                 upstream: Any = _LIVE) -> None:
        self.window, self.emitted, self.end, self.upstream = window, emitted, end, upstream


class ShuffleBuffer:
    """A windowed shuffle of ``iterable`` with unbroken's loader protocol.

    - ``iterable``: the upstream. An object with ``state_dict``/``load_state_dict`` and
      ``__iter__`` where each ``iter()`` is its next epoch (``unbroken.resumable(...)``,
      ``unbroken.DataLoader``, torchdata's ``StatefulDataLoader``) is used as is, and must
      have no other consumer; anything else (a list, ``make_iterable(epoch)``) is wrapped in
      ``unbroken.resumable``.
    - ``size``: items per window (memory: one window of items).
    - ``seed``: the shuffle's seed, an int in [0, 2**64); checked on load.

    ``iter()`` and epochs work as for ``unbroken.DataLoader``; each ``iter()`` of the buffer
    iterates the upstream once.
    """

    def __init__(self, iterable: Any, size: int, *, seed: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1 (items per window), got {size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        stateful = has_state(iterable) and isinstance(iterable, Iterable)
        self.upstream = iterable if stateful else Resumable(iterable)
        self.size, self.seed = size, seed
        self._epoch = 0
        self._pos = _Position()
        self._open = False  # an iteration of this epoch has yielded an item

    @property
    def epoch(self) -> int:
        """The epoch the buffer is in, or will start at the next ``iter()``."""
        return self._epoch

    def __len__(self) -> int:
        """Items in a whole epoch: the upstream's ``len()`` (``TypeError`` if it has none)."""
        return len(self.upstream)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` start ``epoch`` from its first item (needs the upstream's
        ``set_epoch``, which ``unbroken.resumable`` and ``unbroken.DataLoader`` have)."""
        if not callable(getattr(self.upstream, "set_epoch", None)):
            raise TypeError(f"{_WHAT}.set_epoch needs an upstream with set_epoch(); "
                            f"a {type(self.upstream).__qualname__} has none")
        self.upstream.set_epoch(epoch)
        self._epoch, self._pos, self._open = epoch, _Position(), False

    def __iter__(self) -> Iterator:
        if not self._open:
            return self._run(None)
        # The previous iteration yielded items and was abandoned: its epoch is over, and
        # iterating the upstream again ends the upstream's epoch too. Its state is taken now,
        # so a state_dict() before the first item describes the new epoch.
        self._epoch += 1
        self._open = False
        upstream_items = iter(self.upstream)
        self._pos = _Position(upstream=snapshot(self.upstream, _WHAT))
        return self._run(upstream_items)

    def _run(self, upstream_items: Iterator | None) -> Iterator:
        pos, epoch, size = self._pos, self._epoch, self.size
        after = pos.upstream  # the upstream's state once its epoch has ended
        if not pos.end:
            if upstream_items is None:
                upstream_items = iter(self.upstream)
            if pos.upstream is _LIVE:
                pos.upstream = snapshot(self.upstream, _WHAT)
            window, skip = pos.window, pos.emitted
            while True:
                items = list(itertools.islice(upstream_items, size))
                after = snapshot(self.upstream, _WHAT)
                if skip and len(items) <= skip:
                    raise ValueError(
                        f"{_WHAT}: the state says {skip} items of window {window} of epoch "
                        f"{epoch} were emitted, but the upstream now yields {len(items)} for "
                        "it; the upstream is not deterministic, or not the one that saved it"
                    )
                if not items:
                    break
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
                    self._open = True
                    yield rest.pop()
                if exhausted:
                    break
                window, skip = window + 1, 0
        # Reached only when the loop asks past the last item (see unbroken.DataLoader).
        if pos is self._pos:
            self._epoch += 1
            self._pos, self._open = _Position(upstream=after), False

    def _permutation(self, epoch: int, window: int, n: int) -> list[int]:
        key = derive_key(self.seed, _DOMAIN, epoch, window)
        return np.random.Generator(np.random.Philox(key=key)).permutation(n).tolist()

    def state_dict(self) -> dict:
        """The buffer's position: JSON-serializable, as small as the upstream's state.

        Raises ``ValueError`` naming the key if the upstream's state cannot be saved as JSON.
        """
        pos = self._pos
        upstream = snapshot(self.upstream, _WHAT) if pos.upstream is _LIVE else pos.upstream
        if isinstance(upstream, Unsaveable):
            raise upstream.error
        return {
            "format": FORMAT, "version": VERSION, "size": self.size, "seed": self.seed,
            "epoch": self._epoch, "window": pos.window, "emitted": pos.emitted, "end": pos.end,
            "upstream": upstream,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the upstream to the current window's start and the position in it.

        Raises ``ValueError`` naming the field if the state is malformed, from another format
        or version, or was saved with another ``size`` or ``seed``; the upstream checks its own
        part. Nothing changes unless the buffer's fields are valid.
        """
        reader = StateReader(state, _WHAT, _FIELDS, FORMAT, VERSION)
        for field in ("size", "seed"):
            if state[field] != getattr(self, field):
                raise mismatch(_WHAT, field, state[field], getattr(self, field),
                               "Build the buffer with the saved setting, or start a new run.")
        epoch, window = reader.int("epoch"), reader.int("window")
        end = state["end"]
        if not isinstance(end, bool):
            raise ValueError(f"{_WHAT} state field 'end': expected a bool, got {end!r}")
        emitted = reader.int("emitted", 1 if end else 0, self.size - 1)
        try:
            self.upstream.load_state_dict(from_jsonable(state["upstream"]))
        except ValueError as error:
            raise ValueError(f"{_WHAT} state field 'upstream': {error}") from None
        self._epoch, self._open = epoch, False
        self._pos = _Position(window, emitted, end, copy.deepcopy(state["upstream"]))
