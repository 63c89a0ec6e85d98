"""The local copies that ``FsspecStorage`` keeps of what this machine uploaded or downloaded.

A copy is a file in the cache directory (by default ``$XDG_CACHE_HOME/unbroken/checkpoints``,
else ``~/.cache/...``, one folder per URL) named by its content's sha256. When a checkpoint is
read, a file whose copy is there and hashes to what the manifest says is read from the disk
instead of downloaded (``Copies.expect``); a copy that does not match is deleted and the file
downloaded. A job restarted on the same machine downloads only the manifests; a new machine has
no copies. Each save prunes the copies no kept checkpoint lists. Best effort throughout: a full
or read-only disk only means no copy.

Costs: a copy is written as the bytes pass (no second read); ``expect`` hashes a copy once per
read of a checkpoint (~1 GB/s).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

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

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory, self.known = state["directory"], {}

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
        return LocalCopy(self.directory)

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


class LocalCopy:
    """A file being copied into the cache: written under a temporary name, then named by its
    sha256 once whole (a copy is never half there under that name)."""

    def __init__(self, cache: str | None) -> None:
        self.file: Any = None
        self.path = ""
        if cache is not None:
            try:
                os.makedirs(cache, exist_ok=True)
                handle, self.path = tempfile.mkstemp(prefix=".part-", dir=cache)
                self.file = os.fdopen(handle, "wb")
            except OSError:
                self.file = None

    def write(self, data: Any) -> None:
        if self.file is not None:
            try:
                self.file.write(data)
            except OSError:
                self.drop()

    def keep(self, sha256: str) -> None:
        if self.file is not None:
            try:
                self.file.close()
                os.replace(self.path, os.path.join(os.path.dirname(self.path), sha256))
            except OSError:
                self.drop()
            self.file = None

    def drop(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
