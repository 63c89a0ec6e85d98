"""``StreamingDataset``: a map-style dataset over Parquet shards in object storage.

Global index i is row ``i - first_row[s]`` of shard s (shards in the index's order), so
``unbroken.DataLoader`` gives it everything a map-style dataset has: O(1) resume from a cursor
of a few integers, any ``num_workers`` and any number of ranks on resume, and randomness
derived from (seed, epoch, position). What is particular to object storage lives
beside it:

- ``shuffle=True`` uses the dataset's ``WindowShuffle`` (``order``): shards permuted in windows
  of ``window_shards``, a window's row groups permuted in blocks of ``block_groups``, a
  block's rows permuted, so a reader needs a few shards downloaded and one block decoded.
- Shards are downloaded whole into a ``ShardCache`` shared by every process on the machine,
  verified against the index before use.
- ``plan_reads`` starts a ``Prefetcher`` on the loader's exact future order.
- Reading decodes one Parquet row group at a time and keeps the most recent ones decoded (two
  blocks' worth), so a block's rows are decoded once per process, not once per sample.

Items are dicts of column values (Python objects, as ``pyarrow``'s ``to_pylist`` gives them).
For decoding and random augmentations per sample, ``dataset.map(fn)``: a dataset of
``fn(row)`` that keeps the hooks above and has no ``__getitems__``, so the loader fetches each
sample with ``__getitem__``, tracking its position for ``sample_seed()``/``sample_rng()``
(this dataset's batched ``__getitems__`` draws no randomness). A wrapper of
your own must forward ``shuffle_order``, ``order_fingerprint`` and ``plan_reads`` too, or the
loader sees a plain map-style dataset: a uniform shuffle over all shards, and no prefetch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .._checks import is_int
from ..errors import CorruptShard
from .cache import ShardCache
from .index import INDEX_NAME, fetch_index, read_index
from .order import WindowShuffle
from .prefetch import Prefetcher, first_uses_in
from .remote import Remote


def _import_readers() -> None:
    """Import what reading the first batch needs, in the process that builds the dataset: done
    when the index came from the cache's copy, i.e. on a restart on a machine that has read
    the dataset before, whose first shards are usually cached.

    The loader's workers are forked from that process after the dataset is built (on Linux,
    where fork is the default), so they inherit these modules instead of each importing them
    on its first read. That matters more than the imports' own time: in a process that has
    imported torch they allocate enough to set off one of Python's full garbage collections
    (~0.1 s here), which in a freshly forked worker also copies every page of the parent's
    heap that it touches (0.15-0.3 s per worker on 2 cores, before its first batch). Done
    here, that collection runs once, before the fork. On a first run (the index fetched),
    the first batch waits for its shards' downloads, which start only once the workers
    exist; the workers import the reader while they wait, and importing it here would only
    delay the downloads. Workers started another way (spawn) import it on their first read.
    """
    import numpy.ma  # noqa: F401 - numpy 2.4's unique() imports it on first use (the order)
    import pyarrow.parquet  # noqa: F401 - reading a shard


def default_cache_dir() -> str:
    """The shard cache a ``StreamingDataset`` uses when given no ``cache_dir``.

    Returns:
        ``$UNBROKEN_CACHE`` or ``~/.cache/unbroken/shards``. Datasets may share it, since
        shards are cached under their checksum.
    """
    return os.environ.get("UNBROKEN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "unbroken", "shards"
    )


class StreamingDataset(torch.utils.data.Dataset):
    """Rows of a sharded dataset in object storage, fetched into a local cache when needed.

    Each batch of a shuffled epoch draws its rows from one block of ``block_groups`` row
    groups, drawn at random from the ``window_shards`` shards of a window. Larger mixes better.
    A larger window needs more cache; a larger block needs more decoding before the first batch
    and more memory (each reading process keeps two blocks decoded).

    Args:
        url: The dataset, written by ``write_shards`` or indexed by ``index_parquet``.
        cache_dir: The local cache (default ``default_cache_dir()``).
        cache_limit: The cache's size limit in bytes (default: none). It must hold the shards
            of two windows plus ``prefetch_bytes``, or reading would evict what it will read.
        window_shards: Shards per window of a shuffled epoch (default 4).
        block_groups: Row groups per block of a shuffled epoch (default 8).
        prefetch_bytes: How far ahead the loader's future order is fetched, in bytes of shards
            not yet reached.
        prefetch_threads: How many downloads run in parallel.
        columns: The columns to read (default all).
        storage_options: For fsspec, e.g. an S3 ``endpoint_url``, ``key`` and ``secret``.
        retries: Attempts after the first for a request that fails to connect, with
            exponential backoff.
        refresh_index: Read the index from the storage even if the cache keeps a copy. The
            copy is taken the first time a cache directory sees the dataset (keyed by URL and
            endpoint), then used. A dataset rewritten at the same URL needs
            ``refresh_index=True`` (or a new URL). Shards are cached by checksum, so a
            refreshed index never reads stale shards.

    Raises:
        ValueError: a setting is out of range, a column is not in the dataset, or
            ``cache_limit`` is too small for two windows plus ``prefetch_bytes``.
    """

    def __init__(
        self,
        url: str,
        *,
        cache_dir: str | None = None,
        cache_limit: int | None = None,
        window_shards: int = 4,
        block_groups: int = 8,
        prefetch_bytes: int = 64 << 20,
        prefetch_threads: int = 4,
        columns: Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        retries: int = 3,
        refresh_index: bool = False,
    ) -> None:
        for name, value, low in (
            ("window_shards", window_shards, 1),
            ("block_groups", block_groups, 1),
            ("prefetch_bytes", prefetch_bytes, 0),
            ("prefetch_threads", prefetch_threads, 1),
        ):
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.remote = Remote(url, storage_options, retries)
        self.cache = ShardCache(cache_dir or default_cache_dir(), cache_limit)
        # The index is read from the storage once per cache directory, then from the cache's
        # copy: a warm restart contacts no server before its first batch (creating an S3
        # client alone takes ~0.2 s), and a run keeps reading the index it started with.
        key = f"{self.remote.url}\n{self.remote.storage_options.get('endpoint_url')}"
        raw = None if refresh_index else self.cache.cached_index(key)
        seen_before = raw is not None
        if raw is not None:  # a copy damaged on this disk names itself, and the way out
            where = f"{self.cache.index_copy(key)} (the cache's copy of {self.remote.url}'s index; pass refresh_index=True to read it again)"
            self.shards, all_columns, self.index_digest = read_index(where, raw)
        else:  # validated before it is kept: a malformed index is never cached
            raw = fetch_index(self.remote)
            read = read_index(self.remote.where(INDEX_NAME), raw)
            self.shards, all_columns, self.index_digest = read
            self.cache.keep_index(key, raw)
        if columns is None:
            columns = all_columns
        missing = [c for c in columns if c not in all_columns]
        if missing or not columns:
            raise ValueError(
                f"columns {missing or list(columns)} not in the dataset's {all_columns}"
            )
        self.columns = list(columns)
        self.window_shards, self.block_groups = window_shards, block_groups
        self.prefetch_bytes = prefetch_bytes
        self.prefetch_threads = prefetch_threads
        rows = np.array([s.rows for s in self.shards], dtype=np.int64)
        self._ends = np.cumsum(rows)  # index i is in shard searchsorted(ends, i, "right")
        # Row groups numbered across all shards: where each ends (a global index), its shard
        # and its number in that shard.
        counts = [count for s in self.shards for count in s.row_groups]
        self._group_ends = np.cumsum(np.array(counts, dtype=np.int64))
        self._group_starts = self._group_ends - counts
        self._group_shard = [i for i, s in enumerate(self.shards) for _ in s.row_groups]
        self._group_local = [g for s in self.shards for g in range(len(s.row_groups))]
        biggest = max(s.bytes for s in self.shards)
        needed = 2 * window_shards * biggest + prefetch_bytes
        if cache_limit is not None and cache_limit < needed:
            raise ValueError(
                f"cache_limit={cache_limit} bytes is too small for this dataset: reading needs "
                f"two windows of {window_shards} shards of up to {biggest} bytes plus "
                f"prefetch_bytes={prefetch_bytes}, {needed} bytes. Raise cache_limit, or lower "
                "window_shards or prefetch_bytes"
            )
        self.cache.sweep()
        self._init_readers()
        if seen_before:  # a restart on this machine: see _import_readers
            _import_readers()

    def _init_readers(self) -> None:
        # Per process: open Parquet files and decoded row groups (a window's worth).
        self._files: OrderedDict[int, Any] = OrderedDict()
        self._decoded: dict[int, dict[str, list]] = {}  # by row group, oldest first
        self._keep_groups = 2 * self.block_groups + 2
        self._keep_files = self.window_shards + 2

    def __getstate__(self) -> dict[str, Any]:
        skip = ("_files", "_decoded")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_readers()

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"indices are ints, got {type(index).__name__}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} rows")
        return self.__getitems__([int(index) % len(self)])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """The rows of a batch of indices (in [0, len)), located with one binary search."""
        positions = np.asarray(indices, dtype=np.int64)
        groups = np.searchsorted(self._group_ends, positions, side="right")
        rows = (positions - self._group_starts[groups]).tolist()
        names, out = self.columns, []
        for group, row in zip(groups.tolist(), rows):
            columns = self._decoded.get(group) or self._group(group)
            out.append({name: columns[name][row] for name in names})
        return out

    def _group(self, group: int) -> dict[str, list]:
        """Decode row group ``group`` (numbered across all shards), keeping the most recent."""
        shard, local = self._group_shard[group], self._group_local[group]
        table = self._file(shard).read_row_group(local, columns=self.columns)
        columns = {name: table.column(name).to_pylist() for name in self.columns}
        self._decoded[group] = columns
        while len(self._decoded) > self._keep_groups:
            self._decoded.pop(next(iter(self._decoded)))  # the oldest decoded
        return columns

    def _file(self, shard: int) -> Any:
        import pyarrow.parquet as pq

        file = self._files.get(shard)
        if file is not None:
            self._files.move_to_end(shard)
            return file
        entry = self.shards[shard]
        path = self.cache.get(entry, self.remote)
        try:
            try:
                file = pq.ParquetFile(path, memory_map=True)
            except FileNotFoundError:  # evicted by another process between get and open
                path = self.cache.get(entry, self.remote)
                file = pq.ParquetFile(path, memory_map=True)
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
            if isinstance(error, FileNotFoundError):
                raise
            raise CorruptShard(
                f"shard {entry.name} ({self.remote.where(entry.name)}, cached as {path}) is not "
                f"a Parquet file pyarrow can read: {type(error).__name__}: {error}. Its bytes "
                "match the index, so it was indexed so: rewrite it, then rebuild the index with "
                "unbroken.streaming.index_parquet"
            ) from error
        if file.metadata.num_rows != entry.rows or file.num_row_groups != len(entry.row_groups):
            raise CorruptShard(
                f"shard {entry.name} ({self.remote.where(entry.name)}) has "
                f"{file.metadata.num_rows} rows in {file.num_row_groups} row groups, the index "
                f"says {entry.rows} in {len(entry.row_groups)}: the index does not describe "
                "this shard; rebuild it with unbroken.streaming.index_parquet"
            )
        self._files[shard] = file
        if len(self._files) > self._keep_files:
            self._files.popitem(last=False)
        return file

    # The loader's hooks (``unbroken.data.sources.orders``): the shuffle and the exact prefetch.

    def shuffle_order(self, key: int) -> WindowShuffle:
        """The epoch's shuffled order for ``unbroken.DataLoader(shuffle=True)``.

        Args:
            key: The epoch's key, derived by the loader from its seed and the epoch.

        Returns:
            The order: shards permuted in windows, row groups in blocks, rows in a block.
        """
        groups = [s.row_groups for s in self.shards]
        return WindowShuffle(groups, self.window_shards, self.block_groups, key)

    def order_fingerprint(self) -> dict[str, Any]:
        """What a loader's state records of this dataset.

        Returns:
            The index's digest, ``window_shards`` and ``block_groups``: a resume needs the same.
        """
        return {
            "index": self.index_digest,
            "window_shards": self.window_shards,
            "block_groups": self.block_groups,
        }

    def plan_reads(self, batches: Iterator[list[int]], received: Callable[[], int]) -> Prefetcher:
        """Start downloading the shards of the loader's remaining batches, ahead of use.

        Args:
            batches: The loader's remaining batches of this rank, as lists of indices.
            received: Returns how many of them were received since.

        Returns:
            The running ``Prefetcher``.
        """

        def fetch(shard: int, wanted: Callable[[], bool]) -> str | None:
            return self.cache.get(self.shards[shard], self.remote, wanted)

        return Prefetcher(
            batches,
            received,
            first_uses_in(self._ends),
            fetch,
            lambda shard: self.shards[shard].bytes,
            self.prefetch_bytes,
            self.prefetch_threads,
        )

    def map(self, fn: Callable[[dict[str, Any]], Any]) -> Mapped:
        """A dataset of ``fn(row)``, read in this dataset's order and with its prefetch.

        Args:
            fn: Applied to each row (a dict of column values), one sample at a time, so
                ``sample_seed()`` and ``sample_rng()`` are each sample's.

        Returns:
            The mapped dataset.
        """
        return Mapped(self, fn)


class Mapped(torch.utils.data.Dataset):
    """``fn`` applied to each row of a ``StreamingDataset``, one sample at a time (so
    ``sample_seed()``/``sample_rng()`` are each sample's), with the dataset's order and
    prefetch hooks."""

    def __init__(self, dataset: StreamingDataset, fn: Callable[[dict[str, Any]], Any]) -> None:
        self.dataset, self.fn = dataset, fn
        self.shuffle_order = dataset.shuffle_order
        self.order_fingerprint = dataset.order_fingerprint
        self.plan_reads = dataset.plan_reads

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.fn(self.dataset[index])
