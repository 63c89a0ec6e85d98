"""``unbroken.CombinedLoader``: several resumable loaders as one, in Lightning's four modes.

``CombinedLoader({"a": loader_a, "b": loader_b}, mode="max_size_cycle")`` iterates its children
together and resumes exactly: its state holds each child's ``state_dict()`` plus a few flags,
all taken at the combined batch the user received. The modes are PyTorch Lightning's:

- ``max_size_cycle`` (default): one batch of every child per step, until the longest child is
  exhausted; shorter children restart (begin their next epoch) when they run out.
- ``min_size``: one batch of every child per step, until the shortest child is exhausted.
- ``max_size``: one batch of every child per step, until all are exhausted; an exhausted
  child gives ``None``.
- ``sequential``: all batches of the first child, then of the second, and so on.

The three zip modes yield a dict or list (a tuple for a tuple) of batches mirroring the input.
``sequential`` yields ``(batch, batch_idx, key)``: ``batch_idx`` counts the child's batches in
this combined epoch and ``key`` is the child's dict key or list index (Lightning yields
``dataloader_idx``, the same as ``key`` for a list).

A combined epoch is one pass in the chosen mode. A child that the pass leaves mid-epoch (cut
short in ``min_size``, a cycled child when the longest ends, any child after a ``break``) is
moved to its next epoch with ``child.set_epoch(child.epoch + 1)`` when the combined epoch ends,
so a resumed child and one that was abandoned in this process continue alike. Cost per step:
one ``next()`` per child and a few flags; nothing is replayed on resume.

The checks close the module: a child's methods at construction, and a loaded state's entries
and the invariants every state that ``state_dict`` takes satisfies in each mode.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping
from typing import Any

from .._state import StateReader, check_int, same, schema_fields
from ..errors import CorruptState, StateMismatch, prefixed
from .epochs import EpochIterable, check_epoch
from .states import COMBINED, ChildPosition, CombinedState

MODES = ("max_size_cycle", "min_size", "max_size", "sequential")
_WHAT = "unbroken.CombinedLoader"
_CHILD_FIELDS = schema_fields(ChildPosition)
_END = object()  # what a step returns when the combined epoch is over


class _Progress:
    """Where a combined epoch is: its batches, the child being iterated (sequential), and per
    child its batches, whether it ran out and whether its own epoch is open, and its iterator."""

    def __init__(self, n: int, batches: int = 0, current: int = 0) -> None:
        self.batches, self.current = batches, current
        self.child_batches = [0] * n
        self.exhausted = [False] * n  # ran out at least once in this combined epoch
        self.child_open = [False] * n  # the child's own epoch is started and not ended
        self.iters: list[Iterator | None] = [None] * n


class CombinedLoader(EpochIterable[_Progress]):
    """Iterate a dict or list of resumable loaders together; ``state_dict()`` resumes it exactly.

    ``iter()`` continues the combined epoch that ``load_state_dict`` restored; otherwise each
    ``iter()`` starts the next combined epoch, also after a ``break``. An ``iter()`` that yielded
    nothing starts nothing.

    Args:
        loaders: A dict (``str`` keys) or a list/tuple of iterables with ``state_dict()`` and
            ``load_state_dict()``, typically ``unbroken.DataLoader``. ``min_size`` and
            ``max_size_cycle`` also need ``epoch`` and ``set_epoch()`` to end a child's epoch early.
        mode: ``"max_size_cycle"`` (default), ``"min_size"``, ``"max_size"`` or ``"sequential"``.

    Raises:
        ValueError: an unknown mode, no loader, or one loader passed twice.
        TypeError: ``loaders`` is not a dict or list, or a dict key is not a ``str``.
    """

    def __init__(
        self, loaders: Mapping[str, Any] | list | tuple, mode: str = "max_size_cycle"
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(loaders, Mapping):
            bad = [key for key in loaders if not isinstance(key, str)]
            if bad:
                raise TypeError(
                    f"CombinedLoader dict keys must be str (they name the loaders in "
                    f"the saved state), got {bad[0]!r}"
                )
            self._keys: list[Any] = list(loaders)
            children = list(loaders.values())
        elif isinstance(loaders, (list, tuple)):
            self._keys, children = list(range(len(loaders))), list(loaders)  # keys: indices
        else:
            raise TypeError(
                f"CombinedLoader takes a dict or a list of loaders, got a {type(loaders).__name__}"
            )
        if not children:
            raise ValueError("CombinedLoader needs at least one loader")
        for key, child in zip(self._keys, children):
            check_child(key, child, mode)
        for i, child in enumerate(children):
            for j in range(i):
                if children[j] is child:
                    raise ValueError(
                        f"CombinedLoader: the same loader is passed as "
                        f"{self._keys[j]!r} and {self._keys[i]!r}; pass two loaders"
                    )
        self.loaders, self.mode, self._children = loaders, mode, children
        self._init_epochs()

    def __len__(self) -> int:
        """Batches in a whole combined epoch, from the children's lengths."""
        lengths = []
        for key, child in zip(self._keys, self._children):
            try:
                lengths.append(len(child))
            except TypeError:
                raise TypeError(f"CombinedLoader has no len(): loader {key!r} has none") from None
        if self.mode == "min_size":
            return min(lengths)
        return sum(lengths) if self.mode == "sequential" else max(lengths)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` start combined epoch ``epoch`` from its first batch.

        Children left mid-epoch begin their next epoch, as at the end of a combined epoch.

        Args:
            epoch: The combined epoch to start, an int >= 0.
        """
        check_epoch(epoch)
        self._close_epoch(self._pos)
        self._move(epoch, self._start_position(None))

    def _start_position(self, ended: _Progress | None) -> _Progress:
        return _Progress(len(self._children))

    def _run(self, pos: _Progress, epoch: int) -> Generator[Any, None, Any]:
        step, held = getattr(self, "_step_" + self.mode), []
        while pos is self._pos:  # a set_epoch, iter() or load_state_dict since: this one is stale
            held.append(step(pos))
            if held[0] is _END:
                return
            pos.batches += 1
            yield held.pop()  # no reference kept to a batch the user drops (see EpochIterable)

    def _next(self, pos: _Progress, i: int) -> Any:
        """The child's next batch, or ``_END`` (its epoch ended: marked exhausted)."""
        iterator = pos.iters[i]
        if iterator is None:
            iterator = pos.iters[i] = iter(self._children[i])
        try:
            batch = next(iterator)
        except StopIteration:
            pos.iters[i] = None
            pos.exhausted[i], pos.child_open[i] = True, False
            return _END
        pos.child_batches[i] += 1
        pos.child_open[i] = True
        return batch

    def _step_max_size_cycle(self, pos: _Progress) -> Any:
        n = len(self._children)
        # Children that have not run out yet go first: if they all run out now, the epoch ends
        # before a cycled child draws a batch nobody receives.
        probed = [not exhausted for exhausted in pos.exhausted]
        out = [self._next(pos, i) if probed[i] else _END for i in range(n)]
        if all(pos.exhausted):
            return _END
        for i in range(n):
            if not probed[i]:
                out[i] = self._next(pos, i)  # a child that is being cycled
            if out[i] is _END:  # it ran out: restart it, which begins its next epoch
                out[i] = self._next(pos, i)
                if out[i] is _END:
                    raise ValueError(
                        f"CombinedLoader(mode='max_size_cycle'): loader {self._keys[i]!r} yielded "
                        "no batch right after a restart, so it cannot be cycled; use "
                        "mode='max_size' or leave the empty loader out"
                    )
        return self._pack(out)

    def _step_min_size(self, pos: _Progress) -> Any:
        out = []
        for i in range(len(self._children)):
            batch = self._next(pos, i)
            if batch is _END:
                return _END
            out.append(batch)
        return self._pack(out)

    def _step_max_size(self, pos: _Progress) -> Any:
        out: list = [None] * len(self._children)
        for i in range(len(self._children)):
            if not pos.exhausted[i]:
                batch = self._next(pos, i)
                out[i] = None if batch is _END else batch
        return _END if all(pos.exhausted) else self._pack(out)

    def _step_sequential(self, pos: _Progress) -> Any:
        while pos.current < len(self._children):
            i = pos.current
            batch = self._next(pos, i)
            if batch is not _END:
                return batch, pos.child_batches[i] - 1, self._keys[i]
            pos.current += 1
        return _END

    def _pack(self, out: list) -> Any:
        if isinstance(self.loaders, Mapping):
            return dict(zip(self._keys, out))
        return tuple(out) if isinstance(self.loaders, tuple) else out

    def _close_epoch(self, ended: _Progress) -> None:
        # A child left mid-epoch begins its next epoch, whether this process iterated it or only
        # loaded its state: for both, child.epoch is still the epoch that was cut short.
        for i, child in enumerate(self._children):
            if ended.child_open[i]:
                cut_short = getattr(child, "epoch", None)  # before close(), which may end it
                iterator = ended.iters[i]
                _close(iterator)
                if cut_short is not None and sets_epochs(child):
                    child.set_epoch(cut_short + 1)
                # else (max_size, sequential): the child was iterated in this process, and its
                # next iter() starts its next epoch by itself, as torch's DataLoader does.

    def state_dict(self) -> CombinedState:
        """The combined batches the user received.

        Returns:
            The state, holding each child's ``state_dict()``: JSON if the children's states are.
        """
        pos, n = self._pos, len(self._children)
        return {
            "format": COMBINED.name,
            "version": COMBINED.version,
            "mode": self.mode,
            "keys": self._saved_keys(),
            "epoch": self._epoch,
            "batches": pos.batches,
            "current": pos.current if self.mode == "sequential" else None,
            "loaders": [
                {
                    "state": self._children[i].state_dict(),
                    "batches": pos.child_batches[i],
                    "exhausted": pos.exhausted[i],
                    "open": pos.child_open[i],
                }
                for i in range(n)
            ],
        }

    def _saved_keys(self) -> list | int:
        return list(self._keys) if isinstance(self.loaders, Mapping) else len(self._keys)

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` continue right after the last combined batch the saved loader
        yielded.

        The combined position changes only if the whole state loads. Children loaded before a
        failing one get their previous states back.

        Args:
            state: What ``state_dict()`` returned, maybe through JSON.

        Raises:
            CorruptState: the state is malformed; it names the field.
            StateMismatch: the state is from another version, or was saved with another mode or
                other loaders.
            ValueError: a child refused its own state; its error is passed on, of the same type,
                with the child's key in front.
        """
        reader = StateReader(state, _WHAT, COMBINED)
        if not same(state["mode"], self.mode):
            raise StateMismatch(_WHAT, "mode", state["mode"], self.mode)
        if not same(state["keys"], self._saved_keys()):  # strictly: a count of True is not 1
            raise StateMismatch(
                _WHAT,
                "keys",
                state["keys"],
                self._saved_keys(),
                "A state resumes the same loaders under the same keys.",
            )
        epoch, batches = reader.int("epoch"), reader.int("batches")
        entries = state["loaders"]
        n = len(self._children)
        if not isinstance(entries, list) or len(entries) != n:
            raise CorruptState(
                f"{_WHAT} state field 'loaders': expected a list of {n} entries, "
                f"got {entries!r:.200}",
                "loaders",
            )
        for key, entry in zip(self._keys, entries):
            check_entry(key, entry)
        current = state["current"]
        check_progress(self.mode, batches, current, entries)

        before = []
        try:
            for key, child, entry in zip(self._keys, self._children, entries):
                previous = child.state_dict()
                try:
                    child.load_state_dict(entry["state"])
                except ValueError as error:
                    raise prefixed(error, f"{_WHAT} loader {key!r}: ") from error
                before.append((child, previous))
        except BaseException:
            for child, previous in before:
                child.load_state_dict(previous)
            raise

        for iterator in self._pos.iters:
            _close(iterator)
        pos = _Progress(n, batches, 0 if current is None else current)
        pos.child_batches = [entry["batches"] for entry in entries]
        pos.exhausted = [entry["exhausted"] for entry in entries]
        pos.child_open = [entry["open"] for entry in entries]
        self._restore(epoch, pos)


def _close(iterator: Any) -> None:
    """End a child's iteration now (a generator, or an ``unbroken.DataLoader``'s iterator)."""
    close = getattr(iterator, "close", None)
    if callable(close):
        close()


# The checks: of the children (at construction), and of a loaded state's entries and the
# invariants every state that ``state_dict`` takes satisfies in each mode (run before anything
# changes).
def check_entry(key: Any, entry: Any) -> None:
    where = f"{_WHAT} state field 'loaders' entry {key!r}"
    if not isinstance(entry, dict) or set(entry) != _CHILD_FIELDS:
        raise CorruptState(
            f"{where}: expected a dict with fields {sorted(_CHILD_FIELDS)}, got {entry!r:.200}"
        )
    check_int(entry["batches"], f"{where}: 'batches'")
    for flag in ("exhausted", "open"):
        if not isinstance(entry[flag], bool):
            raise CorruptState(f"{where}: '{flag}' must be a bool, got {entry[flag]!r}", "loaders")


def check_progress(mode: str, batches: int, current: Any, entries: list) -> None:
    """The invariants every state that ``state_dict`` takes satisfies, per mode."""
    counts = [entry["batches"] for entry in entries]
    exhausted = [entry["exhausted"] for entry in entries]
    opened = [entry["open"] for entry in entries]
    n = len(entries)
    if mode == "sequential":
        first = next((i for i in range(n) if not exhausted[i]), n)
        ok = (
            isinstance(current, int)
            and not isinstance(current, bool)
            and current == first < n
            and sum(counts) == batches
            and not any(opened[:current] + opened[current + 1 :])
            and not any(exhausted[current:])
            and not any(counts[current + 1 :])
        )
    else:
        ok = current is None and all(c <= batches for c in counts) and not all(exhausted)
        if mode == "max_size":
            ok = ok and not any(e and o for e, o in zip(exhausted, opened))
            ok = ok and all(c == batches for c, e in zip(counts, exhausted) if not e)
        else:  # every child gives a batch at every step
            ok = ok and all(c == batches for c in counts)
            ok = ok and (mode == "max_size_cycle" or not any(exhausted))
    # A child that gave batches in this combined epoch and has not run out is mid-epoch.
    ok = ok and all(o for c, e, o in zip(counts, exhausted, opened) if c and not e)
    if batches == 0:  # the start of a combined epoch: nothing is in progress
        ok = ok and not any(counts) and not any(opened) and not any(exhausted)
        ok = ok and current in (None, 0)
    if not ok:
        raise CorruptState(
            f"{_WHAT} state is inconsistent: batches={batches}, current={current!r} and the "
            f"loaders' counts {counts}, exhausted {exhausted}, open {opened} do not describe a "
            f"position in mode {mode!r}; the state is corrupt"
        )


def check_child(key: Any, child: Any, mode: str) -> None:
    name = f"{type(child).__module__}.{type(child).__qualname__}"
    needed = ("__iter__", "state_dict", "load_state_dict")
    if not all(callable(getattr(child, method, None)) for method in needed):
        raise TypeError(
            f"CombinedLoader: loader {key!r} (a {name}) needs __iter__, state_dict() and "
            "load_state_dict(): without them a resume would silently restart it. Use "
            "unbroken.DataLoader (or any loader that saves its position)."
        )
    if mode in ("min_size", "max_size_cycle") and not sets_epochs(child):
        raise TypeError(
            f"CombinedLoader(mode={mode!r}): loader {key!r} (a {name}) needs `epoch` and "
            "set_epoch(): this mode ends children's epochs early and moves them to their next "
            "epoch with child.set_epoch(child.epoch + 1). Use unbroken.DataLoader, or "
            "mode='max_size' or 'sequential'."
        )


def sets_epochs(child: Any) -> bool:
    return callable(getattr(child, "set_epoch", None)) and hasattr(child, "epoch")
