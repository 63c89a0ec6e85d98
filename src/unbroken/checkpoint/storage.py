"""``Storage``: every operation on where checkpoints and run directories live, a protocol that
a backend subclasses. It implements the primitives and inherits or overrides the rest: the commit
protocol (by default a directory renamed into place), DCP's local directories, the hooks, whole
small objects with the store's time of each. No caller asks a storage's class.

What the composite operations do by default, built on the primitives: a checkpoint committed by
a rename (a disk's), and the local directories that DCP reads and writes, served through a copy
(any backend's). A backend overrides what it does better (``LocalStorage`` lets DCP work in
place; ``FsspecStorage`` commits by the manifest).

The values the operations take and give: ``Digest`` (what a write wrote), ``Entry`` (a
directory's entry), ``Stat`` (an object's time by the store's clock, and its version);
``join``, ``parent``, ``parents`` and ``basename`` work alike on local paths and URLs (always
``/``); ``sha256`` reads a file through a storage.

Costs: a copy through a temporary directory holds each file on the local disk once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from abc import abstractmethod
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial
from typing import BinaryIO, NamedTuple, Protocol

__all__ = [
    "CopiedDirectory",
    "Digest",
    "Entry",
    "Stat",
    "Storage",
    "basename",
    "join",
    "parent",
    "parents",
    "sha256",
]


class Storage(Protocol):
    """Where checkpoints live; a backend subclasses it (see the module). Paths are strings."""

    fence: Callable[[], None] | None = None
    """Called before every change to the store (the Trainer's run directory: its lease's)."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether anything is at ``path``.

        Args:
            path: A local path or a URI.

        Returns:
            True if a file or a directory is there.
        """

    @abstractmethod
    def is_directory(self, path: str) -> bool:
        """Whether ``path`` is a directory.

        Args:
            path: A local path or a URI.

        Returns:
            True for a directory; False for a file or nothing.
        """

    @abstractmethod
    def list_directory(self, path: str) -> list[Entry]:
        """The entries of a directory.

        Args:
            path: The directory.

        Returns:
            Its entries, in no particular order.
        """

    @abstractmethod
    def make_directory(self, path: str) -> None:
        """Create one directory.

        Args:
            path: The new directory. Its parent exists; an existing ``path`` is an error.
        """

    @abstractmethod
    def make_directories(self, path: str) -> None:
        """Create a directory and its missing parents, like ``mkdir -p``.

        Args:
            path: The directory. Each new directory's entry is made durable in its parent.
        """

    @abstractmethod
    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> Digest:
        """Create a file durably with what ``fill(file)`` writes.

        Args:
            path: The new file; an existing one is an error.
            fill: Writes the content into the open binary file (again, whole, on a retry).

        Returns:
            The sha256 and size of what was written.
        """

    @abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """Open a file for reading bytes.

        Args:
            path: The file.

        Returns:
            The open file; the caller closes it.
        """

    @abstractmethod
    def size(self, path: str) -> int:
        """The size of a file.

        Args:
            path: The file.

        Returns:
            Its size in bytes.
        """

    @abstractmethod
    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (never, on a store that has none).

        Args:
            path: A local path or a URI.

        Returns:
            True for a link.
        """

    @abstractmethod
    def rename(self, source: str, target: str) -> None:
        """Rename a file or a directory (in one step where the commit protocol relies on it).

        Args:
            source: The current path.
            target: The new path.
        """

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove a path and everything under it, ignoring what cannot be removed.

        Args:
            path: The file or directory.
        """

    @abstractmethod
    def sync_directory(self, path: str) -> None:
        """Make a directory's entries (new files, renames) durable.

        Args:
            path: The directory.
        """

    @abstractmethod
    def free_space(self, path: str) -> int:
        """The bytes free for new data on the filesystem holding ``path``.

        Args:
            path: A path on that filesystem.

        Returns:
            The free bytes.
        """

    def stage(self, target: str, temporary: str) -> str:
        """Where a checkpoint to be committed at ``target`` is written, manifest last.

        Args:
            target: Its final directory.
            temporary: A free name beside it, for a store that commits by a rename.

        Returns:
            The directory; by default ``temporary``, made now.
        """
        self.make_directory(temporary)
        return temporary

    def commit(self, staged: str, target: str, aside: str) -> None:
        """Make a staged checkpoint appear whole at ``target``, durably.

        If the process dies during it, ``target`` holds the old one (maybe at ``aside``, which
        ``layout.clean`` puts back) or nothing; never a mix. By default a rename.

        Args:
            staged: The directory the checkpoint was written in, manifest last.
            target: Where the checkpoint appears, replacing one there.
            aside: A free name where the old checkpoint is moved during the swap.
        """
        rename_into_place(self, staged, target, aside)

    def abandon(self, staged: str) -> None:
        """Remove what a save that failed wrote at ``staged``, unless it was committed.

        Args:
            staged: What ``stage`` returned; by default removed (a commit renamed it away).
        """
        self.remove_tree(staged)

    def retire(self, path: str, aside: str) -> None:
        """Delete checkpoint ``path`` so that no reader ever sees a part of it.

        Args:
            path: The checkpoint's directory.
            aside: A free name out of view; by default it is renamed there first.
        """
        rename_and_remove(self, path, aside)

    def is_committed(self, path: str) -> bool:
        """Whether the checkpoint directory ``path`` (named ``step-*``) was committed.

        Args:
            path: The directory.

        Returns:
            By default True: it got its name by the commit's rename.
        """
        return True

    def committed_among(self, paths: list[str]) -> list[str]:
        """Those of ``paths`` that were committed: ``is_committed`` asked of many at once.

        Args:
            paths: Checkpoint directories (named ``step-*``) in one directory.

        Returns:
            The committed ones; by default ``is_committed`` of each (a store overrides it with
            one listing, so a save's requests do not grow with the checkpoints kept).
        """
        return [path for path in paths if self.is_committed(path)]

    def blocker(self, path: str) -> str | None:
        """What keeps a directory from being at ``path``: a file there or above it.

        Args:
            path: Where a directory is wanted.

        Returns:
            The file in the way, or None (a directory there, or nothing yet).
        """
        return file_in_the_way(self, path)

    def write_directory(
        self, path: str, fill: Callable[[str], Sequence[str]]
    ) -> list[tuple[str, Digest]]:
        """Files written by a writer of local files, durable under ``path``.

        Args:
            path: The directory in the storage.
            fill: Writes files into the local directory it is given; returns those to keep.

        Returns:
            Each kept file's name and digest.
        """
        return copied_in(self, path, fill)

    def readable_directory(
        self, path: str, files: Sequence[str], mine: Sequence[str], verify: Callable[[str], None]
    ) -> str:
        """A local directory holding ``files`` of ``path``, for a reader of local files.

        Args:
            path: The directory in the storage.
            files: Its files' names, every one that may be read.
            mine: Those this process must ``verify`` (another process checks the rest).
            verify: Raises if a file (by name) is not what was written.

        Returns:
            The local directory; by default a ``CopiedDirectory`` (``remove()`` it once read).
        """
        return copied_out(self, path, files, verify)

    def abort_uploads(self, prefix: str) -> None:
        """Abort what writers killed mid-upload left under ``prefix`` (by default, nothing).

        Args:
            prefix: The path under which uploads are aborted.
        """
        return None

    def prune_cache(self, kept: list[str]) -> None:
        """Delete the local copies that no kept checkpoint lists (none by default).

        Args:
            kept: The kept checkpoints' directories.
        """
        return None

    def expect(self, path: str, sha256: str, size: int) -> None:
        """Say what a file holds, from a manifest, so a local copy may serve its reads.

        Args:
            path: The file.
            sha256: Its content's sha256 (hex), as the manifest lists it.
            size: Its size in bytes.
        """
        return None

    def _fenced(self) -> None:  # ``fence`` raises if this job may change the store no more
        if self.fence is not None:
            self.fence()

    def tried_once(self) -> Storage:
        """This storage with each operation tried once, for a caller that tries again itself.

        Returns:
            By default the storage itself: it has no retries.
        """
        return self

    def create(self, path: str, data: bytes) -> None:
        """Create a file holding ``data``; ``FileExistsError`` if something is there.

        Args:
            path: The new file.
            data: Its content.
        """
        self.write(path, lambda out: out.write(data))

    def read_bytes(self, path: str) -> bytes:
        """A file's content, whole.

        Args:
            path: The file.

        Returns:
            Its bytes.
        """
        with self.open_read(path) as opened:
            return opened.read()

    def overwrite(self, path: str, data: bytes) -> None:
        """Replace a file's content with ``data`` at once (or create it).

        Args:
            path: The file.
            data: Its new content.
        """
        self.remove_tree(path)
        self.write(path, lambda out: out.write(data))

    def delete(self, path: str) -> None:
        """Delete one file.

        Args:
            path: The file.
        """
        self.remove_tree(path)

    def stat(self, path: str) -> Stat:
        """When a file was last written, by the store's clock, and its version.

        Args:
            path: The file.

        Returns:
            Its ``Stat``.

        Raises:
            NotImplementedError: the backend cannot tell (it must, to hold a lease).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot tell when {path} was written")

    def tree_size(self, path: str) -> int:
        """The bytes of every file under ``path``.

        Args:
            path: A directory (or a file).

        Returns:
            Their sum.
        """
        return summed_sizes(self, path)


class CopiedDirectory(str):
    """The path of a local copy of a directory (``readable_directory``): remove it once read."""

    def remove(self) -> None:
        """Delete the copy."""
        shutil.rmtree(self, ignore_errors=True)


def rename_into_place(storage: Storage, staged: str, target: str, aside: str) -> None:
    """``staged`` renamed to ``target``, one there first moved ``aside`` (put back if the
    commit failed, deleted once it is done), and the rename made durable."""
    old = None
    try:
        if storage.exists(target):  # a directory cannot be renamed over a non-empty one
            storage.rename(target, aside)
            old = aside
        storage.rename(staged, target)  # the commit
        storage.sync_directory(parent(target))
    except BaseException:
        if old is not None and not storage.exists(target):
            storage.rename(old, target)
        raise
    if old is not None:
        storage.remove_tree(old)


def rename_and_remove(storage: Storage, path: str, aside: str) -> None:
    """``path`` renamed ``aside``, out of view, then removed: no reader sees a part of it."""
    storage.rename(path, aside)
    storage.remove_tree(aside)


def file_in_the_way(storage: Storage, path: str) -> str | None:
    """A file at ``path`` or above it, where a directory is wanted."""
    if storage.is_directory(path):
        return None
    for above in parents(path):
        if storage.exists(above) and not storage.is_directory(above):
            return above
    return path if storage.exists(path) else None


def copied_in(
    storage: Storage, path: str, fill: Callable[[str], Sequence[str]]
) -> list[tuple[str, Digest]]:
    """What ``fill`` wrote into a local temporary directory, written under ``path``."""
    with tempfile.TemporaryDirectory(prefix="unbroken-dcp-") as local:
        return [
            (name, storage.write(join(path, name), partial(_copy, os.path.join(local, name))))
            for name in fill(local)
        ]


def copied_out(
    storage: Storage, path: str, files: Sequence[str], verify: Callable[[str], None]
) -> CopiedDirectory:
    """``files`` of ``path``, each verified, copied into a local temporary directory (the read
    that hashed a file serves its copy: ``FsspecStorage`` keeps the last download)."""
    local = CopiedDirectory(tempfile.mkdtemp(prefix="unbroken-dcp-"))
    try:
        for name in files:
            verify(name)
            with (
                storage.open_read(join(path, name)) as opened,
                open(os.path.join(local, name), "wb") as out,
            ):
                shutil.copyfileobj(opened, out, 1 << 22)
    except BaseException:  # a damaged or unreadable file: nothing of it stays on the disk
        local.remove()
        raise
    return local


def summed_sizes(storage: Storage, path: str) -> int:
    """The bytes of every file under ``path``, listed one directory at a time."""
    if not storage.is_directory(path):
        return storage.size(path)
    return sum(
        summed_sizes(storage, join(path, entry.name)) for entry in storage.list_directory(path)
    )


def _copy(path: str, out: BinaryIO) -> None:
    with open(path, "rb") as source:
        shutil.copyfileobj(source, out, 1 << 22)


class Digest(NamedTuple):
    """What ``Storage.write`` wrote: the sha256 (hex) and the size in bytes."""

    sha256: str
    size: int


class Entry(NamedTuple):
    """An entry of a directory: its name (not its path) and whether it is a directory."""

    name: str
    is_directory: bool


class Stat(NamedTuple):
    """What ``Storage.stat`` says of an object: ``modified``, its last write by the store's
    clock (UTC); ``version``, a value that changes with every write of it."""

    modified: datetime
    version: str


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
