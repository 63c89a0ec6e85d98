"""The locality-aware shuffle of a sharded dataset: a seeded bijection on global positions.

Reading one random row per shard download is hopeless, so the epoch's order is built at two
levels, both pure functions of the epoch's key:

1. The shards are permuted (``IndexShuffle`` over the shard numbers).
2. Consecutive runs of ``window`` shards of that permutation form a *window*; the rows of a
   window are permuted uniformly among themselves (``IndexShuffle`` over the window's rows,
   keyed by the window's number).

Position p lies in the window whose rows cover it; its dataset index is found with two binary
searches and one Feistel evaluation, so computing any position costs the same as position 0:
the loader's cursor stays a few integers, resumes in O(1), and splits over any number of
workers and ranks like every other order of ``unbroken.DataLoader``. A reader needs the
``window`` shards of the current window at once (a few times ``shard_bytes`` of cache), and
the next window's shards are known in advance, which is what the prefetcher downloads.
"""

from __future__ import annotations

import numpy as np

from ..data.shuffle import IndexShuffle, derive_key

_SHARDS, _ROWS = 0, 1  # the two purposes of the epoch key


class WindowShuffle:
    """Positions of an epoch → dataset indices, for shards of ``shard_rows`` rows each."""

    def __init__(self, shard_rows: np.ndarray, window: int, key: int) -> None:
        rows = np.asarray(shard_rows, dtype=np.int64)
        self.n = int(rows.sum())
        self.window = window
        self._key = key
        self._first_row = np.concatenate(([0], np.cumsum(rows)[:-1]))  # of each shard
        count = len(rows)
        self.shards = IndexShuffle(count, derive_key(key, _SHARDS)).at(np.arange(count))
        # Where each shard of the permuted order starts, as a position of the epoch.
        self._starts = np.concatenate(([0], np.cumsum(rows[self.shards])))
        self._window_starts = self._starts[::window].copy()
        if self._window_starts[-1] != self.n:
            self._window_starts = np.append(self._window_starts, self.n)
        self._cache: dict[int, IndexShuffle] = {}

    def _rows(self, window: int) -> IndexShuffle:
        shuffle = self._cache.get(window)
        if shuffle is None:
            if len(self._cache) > 64:
                self._cache.clear()
            size = int(self._window_starts[window + 1] - self._window_starts[window])
            shuffle = IndexShuffle(size, derive_key(self._key, _ROWS, window))
            self._cache[window] = shuffle
        return shuffle

    def at(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices (int64) for the given positions (each in [0, n))."""
        positions = np.asarray(positions, dtype=np.int64)
        windows = np.searchsorted(self._window_starts, positions, side="right") - 1
        out = np.empty_like(positions)
        for window in np.unique(windows).tolist():
            mask = windows == window
            start = self._window_starts[window]
            # A uniform permutation of the window's rows, then back to (shard, row).
            local = self._rows(window).at(positions[mask] - start) + start
            slot = np.searchsorted(self._starts, local, side="right") - 1
            out[mask] = self._first_row[self.shards[slot]] + (local - self._starts[slot])
        return out

    def range(self, start: int, stop: int) -> list[int]:
        """Dataset indices for positions [start, stop), as Python ints."""
        return self.at(np.arange(start, stop, dtype=np.int64)).tolist()
