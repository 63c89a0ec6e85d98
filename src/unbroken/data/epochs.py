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
  uninterrupted run's next ``iter()`` will.
- An ``iter()`` that yielded nothing starts nothing (``tqdm.auto`` makes an extra one).
- The epoch ends when the loop asks past the last item; a state taken inside the loop, after
  the last item, still describes the epoch (its remainder is empty).
- ``set_epoch(n)`` makes the next ``iter()`` start epoch ``n`` from its first item.
- ``load_state_dict`` changes nothing unless the whole state is valid: each class reads the
  whole state into a new position first, and only then swaps it in with ``_restore``. Until
  the restored position yields an item, ``_restored`` says so (``torch_api.OrderView``: a sampler's
  ``set_epoch`` keeps such a position).

Two iterations open at once (``zip(loader, loader)``, ``next(iter(loader))`` inside a loop over
it) depend on the class:

- *independent* (``DataLoader``, whose source can start anywhere): as with torch's loader, each
  iteration has its own position. One that starts while another holds the current position
  reads the same epoch from its first item, on its own. The state describes the iteration that
  delivered an item last (the one the training loop is on); when that one is abandoned while
  another of the same epoch is open (a peek inside a loop), the state is the other's again.
  ``set_epoch``, ``load_state_dict`` and an epoch's end start a new *generation*: iterations
  bound before it still yield their items but never change the state.
- *dependent* (the others, which read one user object's iterator): one still held but
  superseded by a new ``iter()`` ends its epoch at that ``iter()``.

A subclass says what a *position* inside an epoch is and how to go on from one:

    class Countdown(EpochIterable[list]):       # position: [items received]
        def _start_position(self, ended):
            return [0]
        def _run(self, position, epoch):
            for value in range(position[0], 3):
                position[0] = value + 1         # before the yield: state is what was received
                yield value

``_run`` updates the position *before* each yield, so a state taken while the user holds an
item counts it. An iterator object that does the work of ``_run`` itself (the ``DataLoader``'s)
takes its place with an ``Iteration`` at its first ``next()`` and reports through it
(``yielded``, ``finished``, ``abandoned``, ``interrupted``); ``upcoming`` says where one would
start now.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, Generic, TypeVar

from .._checks import is_int

P = TypeVar("P")


class Binding(Generic[P]):
    """One iteration's place: its position object, its epoch, and the generation it began in."""

    __slots__ = ("epoch", "generation", "position")

    def __init__(self, position: P, epoch: int, generation: int) -> None:
        self.position, self.epoch, self.generation = position, epoch, generation


class EpochIterable(Generic[P]):
    """Base class that owns the epoch, the position in it and whether an iteration is open."""

    _independent = False  # whether two iterations open at once each have their own position
    _epoch: int
    _pos: P
    _open: bool  # an iteration of this epoch has yielded an item and not finished
    _restored: bool  # the position came from load_state_dict and has yielded nothing yet
    _owner: Binding[P] | None  # the iteration bound to the current position, if any
    _generation: int  # set_epoch, load_state_dict and an epoch's end start a new one
    _live: list[Binding[P]]  # independent: this generation's open ones, last current last

    def _init_epochs(self) -> None:
        """Call once the subclass can build a start position (at the end of ``__init__``)."""
        self._generation = 0
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

    def _current_changed(self) -> None:
        """Called whenever the current epoch or position changes (e.g. to update a view)."""

    def _move(self, epoch: int, position: P) -> None:
        """Make ``position`` of ``epoch`` current, in a new generation."""
        self._epoch, self._pos, self._open, self._restored = epoch, position, False, False
        self._owner, self._live = None, []
        self._generation += 1
        self._current_changed()

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
        """Make the next ``iter()`` start ``epoch`` from its first item.

        Whatever was open or restored is dropped. For code that numbers epochs itself, like
        ``DistributedSampler.set_epoch``, and wrappers that end an epoch early.

        Args:
            epoch: The epoch, an int >= 0.
        """
        check_epoch(epoch)
        self._move(epoch, self._start_position(None))

    def __iter__(self) -> Iterator[Any]:
        if self._open and not self._independent:  # the previous iteration is still held
            self._end_epoch(self._pos)
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # A generator: the position is taken at the first next(), after any set_epoch() or
        # load_state_dict() that came between iter() and it.
        binding = self._bind()
        items = self._run(binding.position, binding.epoch)
        held: list = []
        try:
            for item in items:
                self._yielded(binding)
                # Yielded through a list, so that this frame holds no reference while the user
                # has the item: one that the user drops is freed at once.
                held.append(item)
                del item
                yield held.pop()
        except GeneratorExit:
            items.close()  # the subclass's own clean-up first (it may record how the epoch ended)
            self._abandoned(binding)
            raise
        # Reached only when the loop asks past the last item: a state taken now starts the next
        # epoch, while one taken inside the loop, after the last item, does not.
        self._finished(binding)

    # The bookkeeping of one iteration, for _iterate and for iterator objects of subclasses.
    def _bind(self) -> Binding[P]:
        """The place of an iteration that starts now (``_upcoming``), taken."""
        position, epoch = self._upcoming()
        binding = Binding(position, epoch, self._generation)
        if position is self._pos:
            self._owner = binding
        return binding

    def _upcoming(self) -> tuple[P, int]:
        """The position and epoch an iteration that started now would take: the current
        position, unless (for an independent class) another iteration holds it: then the epoch
        from its first item."""
        if self._independent and self._owner is not None:
            return self._start_position(None), self._epoch
        return self._pos, self._epoch

    def _yielded(self, binding: Binding[P]) -> None:
        """``binding``'s iteration is handing the user an item (its position already counts it)."""
        if binding.position is self._pos:
            if not self._open:  # its first item
                self._open, self._restored = True, False
                if self._independent:
                    self._live.append(binding)
        elif self._independent and binding.generation == self._generation:
            self._switch(binding)  # the state follows the iteration that delivers items

    def _switch(self, binding: Binding[P]) -> None:
        self._epoch, self._pos, self._owner = binding.epoch, binding.position, binding
        self._open, self._restored = True, False
        if binding in self._live:
            self._live.remove(binding)
        self._live.append(binding)
        self._current_changed()

    def _finished(self, binding: Binding[P]) -> None:
        """``binding``'s iteration was asked past its last item."""
        if binding.position is self._pos:
            self._end_epoch(binding.position)
        elif binding in self._live:
            self._live.remove(binding)

    def _abandoned(self, binding: Binding[P]) -> None:
        """``binding``'s iteration was closed, freed or failed before its end."""
        if binding in self._live:
            self._live.remove(binding)
        if binding.position is not self._pos:
            return
        if not self._open:  # it yielded nothing: it started nothing
            self._owner = None
        elif self._live:  # a peek inside a loop: the state is the loop's again
            self._switch(self._live[-1])
        else:
            self._end_epoch(binding.position)

    def _interrupted(self, binding: Binding[P]) -> None:
        """``binding``'s iteration failed and cannot go on: its position stays where it was,
        and the next iteration continues from it (as a run resumed from it would)."""
        if binding in self._live:
            self._live.remove(binding)
        if binding.position is self._pos:
            self._owner, self._open = None, False

    def _end_epoch(self, ended: P) -> None:
        self._close_epoch(ended)
        self._move(self._epoch + 1, self._start_position(ended))


class Iteration(Generic[P]):
    """One iteration of an ``EpochIterable`` driven by an iterator object of its own: its place
    (``position``, ``epoch``; taken when it is made) and its reports to the iterable. It holds
    the iterable, which holds only its ``Binding``: no cycle keeps either alive."""

    __slots__ = ("_binding", "_of")

    def __init__(self, of: EpochIterable[P]) -> None:
        self._of, self._binding = of, of._bind()

    @property
    def position(self) -> P:
        return self._binding.position

    @property
    def epoch(self) -> int:
        return self._binding.epoch

    def yielded(self) -> None:
        """It is handing the user an item (its position already counts it)."""
        self._of._yielded(self._binding)

    def finished(self) -> None:
        """It was asked past its last item."""
        self._of._finished(self._binding)

    def abandoned(self) -> None:
        """It was closed, freed or broken out of before its end."""
        self._of._abandoned(self._binding)

    def interrupted(self) -> None:
        """It failed and cannot go on; the next iteration continues from its position."""
        self._of._interrupted(self._binding)


def upcoming(of: EpochIterable[P]) -> tuple[P, int]:
    """The position and epoch an iteration of ``of`` would take if it started now (to prepare
    it ahead, e.g. start workers), without taking it."""
    return of._upcoming()


def check_epoch(epoch: Any) -> int:
    """``epoch`` if it is an int >= 0 (not a bool), else a ``ValueError`` saying so."""
    if not is_int(epoch) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
    return epoch
