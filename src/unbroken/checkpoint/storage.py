"""``Storage``: every operation on the place where checkpoints (and a run directory) live, as one
protocol that a backend subclasses, with string paths (a local path, or a URL).

A backend implements the primitives (files and directories) and inherits the rest:

- **The commit protocol** (``stage``, ``commit``, ``abandon``, ``retire``, ``is_committed``):
  how a checkpoint becomes whole at once and how one goes without a reader seeing a part. The
  defaults are a disk's: write in a temporary directory, fsync, rename into place
  (``LocalStorage``). A store without rename overrides them: it writes in place and commits by
  the manifest, written last (``FsspecStorage``).
- **Directories for a reader or writer of local files** (``write_directory``,
  ``readable_directory``): DCP writes and reads local files only. The defaults copy through a
  local temporary directory, which serves any backend; a local disk overrides them to work in
  place.
- **Hooks** with a do-nothing default: ``abort_uploads`` (what killed uploads left),
  ``prune_cache`` and ``expect`` (local copies of what was read), ``fence`` (asked before every
  change: a lease), ``tried_once`` (a caller that retries itself).
- **Whole small objects** (``create``, exclusively, ``read_bytes``, ``overwrite``, ``delete``,
  ``stat``: the store's time of an object, by the store's clock), and ``tree_size``: what a
  lease and ``unbroken inspect`` need. Not fenced: the lease is what the fence asks.

No caller asks which class a storage is: what differs between backends is a method.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from abc import abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import BinaryIO, Protocol

from .files import CopiedDirectory, Digest, Entry, Stat, copy_file, join, parent, parents

__all__ = ["Storage"]


class Storage(Protocol):
    """Where checkpoints live; a backend subclasses it (see the module). Paths are strings."""

    fence: Callable[[], None] | None = None
    """Called before every change to the store (the Trainer's run directory: its lease's)."""

    # The primitives: every backend implements them.
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
            fill: Called with the open binary file; writes its content (maybe again, whole,
                on a retry).

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
        """Whether ``path`` is a symbolic link.

        Args:
            path: A local path or a URI.

        Returns:
            True for a link; always False on a store that has none.
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

    # The commit protocol; the defaults stage, fsync and rename.
    def stage(self, target: str, temporary: str) -> str:
        """Where a checkpoint to be committed at ``target`` is written.

        Args:
            target: Its final directory.
            temporary: A free name beside it, for a store that commits by a rename.

        Returns:
            The directory to write it in, manifest last; ``commit`` then makes it whole at
            ``target``. By default ``temporary``, made now.
        """
        self.make_directory(temporary)
        return temporary

    def commit(self, staged: str, target: str, aside: str) -> None:
        """Make a staged checkpoint appear whole at ``target``, durably.

        Afterwards ``target`` holds all of the new checkpoint. If the process died during the
        commit, it holds the old one (maybe at ``aside``, which ``layout.clean`` puts back) or
        nothing; never a mix. By default the directory is renamed into place.

        Args:
            staged: The directory the checkpoint was written in, manifest last.
            target: Where the checkpoint appears, replacing one there.
            aside: A free name where the old checkpoint is moved during the swap.
        """
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

    def abandon(self, staged: str) -> None:
        """Remove what a save that failed wrote at ``staged``, unless it was committed.

        Args:
            staged: What ``stage`` returned. By default it is removed: a committed checkpoint
                was renamed away from it.
        """
        self.remove_tree(staged)

    def retire(self, path: str, aside: str) -> None:
        """Delete checkpoint ``path`` so that no reader ever sees a part of it.

        Args:
            path: The checkpoint's directory.
            aside: A free name out of view; by default it is renamed there first.
        """
        self.rename(path, aside)
        self.remove_tree(aside)

    def is_committed(self, path: str) -> bool:
        """Whether the checkpoint directory ``path`` (named ``step-*``) was committed.

        Args:
            path: The directory.

        Returns:
            By default True: it got its name by the commit's rename.
        """
        return True

    def blocker(self, path: str) -> str | None:
        """What keeps a directory from being at ``path``: a file there or above it.

        Args:
            path: Where a directory is wanted.

        Returns:
            The file in the way, or None (a directory there, or nothing yet).
        """
        if self.is_directory(path):
            return None
        for above in parents(path):
            if self.exists(above) and not self.is_directory(above):
                return above
        return path if self.exists(path) else None

    # Directories of local files, for DCP; the defaults copy through a temporary directory.
    def write_directory(
        self, path: str, fill: Callable[[str], Sequence[str]]
    ) -> list[tuple[str, Digest]]:
        """Files written by a writer of local files, durable under ``path``.

        Args:
            path: The directory in the storage.
            fill: Called with a local directory; writes files into it and returns the names
                of those to keep.

        Returns:
            Each kept file's name and digest.
        """
        with tempfile.TemporaryDirectory(prefix="unbroken-dcp-") as local:
            return [
                (name, self.write(join(path, name), partial(copy_file, os.path.join(local, name))))
                for name in fill(local)
            ]

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
            The local directory. By default a ``CopiedDirectory`` of every file, each
            verified (the read that hashed it serves the copy): ``remove()`` it once read.
        """
        local = CopiedDirectory(tempfile.mkdtemp(prefix="unbroken-dcp-"))
        try:
            for name in files:
                verify(name)
                with (
                    self.open_read(join(path, name)) as opened,
                    open(os.path.join(local, name), "wb") as out,
                ):
                    shutil.copyfileobj(opened, out, 1 << 22)
        except BaseException:  # a damaged or unreadable file: nothing of it stays on the disk
            local.remove()
            raise
        return local

    # Hooks: a backend that has nothing to do there inherits these.
    def abort_uploads(self, prefix: str) -> None:
        """Abort what writers killed mid-upload left under ``prefix`` (none by default).

        Args:
            prefix: The path under which uploads are aborted.
        """

    def prune_cache(self, kept: list[str]) -> None:
        """Delete the local copies that no kept checkpoint lists (none by default).

        Args:
            kept: The kept checkpoints' directories.
        """

    def expect(self, path: str, sha256: str, size: int) -> None:
        """Say what a file holds, from a manifest, so a local copy may serve its reads.

        Args:
            path: The file.
            sha256: Its content's sha256 (hex), as the manifest lists it.
            size: Its size in bytes.
        """

    def fenced(self) -> None:
        """Call ``fence`` if set: it raises if this job may change the store no more."""
        if self.fence is not None:
            self.fence()

    def tried_once(self) -> Storage:
        """This storage with each operation tried once, for a caller that tries again itself.

        Returns:
            By default the storage itself: it has no retries.
        """
        return self

    # Whole small objects (a lease), and what unbroken inspect measures.
    def create(self, path: str, data: bytes) -> None:
        """Create a file holding ``data``, only if nothing is there.

        Args:
            path: The new file.
            data: Its content.

        Raises:
            FileExistsError: something is at ``path``.
        """
        self.write(path, lambda out: out.write(data))

    def read_bytes(self, path: str) -> bytes:
        """A file's content.

        Args:
            path: The file.

        Returns:
            All its bytes.
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

        Raises:
            FileNotFoundError: nothing is there.
        """
        if not self.exists(path):
            raise FileNotFoundError(path)
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
        if not self.is_directory(path):
            return self.size(path)
        return sum(self.tree_size(join(path, entry.name)) for entry in self.list_directory(path))
