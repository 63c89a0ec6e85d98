"""The local shard cache: one verified copy of each shard per machine, shared by every process.

Files are named by content (``<checksum>-<bytes>.parquet``), so one cache directory serves any
number of datasets and a rewritten dataset can never be served stale bytes. A shard is
downloaded by one process at a time, under a lock file of its own (``fcntl`` locks through
``filelock``: the kernel releases them when their process dies, SIGKILL included); the others
wait for it and then read the same file. A download goes to a temporary name
(``.part-<pid>-<thread>``) and is renamed into place only after its size and checksum match
the index, so a reader never sees a partial or corrupt shard: a process killed mid-download
leaves only its ``.part`` file, which the next download of that shard (or
``ShardCache.sweep``) removes. A shard whose checksum does not match is fetched once more,
then ``CorruptShard`` names it and its URL; nothing of it stays in the cache.

With a ``limit`` (bytes), a verified download is renamed into place only after the least
recently used shards (by modification time, which every open refreshes) were evicted to make
room for it, under a lock of the whole cache, so the complete shards never exceed the limit.
Prefetched shards are the newest, so the shards of windows already read go first. A shard evicted while a process reads it stays readable through that process's open
(memory-mapped) file; one evicted before it was opened is fetched again.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import threading
from collections.abc import Callable, Iterator

from filelock import FileLock

from .._checks import is_int
from .._files import atomic_write, sync_directory
from ..errors import CorruptShard
from .index import Shard, checksum_of
from .remote import Remote

_SUFFIX = ".parquet"


class ShardCache:
    """A directory of verified shards with an optional size limit.

    Args:
        directory: The cache directory, created if missing; ``~`` is expanded.
        limit: The size limit in bytes of the complete shards, or ``None`` for none.

    Raises:
        ValueError: ``limit`` is neither an int nor ``None``.
    """

    def __init__(self, directory: str, limit: int | None = None) -> None:
        if limit is not None and (not is_int(limit)):
            raise ValueError(f"cache_limit must be an int (bytes) or None, got {limit!r}")
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.limit = limit
        self.downloaded_bytes = 0  # by this process
        self.downloads = 0
        self._corrupt: dict[str, str] = {}  # checksum -> the error, for shards fetched twice
        os.makedirs(self.directory, exist_ok=True)

    def __getstate__(self) -> dict:  # counters are per process
        return {"directory": self.directory, "limit": self.limit}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, downloaded_bytes=0, downloads=0, _corrupt={})

    def _index_path(self, key: str) -> str:
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        return os.path.join(self.directory, f"index-{digest}.json")

    def index_copy(self, key: str) -> str:
        """Where the copy of a dataset's index is kept.

        Args:
            key: The dataset's key: its URL and endpoint.

        Returns:
            The copy's path (it may not exist).
        """
        return self._index_path(key)

    def cached_index(self, key: str) -> bytes | None:
        """The copy of a dataset's index, if the cache keeps one.

        Args:
            key: The dataset's key: its URL and endpoint.

        Returns:
            The index's bytes, or ``None`` if no copy is kept.
        """
        try:
            with open(self._index_path(key), "rb") as file:
                return file.read()
        except FileNotFoundError:
            return None

    def keep_index(self, key: str, raw: bytes) -> None:
        """Keep a copy of a dataset's index, written whole or not at all.

        Args:
            key: The dataset's key: its URL and endpoint.
            raw: The index's bytes.
        """
        atomic_write(self._index_path(key), raw)

    def path(self, shard: Shard) -> str:
        """Where a shard is cached, named by its content.

        Args:
            shard: The shard's entry in the index.

        Returns:
            ``<directory>/<checksum>-<bytes>.parquet``.
        """
        digest = shard.checksum.partition(":")[2][:32]
        return os.path.join(self.directory, f"{digest}-{shard.bytes}{_SUFFIX}")

    def get(
        self, shard: Shard, remote: Remote, wanted: Callable[[], bool] | None = None
    ) -> str | None:
        """The local path of a shard, downloaded and verified if it is not cached yet.

        Args:
            shard: The shard's entry in the index.
            remote: The storage to download it from.
            wanted: Passed by a prefetch. If it says no once the shard's lock is held (the
                reader got there first, and the cache may have evicted the shard since),
                nothing is downloaded.

        Returns:
            The path, or ``None`` when ``wanted`` said no.

        Raises:
            CorruptShard: the shard's size or checksum differed from the index twice.
        """
        final = self.path(shard)
        if _touch(final, shard.bytes):
            return final
        if shard.checksum in self._corrupt:  # fetched twice already by this process
            raise CorruptShard(self._corrupt[shard.checksum])
        with FileLock(final + ".lock", thread_local=False):
            if _touch(final, shard.bytes):  # another process or thread fetched it meanwhile
                return final
            if wanted is not None and not wanted():
                return None
            self._remove_parts(final)
            with contextlib.suppress(FileNotFoundError):
                os.remove(final)  # a copy of another size: damaged on this disk since
            self._download(shard, remote, final)
        return final

    def _download(self, shard: Shard, remote: Remote, final: str) -> None:
        kind = shard.checksum.partition(":")[0]
        part = f"{final}.part-{os.getpid()}-{threading.get_ident()}"
        problem = ""
        for _attempt in range(2):  # a corrupt transfer is fetched once more
            try:
                remote.download(shard.name, part)
                size = os.path.getsize(part)
                if size != shard.bytes:
                    problem = f"it has {size} bytes, the index says {shard.bytes}"
                elif (found := checksum_of(part, kind)) != shard.checksum:
                    problem = f"its checksum is {found}, the index says {shard.checksum}"
                else:
                    with open(part, "rb") as file:
                        os.fsync(file.fileno())
                    self._commit(part, final, size)
                    self.downloaded_bytes += size
                    self.downloads += 1
                    return
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(part)
        self._corrupt[shard.checksum] = message = (
            f"shard {shard.name} ({remote.where(shard.name)}) does not match the dataset's "
            f"index: {problem}, twice. The shard was changed after the index was written: "
            "rewrite the dataset, or rebuild the index with unbroken.streaming.index_parquet; "
            "if the dataset was rewritten at its URL, pass refresh_index=True (the cache keeps "
            "the index it read first)"
        )
        raise CorruptShard(message)

    @staticmethod
    def _remove_parts(final: str) -> None:
        """Partial downloads of this shard: left by a killed process (we hold its lock)."""
        for part in glob.glob(glob.escape(final) + ".part-*"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)

    def sweep(self) -> int:
        """Remove the partial downloads of killed processes.

        Returns:
            How many were removed.
        """
        removed = 0
        # Shards' parts only: an index copy's temporary (keep_index's, hidden) has no lock to
        # tell a live writer from a dead one, and is tiny.
        for part in glob.glob(os.path.join(glob.escape(self.directory), f"*{_SUFFIX}.part-*")):
            final = part.rsplit(".part-", 1)[0]
            lock = FileLock(final + ".lock", thread_local=False)
            try:
                lock.acquire(timeout=0)
            except TimeoutError:
                continue  # a live process is downloading it
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(part)
                    removed += 1
            finally:
                lock.release()
        return removed

    def shards(self) -> list[tuple[str, int, float]]:
        """The complete shards in the cache.

        Returns:
            ``(path, bytes, last use)`` of each, the last use as a modification time.
        """
        out = []
        for path in glob.glob(os.path.join(glob.escape(self.directory), "*" + _SUFFIX)):
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(path)
                out.append((path, info.st_size, info.st_mtime))
        return out

    def _commit(self, part: str, final: str, size: int) -> None:
        """Rename a verified download into place; with a limit, first make room for it by
        evicting least recently used shards, under the cache's lock, so the complete shards
        never exceed the limit, whatever the processes sharing the cache do."""
        with self._room_for(size):
            os.replace(part, final)
            sync_directory(self.directory)

    @contextlib.contextmanager
    def _room_for(self, size: int) -> Iterator[None]:
        """With a limit, held under the cache's lock: least recently used shards evicted until
        ``size`` more bytes fit."""
        if self.limit is None:
            yield
            return
        with FileLock(os.path.join(self.directory, ".evict.lock"), thread_local=False):
            cached = sorted(self.shards(), key=lambda item: item[2])  # oldest use first
            total = sum(item[1] for item in cached) + size
            for path, bytes_, _ in cached:
                if total <= self.limit:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                total -= bytes_
            yield


def _touch(path: str, size: int) -> bool:
    """Mark a cached shard as used now; False if it is not cached, or not whole: a copy whose
    size is not the index's was truncated or extended on this disk after it was verified, and
    is fetched again. (Bytes changed in place at the same size are not seen: that would take
    hashing the shard at every open, a read of all of it.)"""
    try:
        os.utime(path)
        return os.stat(path).st_size == size
    except FileNotFoundError:
        return False
