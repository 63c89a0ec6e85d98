"""The epoch protocol, owned once: every resumable iterable in unbroken is an ``EpochIterable``.

The protocol (``DataLoader``, ``CombinedLoader``, ``resumable`` and ``shuffle_buffer`` follow it
alike, and so does anything built on this class):

- ``iter()`` continues the epoch that ``load_state_dict`` restored, and otherwise starts the
  next epoch (the first is epoch 0). ``epoch`` says which. The iterator takes its position at
  its first ``next()``, not at ``iter()``: code that calls ``iter()`` and then ``set_epoch()``
  (Lightning does, whenever it resumes) gets the epoch it set, as with torch's samplers,
  which are generators too.
- An iteration that yielded an item and was abandoned (a ``break``; CPython closes the iterator
  at once) ends its epoch there: a state taken after the loop starts the next epoch, as the
  uninterrupted run's next ``iter()`` will. One still held but superseded by a new ``iter()``
  ends its epoch at that ``iter()``.
- An ``iter()`` that yielded nothing starts nothing (``tqdm.auto`` makes an extra one).
- The epoch ends when the loop asks past the last item; a state taken inside the loop, after
  the last item, still describes the epoch (its remainder is empty).
- ``set_epoch(n)`` makes the next ``iter()`` start epoch ``n`` from its first item.
- ``load_state_dict`` changes nothing unless the whole state is valid: each class reads the
  whole state into a new position first, and only then swaps it in with ``_restore``. Until
  the restored position yields an item, ``_restored`` says so (``views``: a sampler's
  ``set_epoch`` keeps such a position).

A subclass says what a *position* inside an epoch is and how to go on from one:

    class Countdown(EpochIterable[list]):       # position: [items received]
        def _start_position(self, ended):
            return [0]
        def _run(self, position, epoch):
            for value in range(position[0], 3):
                position[0] = value + 1         # before the yield: state is what was received
                yield value

``_run`` updates the position *before* each yield, so a state taken while the user holds an
item counts it. Each iteration has its own position object; one whose position is no longer
current (after ``set_epoch``, ``load_state_dict`` or a newer ``iter()``) changes nothing.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, Generic, TypeVar

P = TypeVar("P")


class EpochIterable(Generic[P]):
    """Base class that owns the epoch, the position in it and whether an iteration is open."""

    _epoch: int
    _pos: P
    _open: bool  # an iteration of this epoch has yielded an item and not finished
    _restored: bool  # the position came from load_state_dict and has yielded nothing yet

    def _init_epochs(self) -> None:
        """Call once the subclass can build a start position (at the end of ``__init__``)."""
        self._move(0, self._start_position(None))

    # What a subclass implements.
    def _start_position(self, ended: P | None) -> P:
        """The position at the start of an epoch; ``ended`` is the epoch that just ended (None
        for the first epoch and after ``set_epoch``)."""
        raise NotImplementedError

    def _run(self, position: P, epoch: int) -> Generator[Any, None, Any]:
        """The epoch's items from ``position`` on, advancing it before each yield."""
        raise NotImplementedError

    def _close_epoch(self, ended: P) -> None:
        """Side effects of an epoch's end (e.g. children moved to their next epoch)."""

    def _move(self, epoch: int, position: P) -> None:
        """Make ``position`` of ``epoch`` current; subclasses drop per-epoch caches here."""
        self._epoch, self._pos, self._open, self._restored = epoch, position, False, False

    def _restore(self, epoch: int, position: P) -> None:
        """``_move`` to a position read from a saved state (``load_state_dict``)."""
        self._move(epoch, position)
        self._restored = True

    # The protocol.
    @property
    def epoch(self) -> int:
        """The epoch being iterated, or the one the next ``iter()`` starts or continues."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` start ``epoch`` from its first item; whatever was open or
        restored is dropped (for code that numbers epochs itself, like
        ``DistributedSampler.set_epoch``, and wrappers that end an epoch early)."""
        check_epoch(epoch)
        self._move(epoch, self._start_position(None))

    def __iter__(self) -> Iterator[Any]:
        if self._open:  # the previous iteration yielded items and is still held: it is over
            self._end_epoch(self._pos)
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # A generator: the position is taken at the first next(), after any set_epoch() or
        # load_state_dict() that came between iter() and it.
        position, epoch = self._pos, self._epoch
        items = self._run(position, epoch)
        held: list = []
        try:
            for item in items:
                if position is self._pos and not self._open:  # once an epoch
                    self._open, self._restored = True, False
                # Yielded through a list, so that this frame holds no reference while the user
                # has the item: one that the user drops is freed at once.
                held.append(item)
                del item
                yield held.pop()
        except GeneratorExit:
            items.close()  # the subclass's own clean-up first (it may record how the epoch ended)
            if position is self._pos and self._open:
                self._end_epoch(position)
            raise
        # Reached only when the loop asks past the last item: a state taken now starts the next
        # epoch, while one taken inside the loop, after the last item, does not.
        if position is self._pos:
            self._end_epoch(position)

    def _end_epoch(self, ended: P) -> None:
        self._close_epoch(ended)
        self._move(self._epoch + 1, self._start_position(ended))


def check_epoch(epoch: Any) -> int:
    """``epoch`` if it is an int >= 0 (not a bool), else a ``ValueError`` saying so."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
    return epoch
