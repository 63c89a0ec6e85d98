"""The filesystem operations a Checkpointer performs, as a protocol, and their local implementation.

``Storage`` names every operation the Checkpointer and the manifest reader need, with string
paths, so that a remote filesystem (an fsspec one, say) is one new class implementing it, not a
change to the save and load logic. ``LocalStorage`` implements it with ``os``: each new file is
hashed as it is written (sha256, ~1 GB/s, so each byte is handled once), then flushed and
fsynced; a new directory's entry is fsynced in its parent. Costs: one fsync per file and per
directory entry made durable.

``torch.save`` turns an error of the file it writes into ``RuntimeError: [enforce fail at
inline_container.cc] unexpected pos``; ``LocalStorage.write`` keeps the real ``OSError`` (ENOSPC
included, which ``space.disk_full`` turns into a message) and raises that instead.

``os.fsync`` and ``open`` are looked up when called, not bound at import, so that tests (and
tools) that patch them see every call.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NamedTuple, Protocol, cast

__all__ = [
    "Digest",
    "Entry",
    "LocalStorage",
    "Storage",
    "basename",
    "join",
    "parent",
    "parents",
    "sha256",
]


class Digest(NamedTuple):
    """What ``Storage.write`` wrote: the sha256 (hex) and the size in bytes."""

    sha256: str
    size: int


class Entry(NamedTuple):
    """An entry of a directory: its name (not its path) and whether it is a directory."""

    name: str
    is_directory: bool


class Storage(Protocol):
    """Where checkpoints live. Paths are strings: a local path, or a URI for a remote store."""

    renames: bool
    """Whether ``rename`` moves a directory in one step (a local disk). Where it cannot (object
    storage), a checkpoint is written in place and committed by its manifest, written last
    (``layout``)."""

    def exists(self, path: str) -> bool:
        """Whether anything is at ``path``.

        Args:
            path: A local path or a URI.

        Returns:
            True if a file or a directory is there.
        """
        ...

    def is_directory(self, path: str) -> bool:
        """Whether ``path`` is a directory.

        Args:
            path: A local path or a URI.

        Returns:
            True for a directory; False for a file or nothing.
        """
        ...

    def list_directory(self, path: str) -> list[Entry]:
        """The entries of a directory.

        Args:
            path: The directory.

        Returns:
            Its entries, in no particular order.
        """
        ...

    def make_directory(self, path: str) -> None:
        """Create one directory.

        Args:
            path: The new directory. Its parent exists; an existing ``path`` is an error.
        """
        ...

    def make_directories(self, path: str) -> None:
        """Create a directory and its missing parents, like ``mkdir -p``.

        Args:
            path: The directory. Each new directory's entry is made durable in its parent.
        """
        ...

    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> Digest:
        """Create a file durably with what ``fill(file)`` writes.

        Args:
            path: The new file; an existing one is an error.
            fill: Called once with the open binary file; writes its content.

        Returns:
            The sha256 and size of what was written.
        """
        ...

    def open_read(self, path: str) -> BinaryIO:
        """Open a file for reading bytes.

        Args:
            path: The file.

        Returns:
            The open file; the caller closes it.
        """
        ...

    def size(self, path: str) -> int:
        """The size of a file.

        Args:
            path: The file.

        Returns:
            Its size in bytes.
        """
        ...

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link.

        Args:
            path: A local path or a URI.

        Returns:
            True for a link; always False on a store that has none.
        """
        ...

    def rename(self, source: str, target: str) -> None:
        """Rename a file or a directory in one step.

        Args:
            source: The current path.
            target: The new path.
        """
        ...

    def remove_tree(self, path: str) -> None:
        """Remove a path and everything under it, ignoring what cannot be removed.

        Args:
            path: The file or directory.
        """
        ...

    def sync_directory(self, path: str) -> None:
        """Make a directory's entries (new files, renames) durable.

        Args:
            path: The directory.
        """
        ...

    def free_space(self, path: str) -> int:
        """The bytes free for new data on the filesystem holding ``path``.

        Args:
            path: A path on that filesystem.

        Returns:
            The free bytes.
        """
        ...

    def commit(self, staged: str, target: str, aside: str) -> None:
        """Make a staged checkpoint appear whole at ``target``, durably.

        Afterwards ``target`` holds all of the new checkpoint. If the process died during the
        commit, it holds the old one (maybe at ``aside``, which ``layout.clean`` puts back) or
        nothing; never a mix. A local disk renames the directory. A store without renames gets
        ``staged == target`` (``layout.stage``): the manifest, written last, committed it.

        Args:
            staged: The directory the checkpoint was written in, manifest last.
            target: Where the checkpoint appears, replacing one there.
            aside: A free name where the old checkpoint is moved during the swap.
        """
        ...


class LocalStorage:
    """``Storage`` on the local filesystem."""

    renames = True

    def exists(self, path: str) -> bool:
        return Path(path).exists()

    def is_directory(self, path: str) -> bool:
        return Path(path).is_dir()

    def list_directory(self, path: str) -> list[Entry]:
        with os.scandir(path) as entries:
            return [Entry(entry.name, entry.is_dir()) for entry in entries]

    def make_directory(self, path: str) -> None:
        os.mkdir(path)

    def make_directories(self, path: str) -> None:
        missing, directory = [], Path(path)
        while not directory.exists():
            missing.append(directory)
            directory = directory.parent
        for new in reversed(missing):
            new.mkdir(exist_ok=True)
            self.sync_directory(str(new.parent))

    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> Digest:
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
        os.rename(source, target)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def sync_directory(self, path: str) -> None:
        if os.name == "posix":  # elsewhere directories cannot be opened, and renames are journaled
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def free_space(self, path: str) -> int:
        return shutil.disk_usage(path).free

    def commit(self, staged: str, target: str, aside: str) -> None:
        old = None
        try:
            if self.exists(target):  # a directory cannot be renamed over a non-empty one
                self.rename(target, aside)
                old = aside
            self.rename(staged, target)  # the commit
            self.sync_directory(parent(target))
        except BaseException:
            if old is not None and not self.exists(target):
                self.rename(old, target)
            raise
        if old is not None:
            self.remove_tree(old)


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


def sha256(storage: Storage, path: str) -> str:
    """The sha256 (hex) of file ``path``, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with storage.open_read(path) as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def parent(path: str) -> str:
    """The directory holding ``path`` (a local path or a URI)."""
    head = path.rstrip("/").rpartition("/")[0]
    return head if head else ("/" if path.startswith("/") else ".")


def parents(path: str) -> list[str]:
    """Every directory above ``path``, the outermost first (``/``, or a URI's first part)."""
    found, current = [], path.rstrip("/")
    while "/" in current.strip("/"):
        current = parent(current)
        found.append(current)
    return found[::-1]


def basename(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2]


def join(directory: str, name: str) -> str:
    """``directory/name`` with "/", which local paths and URIs both take."""
    return f"{directory.rstrip('/')}/{name}" if directory.rstrip("/") else f"/{name}"
