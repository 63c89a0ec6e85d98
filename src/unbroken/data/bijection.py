"""A seeded bijection on [0, n), evaluated per index: the shuffle that needs no permutation.

``IndexShuffle(n, key).at(positions)`` maps positions of an epoch's order to dataset indices.
It is a balanced Feistel network over the smallest even number of bits that covers ``n``,
with cycle walking to stay inside [0, n) (the construction Grain uses). Because each index
is computed on its own, resuming at position k costs the same as resuming at 0, and memory
does not grow with ``n``: a shuffled epoch over 10**9 samples starts at once.

Cost: a few vectorized numpy operations per block of a few thousand indices (docs/benchmarks/unit-costs.md, rows
``shuffle_index`` and ``shuffle_index_walk``); the domain is at most 4x ``n``, so cycle walking
re-encrypts on average fewer than 3 times.
"""

from __future__ import annotations

import numpy as np

from .keys import mix64

_ROUNDS = 6


class IndexShuffle:
    """A pseudo-random permutation of [0, n) keyed by a 64-bit ``key``."""

    __slots__ = ("n", "_half", "_mask", "_round_keys")

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"IndexShuffle needs n >= 0, got {n}")
        self.n = n
        bits = max(2, (max(n, 1) - 1).bit_length())
        self._half = (bits + 1) // 2
        self._mask = np.uint64((1 << self._half) - 1)
        keys, k = [], key
        for _ in range(_ROUNDS):
            k = mix64(k)
            keys.append(k)
        self._round_keys = np.array(keys, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self._half), self._mask
        left, right = x >> half, x & mask
        for k in self._round_keys:
            # The round function only has to look random; a multiply-xorshift of (right ^ key)
            # does, and stays in uint64 where numpy wraps multiplication modulo 2**64.
            f = (right ^ k) * np.uint64(0xBF58476D1CE4E5B9)
            f ^= f >> np.uint64(31)
            f *= np.uint64(0x94D049BB133111EB)
            f ^= f >> np.uint64(29)
            left, right = right, left ^ (f & mask)
        return (left << half) | right

    def at(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices (int64) for the given epoch positions (each in [0, n))."""
        out = self._encrypt(np.asarray(positions, dtype=np.uint64))
        n = np.uint64(self.n)
        outside = np.flatnonzero(out >= n)
        # Cycle walking: re-encrypt values that fell outside [0, n) until they land inside.
        # Following the cycle from an in-range start keeps the map a bijection on [0, n).
        while outside.size:
            walked = self._encrypt(out[outside])
            out[outside] = walked
            outside = outside[walked >= n]
        return out.astype(np.int64)

    def range(self, start: int, stop: int) -> list[int]:
        """Dataset indices for positions [start, stop), as Python ints."""
        return self.at(np.arange(start, stop, dtype=np.uint64)).tolist()
