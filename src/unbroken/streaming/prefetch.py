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

import atexit
import itertools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


class Prefetcher:
    """Downloads the shards of the planned batches ahead of the reader.

    ``first_uses(batches, number)`` gives, for a list of consecutive batches whose first is
    batch ``number``, the ``(batch, shard)`` of each shard they touch, at its first use, in
    order. Batches are read in chunks (one numpy pass each), and after the shards of the first
    batch are submitted the planning waits until the reader has received that batch: on a
    resume the first batch's downloads run in parallel, and nothing competes with the reader
    (for the interpreter's lock) before its first batch.
    """

    _CHUNK = 64  # batches per planning pass

    def __init__(
        self,
        batches: Iterator[list[int]],
        received: Callable[[], int],
        first_uses: Callable[[list[list[int]], int], list[tuple[int, int]]],
        fetch: Callable[[int, Callable[[], bool]], Any],
        size_of: Callable[[int], int],
        max_bytes: int,
        threads: int,
    ) -> None:
        self._batches, self._received = batches, received
        self._first_uses, self._fetch, self._size_of = first_uses, fetch, size_of
        self._max_bytes, self._threads = max_bytes, threads
        self._stop = threading.Event()
        self.fetched: list[int] = []  # shards submitted, in order (for tests and reports)
        self._thread = threading.Thread(target=self._run, name="unbroken-prefetch", daemon=True)
        global _registered
        if not _registered:  # once per process, on first use: no side effect at import
            atexit.register(_stop_all)
            _registered = True
        _live.add(self)
        self._thread.start()

    def _chunks(self) -> Iterator[tuple[int, list[list[int]]]]:
        number, size = 0, 1  # the first batch alone, then chunks
        while chunk := list(itertools.islice(self._batches, size)):
            yield number, chunk
            number, size = number + len(chunk), self._CHUNK

    def _run(self) -> None:
        pool = ThreadPoolExecutor(self._threads, thread_name_prefix="unbroken-download")
        ahead: deque[tuple[int, int]] = deque()  # (first batch that needs it, bytes)
        seen: set[int] = set()
        try:
            for number, chunk in self._chunks():
                for batch, shard in self._first_uses(chunk, number):
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
                    ahead.append((batch, size))
                    self.fetched.append(shard)
                    pool.submit(self._quietly, shard, batch)
                while number == 0 and self._received() < 1 and not self._stop.is_set():
                    self._stop.wait(0.002)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _quietly(self, shard: int, batch: int) -> None:
        # Too late once the reader has received the batch that first needs the shard: it
        # fetched the shard itself, and the cache may have evicted it since. A failed prefetch
        # is not an error yet: the reader fetches the shard again when it needs it, and raises
        # what the storage said then.
        def wanted() -> bool:
            return not self._stop.is_set() and self._received() <= batch

        if wanted():
            try:
                self._fetch(shard, wanted)  # asked again once the shard's lock is held
            except Exception:
                pass

    def close(self) -> None:
        """Stop planning and submitting (downloads in flight finish into the cache)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


# The prefetchers still running when the interpreter exits (a loop left with its iterator alive)
# are stopped and joined before it tears down the libraries their threads may be inside.
_live: weakref.WeakSet[Prefetcher] = weakref.WeakSet()
_registered = False


def _stop_all() -> None:
    for prefetcher in list(_live):
        prefetcher.close()
    for prefetcher in list(_live):
        prefetcher.join(timeout=5)


def first_uses_in(ends: np.ndarray) -> Callable[[list[list[int]], int], list[tuple[int, int]]]:
    """For shards whose rows end at ``ends`` (cumulative): ``(batch, shard)`` at each shard's
    first use in a list of consecutive batches numbered from ``number``, in order."""

    def first_uses(batches: list[list[int]], number: int) -> list[tuple[int, int]]:
        indices = np.fromiter(itertools.chain.from_iterable(batches), dtype=np.int64)
        lengths = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
        batch_of = np.repeat(np.arange(number, number + len(batches)), lengths)
        shards = np.searchsorted(ends, indices, side="right")
        unique, first = np.unique(shards, return_index=True)
        order = np.argsort(first, kind="stable")
        return list(zip(batch_of[first[order]].tolist(), unique[order].tolist()))

    return first_uses
