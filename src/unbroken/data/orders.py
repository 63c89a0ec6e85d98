"""What each epoch yields: the batches of dataset indices, starting at any cursor in O(1).

An epoch's *global order* is the sequence of dataset indices it visits; the loader's cursor
counts how much of it the user has received. A ``Source`` turns (epoch, cursor) into the
remaining batches:

- ``NativeOrder``: ``shuffle`` on or off, with unbroken's per-index shuffle. Batches are
  contiguous runs of positions, so starting at sample k computes nothing before k.
- ``UserSampler``/``UserBatchSampler``: the user's own sampler or batch sampler, restored
  through its ``state_dict``/``load_state_dict`` when it has them, otherwise fast-forwarded by
  skipping what was consumed (O(k), with a warning).

Each batch is a ``Keys`` list of dataset indices that also carries the epoch's key and the
position of its first sample, which is all a worker needs to seed every sample's RNGs.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

from .shuffle import IndexShuffle, derive_key
from .._state import (check_user_state, encode_or_defer, from_jsonable, has_state,
                     raise_if_unsaveable)

# Indices are computed in blocks of at least this many positions: one numpy call per block
# keeps the per-index cost at ~0.1 us without holding more than a block in memory.
_BLOCK = 4096


class Keys(list):
    """A batch of dataset indices; ``epoch_key`` and ``start`` let a worker seed each sample."""

    def __init__(self, indices, epoch_key: int, start: int) -> None:
        super().__init__(indices)
        self.epoch_key = epoch_key
        self.start = start

    def __reduce__(self):  # workers receive batches pickled; keep it small and explicit
        return (Keys, (list(self), self.epoch_key, self.start))


class Cursor:
    """Where the user is in an epoch: samples and batches received, and the sampler's state."""

    __slots__ = ("samples", "batches", "source")

    def __init__(self, samples: int = 0, batches: int = 0, source: Any = None) -> None:
        self.samples, self.batches, self.source = samples, batches, source


class NativeOrder:
    """Sequential or shuffled order over a map-style dataset of length ``n``."""

    kind = "native"

    def __init__(self, n: int, batch_size: int | None, drop_last: bool, shuffle: bool) -> None:
        self.n, self.batch_size, self.drop_last, self.shuffle = n, batch_size, drop_last, shuffle
        step = batch_size or 1
        self.epoch_samples = n - n % step if drop_last else n

    def fingerprint(self) -> dict:
        return {"sampler": "unbroken", "shuffle": self.shuffle}

    def fresh(self) -> None:
        return None  # the cursor's counters say it all

    def __len__(self) -> int:
        return math.ceil(self.epoch_samples / (self.batch_size or 1))

    def check_saveable(self, source: None) -> None:
        pass

    def check_cursor(self, cursor: Cursor, what: str) -> None:
        if cursor.source is not None:
            raise ValueError(f"{what} state field 'source': expected null (unbroken's own order "
                             f"keeps no sampler state), got {cursor.source!r:.200}")
        step = self.batch_size or 1
        expected = min(cursor.batches * step, self.epoch_samples)
        if cursor.samples != expected or cursor.batches > len(self):
            raise ValueError(
                f"{what} state is inconsistent: samples={cursor.samples} and "
                f"batches={cursor.batches} do not describe a position of an epoch of "
                f"{self.epoch_samples} samples in batches of {step}; the state is corrupt"
            )

    def batches(self, seed: int, epoch: int, cursor: Cursor, done: deque) -> Iterator[Keys]:
        epoch_key = derive_key(seed, epoch)
        step = self.batch_size or 1
        shuffle = IndexShuffle(self.n, derive_key(seed, epoch, 1)) if self.shuffle else None
        block = step * max(1, _BLOCK // step)
        start, end = cursor.samples, self.epoch_samples
        for block_start in range(start, end, block):
            block_end = min(block_start + block, end)
            if shuffle is None:
                indices = range(block_start, block_end)
            else:
                indices = shuffle.range(block_start, block_end)
            for offset in range(0, block_end - block_start, step):
                first = block_start + offset
                last = min(first + step, block_end)
                done.append((last, None))
                yield Keys(indices[offset : offset + step], epoch_key, first)


class _UserOrder:
    """Shared logic of a user sampler or batch sampler: epoch, state, or skipping."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.stateful = has_state(sampler)
        self._warned = False

    def fresh(self) -> None:
        return None  # the sampler's state, once a batch was drawn

    def fingerprint(self) -> dict:
        cls = type(self.sampler)
        return {"sampler": f"{cls.__module__}.{cls.__qualname__}", "shuffle": None}

    def check_saveable(self, source: dict | None) -> None:
        if source is not None:
            raise_if_unsaveable(source["state"])

    def check_cursor(self, cursor: Cursor, what: str) -> None:
        saved, samples, batches = cursor.source, cursor.samples, cursor.batches
        # Before the epoch's first batch there is no sampler state; after it, always one entry.
        started = batches > 0
        well_formed = saved is None if not started else (
            isinstance(saved, dict) and set(saved) == {"state", "end"}
            and isinstance(saved["end"], bool)
        )
        if not well_formed:
            expected = "null at the start of an epoch" if not started else \
                "{'state': ..., 'end': bool} after a batch"
            raise ValueError(
                f"{what} state field 'source': expected {expected} (batches={batches}), "
                f"got {saved!r:.200}"
            )
        if samples < batches or (samples > 0) != started:
            raise ValueError(
                f"{what} state is inconsistent: samples={samples} and batches={batches}; every "
                "batch holds at least one sample; the state is corrupt"
            )
        self._check_counts(cursor, what)
        if saved is not None and saved["state"] is not None:
            if not self.stateful:
                raise ValueError(
                    f"{what} state field 'source.state': {type(self.sampler).__qualname__} has no "
                    f"state_dict(), so the saved sampler state must be null, got "
                    f"{saved['state']!r:.200}"
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

    def _snapshot(self) -> Any:
        """The sampler's own state right after a batch was drawn (None if it has none); one that
        JSON cannot hold is refused by the loader's ``state_dict()``, not here, mid-iteration."""
        if not self.stateful:
            return None
        return encode_or_defer(self.sampler.state_dict(), "sampler.state_dict()",
                               "unbroken.DataLoader")

    def _skip(self, iterator: Iterator, count: int, unit: str) -> None:
        if count == 0:
            return
        self._warn_skip(count, unit)
        skipped = sum(1 for _ in itertools.islice(iterator, count))
        if skipped < count:
            raise ValueError(
                f"unbroken: the state says {count} {unit} of {type(self.sampler).__qualname__} "
                f"were consumed this epoch, but it yields only {skipped}; was the state saved "
                "with a different sampler?"
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

    kind = "sampler"

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
            raise ValueError(
                f"{what} state is inconsistent: samples={cursor.samples} and "
                f"batches={cursor.batches} are not whole batches of {step} (but the last"
                f"{', which drop_last drops' if self.drop_last else ''}); the state is corrupt"
            )
        if cursor.samples < cursor.batches * step and not cursor.source["end"]:
            raise ValueError(
                f"{what} state field 'source.end': end=False, but samples={cursor.samples} in "
                f"batches={cursor.batches} of {step} end with a partial batch, which only an "
                "epoch's last batch is; the state is corrupt"
            )

    def batches(self, seed: int, epoch: int, cursor: Cursor, done: deque) -> Iterator[Keys]:
        epoch_key = derive_key(seed, epoch)
        step = self.batch_size or 1
        indices, skip = self._start(epoch, cursor)
        self._skip(indices, skip, "indices")
        position = cursor.samples
        # Each batch is recorded with the sampler's state right after drawing it; the next batch
        # is drawn only then, to learn whether this one is the epoch's last.
        batch = list(itertools.islice(indices, step))
        while batch and (len(batch) == step or not self.drop_last):
            state = self._snapshot()
            following = list(itertools.islice(indices, step)) if len(batch) == step else []
            last = not following or (len(following) < step and self.drop_last)
            # The sampler may reset itself once exhausted, so "end" says what its state can't.
            done.append((position + len(batch), {"state": state, "end": last}))
            yield Keys(batch, epoch_key, position)
            position += len(batch)
            batch = following


class UserBatchSampler(_UserOrder):
    """A user ``batch_sampler`` (yields lists of dataset indices)."""

    kind = "batch_sampler"

    def __len__(self) -> int:
        return len(self.sampler)

    def _skip_count(self, cursor: Cursor) -> int:
        return cursor.batches

    def _check_counts(self, cursor: Cursor, what: str) -> None:
        pass  # batches may hold any number of indices

    def batches(self, seed: int, epoch: int, cursor: Cursor, done: deque) -> Iterator[Keys]:
        epoch_key = derive_key(seed, epoch)
        batches, skip = self._start(epoch, cursor)
        self._skip(batches, skip, "batches")
        position = cursor.samples
        batch = next(batches, None)
        while batch is not None:
            state = self._snapshot()
            batch, following = list(batch), next(batches, None)
            done.append((position + len(batch), {"state": state, "end": following is None}))
            yield Keys(batch, epoch_key, position)
            position += len(batch)
            batch = following
