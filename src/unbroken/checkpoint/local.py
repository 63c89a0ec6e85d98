"""``LocalStorage``: ``Storage`` on the local filesystem, through ``os``.

Each new file is hashed as it is written (sha256, ~1 GB/s, so each byte is handled once), then
flushed and fsynced; a new directory's entry is fsynced in its parent. A checkpoint commits by
the protocol's default: a temporary directory, fsynced, renamed into place. DCP writes and reads
its files in place (no copy). Costs: one fsync per file and per directory entry made durable.

``torch.save`` turns an error of the file it writes into ``RuntimeError: [enforce fail at
inline_container.cc] unexpected pos``; ``LocalStorage.write`` keeps the real ``OSError`` (ENOSPC
included, which ``writing.disk_full`` turns into a message) and raises that instead.

``os.fsync`` and ``open`` are looked up when called, not bound at import, so that tests (and
tools) that patch them see every call.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO, cast

from .._files import atomic_write, sync_directory
from .storage import Digest, Entry, Stat, Storage, basename, join, parent, sha256

__all__ = ["LocalStorage"]


class LocalStorage(Storage):
    """``Storage`` on the local filesystem (see the module)."""

    def exists(self, path: str) -> bool:
        return Path(path).exists()

    def is_directory(self, path: str) -> bool:
        return Path(path).is_dir()

    def list_directory(self, path: str) -> list[Entry]:
        with os.scandir(path) as entries:
            return [Entry(entry.name, entry.is_dir()) for entry in entries]

    def make_directory(self, path: str) -> None:
        self._fenced()
        os.mkdir(path)

    def make_directories(self, path: str) -> None:
        missing, directory = [], Path(path)
        while not directory.exists():
            missing.append(directory)
            directory = directory.parent
        if missing:
            self._fenced()
        for new in reversed(missing):
            new.mkdir(exist_ok=True)
            self.sync_directory(str(new.parent))

    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> Digest:
        self._fenced()
        with open(path, "xb") as file:
            out = _HashingWriter(file)
            try:
                fill(cast(BinaryIO, out))  # torch.save uses only write() and flush()
            finally:
                if out.error is not None:
                    raise out.error from None  # the cause; torch's own error is only its symptom
            file.flush()
            os.fsync(file.fileno())
        return Digest(out.sha256.hexdigest(), out.size)

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def rename(self, source: str, target: str) -> None:
        self._fenced()
        os.rename(source, target)

    def remove_tree(self, path: str) -> None:
        self._fenced()
        shutil.rmtree(path, ignore_errors=True)

    def sync_directory(self, path: str) -> None:
        sync_directory(path)

    def free_space(self, path: str) -> int:
        return shutil.disk_usage(path).free

    # DCP writes and reads its files here, in place.
    def write_directory(
        self, path: str, fill: Callable[[str], Sequence[str]]
    ) -> list[tuple[str, Digest]]:
        return [
            (name, Digest(sha256(self, join(path, name)), self.size(join(path, name))))
            for name in fill(path)
        ]

    def readable_directory(
        self, path: str, files: Sequence[str], mine: Sequence[str], verify: Callable[[str], None]
    ) -> str:
        for name in mine:  # each process checks its share; the reader reads them in place
            verify(name)
        return path

    # Whole small objects.
    def create(self, path: str, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.sync_directory(parent(path))

    def overwrite(self, path: str, data: bytes) -> None:
        # Readers see the old content or the new, never a part.
        atomic_write(path, data, temporary=f"{basename(path)}.{secrets.token_hex(4)}.tmp")

    def delete(self, path: str) -> None:
        os.unlink(path)

    def stat(self, path: str) -> Stat:
        status = os.stat(path)
        modified = datetime.fromtimestamp(status.st_mtime, timezone.utc)
        return Stat(modified, f"{status.st_ino}-{status.st_mtime_ns}-{status.st_size}")

    def tree_size(self, path: str) -> int:
        total = 0
        for folder, _, files in os.walk(path):
            for file in files:
                try:
                    total += os.lstat(os.path.join(folder, file)).st_size
                except OSError:
                    pass
        return total


class _HashingWriter:
    """A write-only file that hashes what passes through, so each byte is handled once."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            written = self.file.write(data)
        except OSError as error:  # torch.save replaces it with "unexpected pos": keep it
            self.error = self.error or error
            raise
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self.file.flush()
