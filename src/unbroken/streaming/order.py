"""The locality-aware shuffle of a sharded dataset: a seeded bijection on global positions.

Reading one random row per shard download is hopeless, and so is decoding a whole Parquet row
group per row, so the epoch's order is built at three levels, each a pure function of the
epoch's key:

1. The shards are permuted; consecutive runs of ``window`` shards of that permutation form a
   *window*: what a reader needs downloaded at once.
2. The row groups of a window (of all its shards) are permuted; consecutive runs of ``block``
   row groups of that permutation form a *block*: what a reader needs decoded at once.
3. The rows of a block are permuted uniformly.

Every permutation is an ``IndexShuffle`` (a Feistel bijection) keyed by the epoch's key and
the window's (and block's) number. Position p's row is found with a few binary searches and
Feistel evaluations over one window's row groups, so any position costs the same as position
0: the loader's cursor stays a few integers, resumes in O(1), and splits over any number of
workers and ranks like every other order of ``unbroken.DataLoader``. A resumed reader decodes
one block (``block`` row groups) before its first batch, not a window. A batch mixes rows of
``block`` row groups drawn from across ``window`` shards.
"""

from __future__ import annotations

import numpy as np

from ..data.bijection import IndexShuffle
from ..data.keys import derive_key

_SHARDS, _ROWS, _GROUPS = 0, 1, 2  # the purposes of the epoch key


class _Window:
    """One window's blocks: where each starts (a position), its row groups' global first rows
    and sizes in permuted order, and where each of those starts (a position)."""

    __slots__ = ("block_starts", "group_rows", "group_starts", "key", "number")

    def __init__(self, key: int, number: int, first_rows: np.ndarray, sizes: np.ndarray) -> None:
        self.key, self.number = key, number
        order = IndexShuffle(len(sizes), derive_key(key, _GROUPS, number)).at(np.arange(len(sizes)))
        self.group_rows, sizes = first_rows[order], sizes[order]
        self.group_starts = np.concatenate(([0], np.cumsum(sizes)))


class WindowShuffle:
    """Positions of an epoch → dataset indices, for shards whose row groups have
    ``shard_groups[s]`` rows each."""

    def __init__(self, shard_groups: list[list[int]], window: int, block: int, key: int) -> None:
        self.window, self.block, self._key = window, block, key
        count = len(shard_groups)
        rows = np.array([sum(groups) for groups in shard_groups], dtype=np.int64)
        self.n = int(rows.sum())
        # Each row group's first row (a global index) and size, shard by shard.
        self._sizes = [np.array(groups, dtype=np.int64) for groups in shard_groups]
        first_row = np.concatenate(([0], np.cumsum(rows)[:-1]))
        self._firsts = [
            first_row[s] + np.cumsum(sizes) - sizes for s, sizes in enumerate(self._sizes)
        ]
        self.shards = IndexShuffle(count, derive_key(key, _SHARDS)).at(np.arange(count))
        starts = np.concatenate(([0], np.cumsum(rows[self.shards])))
        self._window_starts = starts[::window].copy()
        if self._window_starts[-1] != self.n:
            self._window_starts = np.append(self._window_starts, self.n)
        self._windows: dict[int, _Window] = {}

    def _window(self, number: int) -> _Window:
        window = self._windows.get(number)
        if window is None:
            if len(self._windows) > 8:
                self._windows.clear()
            members = self.shards[number * self.window : (number + 1) * self.window].tolist()
            firsts = np.concatenate([self._firsts[s] for s in members] or [np.zeros(0, np.int64)])
            sizes = np.concatenate([self._sizes[s] for s in members] or [np.zeros(0, np.int64)])
            window = _Window(self._key, number, firsts, sizes)
            self._windows[number] = window
        return window

    def at(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices (int64) for the given positions (each in [0, n))."""
        positions = np.asarray(positions, dtype=np.int64)
        windows = np.searchsorted(self._window_starts, positions, side="right") - 1
        out = np.empty_like(positions)
        for number in np.unique(windows).tolist():
            mask = windows == number
            window = self._window(number)
            local = positions[mask] - self._window_starts[number]  # a position in the window
            blocks = np.searchsorted(window.group_starts[:: self.block], local, side="right") - 1
            mixed = np.empty_like(local)
            for block in np.unique(blocks).tolist():
                inside = blocks == block
                first = block * self.block
                start = window.group_starts[first]
                size = int(window.group_starts[min(first + self.block, len(window.group_rows))])
                shuffle = IndexShuffle(
                    size - int(start), derive_key(self._key, _ROWS, number, block)
                )
                mixed[inside] = shuffle.at(local[inside] - start) + start
            slot = np.searchsorted(window.group_starts, mixed, side="right") - 1
            out[mask] = window.group_rows[slot] + (mixed - window.group_starts[slot])
        return out

    def range(self, start: int, stop: int) -> list[int]:
        """Dataset indices for positions [start, stop), as Python ints."""
        return self.at(np.arange(start, stop, dtype=np.int64)).tolist()
