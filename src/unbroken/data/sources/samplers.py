"""Map-style sources driven by the user's own ``sampler`` or ``batch_sampler``.

Restored through the sampler's ``state_dict``/``load_state_dict`` when it has them (O(1)),
otherwise fast-forwarded by skipping what was consumed (O(k), with a warning). The sampler's
state is taken right after each batch is drawn and recorded with that batch, so the saved
state is the one after the last batch the user *received*; ``end`` says whether that batch was
the epoch's last (a sampler may reset itself once exhausted, so its state cannot say it).
"""

from __future__ import annotations

import itertools
import math
import warnings
from abc import abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import Any

from ..._state import (
    check_user_state,
    encode_or_defer,
    from_jsonable,
    has_state,
    raise_if_unsaveable,
)
from ...errors import CorruptState, StateMismatch
from .. import keys
from .base import Arguments, BatchSource, Cursor
from .fetch import Keys
from .orders import IndexSource


class _UserOrder(IndexSource):
    """Shared logic of a user sampler or batch sampler: epoch, state, or skipping."""

    def __init__(self, sampler: Any) -> None:
        super().__init__()
        self.sampler = sampler
        self.stateful = has_state(sampler)
        self._warned = False

    def fingerprint(self) -> dict[str, Any]:
        cls = type(self.sampler)
        return {"sampler": f"{cls.__module__}.{cls.__qualname__}", "shuffle": None}

    def check_saveable(self, source: dict | None) -> None:
        if source is not None:
            raise_if_unsaveable(source["state"])

    def check_cursor(self, cursor: Cursor, what: str) -> None:
        saved, samples, batches = cursor.source, cursor.samples, cursor.batches
        # Before the epoch's first batch there is no sampler state; after it, always one entry.
        started = batches > 0
        well_formed = (
            saved is None
            if not started
            else (
                isinstance(saved, dict)
                and set(saved) == {"state", "end"}
                and isinstance(saved["end"], bool)
            )
        )
        if not well_formed:
            expected = (
                "null at the start of an epoch"
                if not started
                else "{'state': ..., 'end': bool} after a batch"
            )
            raise CorruptState(
                f"{what} state field 'source': expected {expected} (batches={batches}), "
                f"got {saved!r:.200}",
                "source",
            )
        if samples < batches or (samples > 0) != started:
            raise CorruptState(
                f"{what} state is inconsistent: samples={samples} and batches={batches}; every "
                "batch holds at least one sample; the state is corrupt"
            )
        self._check_counts(cursor, what)
        if saved is not None and saved["state"] is not None:
            if not self.stateful:
                raise StateMismatch(
                    what,
                    "source.state",
                    "a sampler state",
                    None,
                    message=(
                        f"{what} state field 'source.state': {type(self.sampler).__qualname__} has no "
                        f"state_dict(), so the saved sampler state must be null, got "
                        f"{saved['state']!r:.200}"
                    ),
                )
            check_user_state(saved["state"], f"{what} state field 'source.state'")
        # The sampler's length is not checked against the counters: it is the user's, not in the
        # fingerprint, and one that now yields less is a clear error when the resume skips.

    def _start(self, epoch: int, cursor: Cursor) -> tuple[Iterator, int]:
        """Set up the sampler for ``epoch``; return its iterator and how much to skip."""
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)
        saved = cursor.source
        if saved is not None and saved["end"]:
            return iter(()), 0  # saved right after the epoch's last batch: nothing remains
        if cursor.samples == 0:
            return iter(self.sampler), 0
        if self.stateful and saved is not None and saved["state"] is not None:
            self.sampler.load_state_dict(from_jsonable(saved["state"]))
            return iter(self.sampler), 0
        return iter(self.sampler), self._skip_count(cursor)

    @abstractmethod
    def _skip_count(self, cursor: Cursor) -> int:
        """What a resume without the sampler's state skips: indices, or batches."""

    @abstractmethod
    def _check_counts(self, cursor: Cursor, what: str) -> None:
        """Refuse counters that this kind of sampler never leads to."""

    def _sampler_state(self) -> Any:
        """The sampler's own state right after a batch was drawn (None if it has none); one that
        JSON cannot hold is refused by the loader's ``state_dict()``, not here, mid-iteration."""
        if not self.stateful:
            return None
        return encode_or_defer(
            self.sampler.state_dict(), "sampler.state_dict()", "unbroken.DataLoader"
        )

    def _skip(self, iterator: Iterator, count: int, unit: str) -> None:
        if count == 0:
            return
        self._warn_skip(count, unit)
        skipped = sum(1 for _ in itertools.islice(iterator, count))
        if skipped < count:
            raise StateMismatch(
                "unbroken.DataLoader",
                unit,
                count,
                skipped,
                message=(
                    f"unbroken: the state says {count} {unit} of {type(self.sampler).__qualname__} "
                    f"were consumed this epoch, but it yields only {skipped}; was the state saved "
                    "with a different sampler?"
                ),
            )

    def _warn_skip(self, count: int, unit: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"unbroken: {type(self.sampler).__qualname__} has no state_dict()/"
                f"load_state_dict(), so resuming skips {count} {unit} of it one by one: this "
                "costs O(k) and is exact only if the sampler yields the same order again for "
                "the same epoch. Give it state_dict/load_state_dict to resume in O(1).",
                stacklevel=4,
            )


class UserSampler(_UserOrder):
    """A user ``sampler`` (yields dataset indices), batched by ``batch_size``."""

    @classmethod
    def matches(cls, a: Arguments) -> bool:
        return a.sampler is not None  # torch's own samplers of unbroken's order were adopted

    @classmethod
    def build(cls, a: Arguments) -> BatchSource:
        return cls(a.sampler, a.batch_size, a.drop_last)

    def __init__(self, sampler: Any, batch_size: int | None, drop_last: bool) -> None:
        super().__init__(sampler)
        self.batch_size, self.drop_last = batch_size, drop_last

    def __len__(self) -> int:
        n, step = len(self.sampler), self.batch_size or 1
        return n // step if self.drop_last else math.ceil(n / step)

    def _skip_count(self, cursor: Cursor) -> int:
        return cursor.samples

    def _check_counts(self, cursor: Cursor, what: str) -> None:
        step = self.batch_size or 1
        # Batches are whole `step`s of indices except an epoch's last, which drop_last drops.
        ok = (cursor.batches - 1) * step < cursor.samples <= cursor.batches * step
        if self.drop_last:
            ok = cursor.samples == cursor.batches * step
        if not ok and cursor.batches > 0:
            raise CorruptState(
                f"{what} state is inconsistent: samples={cursor.samples} and "
                f"batches={cursor.batches} are not whole batches of {step} (but the last"
                f"{', which drop_last drops' if self.drop_last else ''}); the state is corrupt"
            )
        if cursor.samples < cursor.batches * step and not cursor.source["end"]:
            raise CorruptState(
                f"{what} state field 'source.end': end=False, but samples={cursor.samples} in "
                f"batches={cursor.batches} of {step} end with a partial batch, which only an "
                "epoch's last batch is; the state is corrupt"
            )

    def batches(self, seed: int, epoch: int, cursor: Cursor, done: deque) -> Iterator[Keys]:
        epoch_key = keys.samples(seed, epoch)
        step = self.batch_size or 1
        indices, skip = self._start(epoch, cursor)
        self._skip(indices, skip, "indices")
        position = cursor.samples
        # Each batch is recorded with the sampler's state right after drawing it; the next batch
        # is drawn only then, to learn whether this one is the epoch's last.
        batch = list(itertools.islice(indices, step))
        while batch and (len(batch) == step or not self.drop_last):
            state = self._sampler_state()
            following = list(itertools.islice(indices, step)) if len(batch) == step else []
            last = not following or (len(following) < step and self.drop_last)
            # The sampler may reset itself once exhausted, so "end" says what its state can't.
            done.append((position + len(batch), {"state": state, "end": last}))
            yield batch, epoch_key, position
            position += len(batch)
            batch = following


class UserBatchSampler(_UserOrder):
    """A user ``batch_sampler`` (yields lists of dataset indices)."""

    batched_by_user = True

    @classmethod
    def matches(cls, a: Arguments) -> bool:
        return a.batch_sampler is not None

    @classmethod
    def build(cls, a: Arguments) -> BatchSource:
        return cls(a.batch_sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def _skip_count(self, cursor: Cursor) -> int:
        return cursor.batches

    def _check_counts(self, cursor: Cursor, what: str) -> None:
        pass  # batches may hold any number of indices

    def batches(self, seed: int, epoch: int, cursor: Cursor, done: deque) -> Iterator[Keys]:
        epoch_key = keys.samples(seed, epoch)
        batches, skip = self._start(epoch, cursor)
        self._skip(batches, skip, "batches")
        position = cursor.samples
        batch = next(batches, None)
        while batch is not None:
            state = self._sampler_state()
            batch, following = list(batch), next(batches, None)
            done.append((position + len(batch), {"state": state, "end": following is None}))
            yield batch, epoch_key, position
            position += len(batch)
            batch = following
