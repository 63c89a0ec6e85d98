"""The checks of a ``CombinedLoader``: its children (at construction), and a loaded state's
entries and the invariants every state that ``state_dict`` takes satisfies in each mode (run
before anything changes)."""

from __future__ import annotations

from typing import Any

from .._state import check_int, schema_fields
from ..errors import CorruptState
from .states import ChildPosition

_CHILD_FIELDS = schema_fields(ChildPosition)
_WHAT = "unbroken.CombinedLoader"


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
