"""The dataset the inner torch loader holds stands in for the user's dataset.

Inside a worker, torch's ``get_worker_info().dataset`` is the dataset the inner torch loader
was given: unbroken's wrapper (``SeededDataset``, ``StreamWorker``), not the user's. Code
written for torch's DataLoader reads and configures the user's dataset there: torch's recipe
splits an ``IterableDataset`` across workers in ``worker_init_fn`` by setting
``get_worker_info().dataset.start``, and a map-style dataset may open a file handle per worker.
So the wrapper stands in for the user's dataset copy in that process: ``isinstance`` and
attribute reads and writes go to it (as with ``unittest.mock``'s ``spec``, ``isinstance``
consults ``__class__``); only ``type()`` tells them apart.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

_DUNDER = ("__", "__")


class StandIn:
    """A wrapper that stands in for the user's dataset. Its own attributes are named in
    ``_OWN``, with a prefix no user's dataset has (``_unbroken_``), since every other name
    reads and writes the user's; ``_STOOD_FOR`` names the one that holds the user's dataset."""

    _OWN: frozenset[str] = frozenset()
    _STOOD_FOR: str

    def _user(self) -> Any:
        # From __dict__, not through __getattr__: while unpickling, it is not there yet.
        try:
            return self.__dict__[self._STOOD_FOR]
        except KeyError:
            raise AttributeError("the user's dataset is not set yet") from None

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        mine = type(self)
        try:
            theirs = type(self._user())
        except AttributeError:
            return mine
        # Never a class that would make torch take the wrapper for another kind of dataset.
        if issubclass(theirs, IterableDataset) != issubclass(mine, IterableDataset):
            return mine
        return theirs

    def __getattr__(self, name: str) -> Any:  # only for names the wrapper does not have
        if name.startswith(_DUNDER[0]) and name.endswith(_DUNDER[1]):
            raise AttributeError(name)
        return getattr(self._user(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._user(), name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._OWN:
            object.__delattr__(self, name)
        else:
            delattr(self._user(), name)

    def __reduce__(self) -> tuple:
        # pickle would take __class__ for the class to rebuild: name the wrapper's own.
        state = self.__getstate__() if "__getstate__" in type(self).__dict__ else self.__dict__
        return (_rebuild, (type(self),), state)


def _rebuild(cls: type) -> Any:
    return object.__new__(cls)
