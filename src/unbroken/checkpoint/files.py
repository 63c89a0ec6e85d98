"""The values that ``Storage`` operations take and give, and paths as strings.

``Digest`` (what a write wrote), ``Entry`` (a directory's entry), ``Stat`` (an object's time by
the store's clock, and its version);
``join``, ``parent``, ``parents`` and ``basename`` work alike on local paths and URLs (always
``/``); ``sha256`` reads a file through a storage.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .storage import Storage

__all__ = ["Digest", "Entry", "Stat", "basename", "join", "parent", "parents", "sha256"]


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
