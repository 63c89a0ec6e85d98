"""Exact prefetch: download the shards the loader will read next, in the order it will read them.

``unbroken.DataLoader`` knows its whole future order (a pure function of seed, epoch and
position), so at the start of each iteration it hands a dataset that asks for it
(``plan_reads``) this rank's remaining batches of indices, lazily, and a counter of the batches
received so far. A ``Prefetcher`` walks those batches on a thread of its own, maps each index
to its shard and submits every shard at its first use to a small pool of download threads, in
order of first use, while the bytes of shards not yet reached by the reader stay under
``max_bytes``. Downloads land in the shared cache; the readers (the loader's workers or the
main process) find them there, or wait on the shard's lock while it is being fetched. Nothing
is guessed: on resume the first shards fetched are those of the first batches.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


class Prefetcher:
    """Downloads ``shards_of(batch)`` for each planned batch ahead of the reader."""

    def __init__(
        self,
        batches: Iterator[list[int]],
        received: Callable[[], int],
        shards_of: Callable[[list[int]], Iterable[int]],
        fetch: Callable[[int], Any],
        size_of: Callable[[int], int],
        max_bytes: int,
        threads: int,
    ) -> None:
        self._batches, self._received = batches, received
        self._shards_of, self._fetch, self._size_of = shards_of, fetch, size_of
        self._max_bytes, self._threads = max_bytes, threads
        self._stop = threading.Event()
        self.fetched: list[int] = []  # shards submitted, in order (for tests and reports)
        self._thread = threading.Thread(target=self._run, name="unbroken-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pool = ThreadPoolExecutor(self._threads, thread_name_prefix="unbroken-download")
        ahead: deque[tuple[int, int]] = deque()  # (first batch that needs it, bytes)
        seen: set[int] = set()
        try:
            for number, batch in enumerate(self._batches):
                for shard in self._shards_of(batch):
                    if shard in seen:
                        continue
                    seen.add(shard)
                    size = self._size_of(shard)
                    # Wait while the shards the reader has not reached yet fill the budget
                    # (always let one through, or a shard larger than the budget never comes).
                    while ahead and not self._stop.is_set():
                        reached = self._received()
                        while ahead and ahead[0][0] <= reached:
                            ahead.popleft()
                        if sum(s for _, s in ahead) + size <= self._max_bytes:
                            break
                        self._stop.wait(0.005)
                    if self._stop.is_set():
                        return
                    ahead.append((number, size))
                    self.fetched.append(shard)
                    pool.submit(self._quietly, shard)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _quietly(self, shard: int) -> None:
        # A failed prefetch is not an error yet: the reader fetches the shard again when it
        # needs it, and raises what the storage said then.
        if not self._stop.is_set():
            try:
                self._fetch(shard)
            except Exception:
                pass

    def close(self) -> None:
        """Stop planning and submitting (downloads in flight finish into the cache)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def shards_in_order(ends: np.ndarray) -> Callable[[list[int]], list[int]]:
    """For shards whose rows end at ``ends`` (cumulative), the shards a batch of indices
    touches, in order of first touch."""

    def shards_of(batch: list[int]) -> list[int]:
        found = np.searchsorted(ends, np.asarray(batch, dtype=np.int64), side="right")
        unique, first = np.unique(found, return_index=True)
        return unique[np.argsort(first)].tolist()

    return shards_of
