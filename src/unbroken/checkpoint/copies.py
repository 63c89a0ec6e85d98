"""The local copies that ``FsspecStorage`` keeps of what this machine uploaded or downloaded.

A copy is a file in the cache directory (by default ``$XDG_CACHE_HOME/unbroken/checkpoints``,
else ``~/.cache/...``, one folder per URL) named by its content's sha256. When a checkpoint is
read, a file whose copy is there and hashes to what the manifest says is read from the disk
instead of downloaded (``Copies.expect``); a copy that does not match is deleted and the file
downloaded. A job restarted on the same machine downloads only the manifests; a new machine has
no copies. Each save prunes the copies no kept checkpoint lists. Best effort throughout: a full
or read-only disk only means no copy. A copy that cannot be written (ENOSPC, EDQUOT, EROFS...)
is dropped, its file closed and deleted whatever the disk says, and the save or read goes on:
the checkpoint is in the store all the same. The ``unbroken`` logger says so at WARNING, once
until a copy as large is kept again: the directory, the disk's error, and for a full disk how
much the copy needed and how much is free. (A log record, not a ``warnings`` warning: a filter
that turns warnings into errors must not fail the upload that the copy rides along with.)

Costs: a copy is written as the bytes pass (no second read); ``expect`` hashes a copy once per
read of a checkpoint (~1 GB/s).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from .._log import logger
from .._units import human

__all__ = ["Copies", "LocalCopy", "cache_directory", "file_sha256"]


def cache_directory(url: str, cache: str | bool) -> str | None:
    """The folder of ``url``'s local copies in ``cache`` (``True``: the user's cache)."""
    if cache is False:
        return None
    if cache is True:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache = os.path.join(base, "unbroken", "checkpoints")
    return os.path.join(cache, hashlib.sha256(url.encode()).hexdigest()[:16])


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class Copies:
    """One store's local copies (``directory``: None for none), and the files of the store
    known to match one (path -> copy; for this process only: not pickled)."""

    def __init__(self, url: str, cache: str | bool) -> None:
        self.directory = cache_directory(url, cache)
        self.known: dict[str, str] = {}
        # The bytes after which a copy failed, said once; None again once one that large is kept.
        self.failing: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory, self.known, self.failing = state["directory"], {}, None

    def expect(self, path: str, sha256: str, size: int) -> None:
        """Serve ``path``'s reads from a copy of content ``sha256`` (``size`` bytes), if one
        is here and hashes to it; a copy that does not is deleted."""
        self.known.pop(path, None)  # a copy found before may be gone (pruned) or changed
        if self.directory is None:
            return
        local = os.path.join(self.directory, sha256)
        try:
            if os.path.getsize(local) == size and file_sha256(local) == sha256:
                self.known[path] = local
                return
            os.unlink(local)  # not what its name says: downloaded again
        except OSError:
            pass

    def new(self) -> LocalCopy:
        """A copy to write as bytes pass."""
        return LocalCopy(self.directory, self._outcome)

    def _outcome(self, error: OSError | None, size: int) -> None:
        """A copy of ``size`` bytes was kept (``error`` None), or dropped for ``error`` after
        ``size`` bytes: said once, until a copy at least that large is kept again (small ones,
        manifests, may fit on a disk that the checkpoint's files do not)."""
        if error is None:
            if self.failing is not None and size >= self.failing:
                self.failing = None
            return
        if self.failing is not None:
            return
        self.failing = size
        logger.warning(not_kept(error, self.directory or "", size))

    def keep(self, data: bytes) -> None:
        """Keep a copy of ``data``, read whole."""
        if self.directory is not None and data:
            copy = self.new()
            copy.write(data)
            copy.keep(hashlib.sha256(data).hexdigest())

    def prune(self, listed: set[str]) -> None:
        """Delete every copy whose sha256 is not ``listed``."""
        if self.directory is None or not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            if name not in listed:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except OSError:
                    pass


def not_kept(error: OSError, directory: str, size: int) -> str:
    """What a copy that failed with ``error`` after ``size`` bytes means, for the log."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"; {human(shutil.disk_usage(directory).free)} are free there"
        except OSError:
            free = ""
        what = "is full" if error.errno == errno.ENOSPC else "quota is used up"
        reason = (
            f"{reason}: the disk holding it {what} (the copy needed at least {human(size)} "
            f"({size} bytes){free})"
        )
    return (
        f"FsspecStorage: no local copy of a checkpoint file is kept in {directory}: "
        f"{reason}. The save and the read go on: the files are in the store, and a restart "
        "on this machine downloads those it has no copy of. Free space there, or give "
        "FsspecStorage(cache=...) a directory on another disk, or cache=False for no copies."
    )


class LocalCopy:
    """A file being copied into the cache: written under a temporary name, then named by its
    sha256 once whole (a copy is never half there under that name). Never raises: a copy
    that fails is dropped, and ``outcome`` told (the error and the bytes it was handed, or
    None once a copy is kept)."""

    def __init__(
        self, cache: str | None, outcome: Callable[[OSError | None, int], None] | None = None
    ) -> None:
        self.file: Any = None
        self.path = ""
        self.size = 0  # bytes handed to it
        self.outcome = outcome
        if cache is not None:
            try:
                os.makedirs(cache, exist_ok=True)
                handle, self.path = tempfile.mkstemp(prefix=".part-", dir=cache)
                self.file = os.fdopen(handle, "wb")
            except OSError as error:
                self.file = None
                self._failed(error)

    def write(self, data: Any) -> None:
        if self.file is not None:
            self.size += memoryview(data).nbytes
            try:
                self.file.write(data)
            except OSError as error:
                self._failed(error)

    def keep(self, sha256: str) -> None:
        if self.file is not None:
            try:
                self.file.close()  # its buffer's last write: ENOSPC may come only now
                os.replace(self.path, os.path.join(os.path.dirname(self.path), sha256))
            except OSError as error:
                self._failed(error)
                return
            self.file, self.path = None, ""
            if self.outcome is not None:
                self.outcome(None, self.size)

    def drop(self) -> None:
        """Close and delete the partial copy; never raises (its disk may be full)."""
        file, self.file = self.file, None
        if file is not None:
            try:
                file.close()  # on a full disk its buffer's flush fails; the file closes anyway
            except OSError:
                pass
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = ""

    def _failed(self, error: OSError) -> None:
        self.drop()
        if self.outcome is not None:
            self.outcome(error, self.size)
