"""What ``Storage``'s composite operations do by default, built on its primitives: a checkpoint
committed by a rename (a disk's), and the local directories that DCP reads and writes, served
through a copy (any backend's). ``storage`` documents each; a backend overrides what it does
better (``LocalStorage`` lets DCP work in place; ``FsspecStorage`` commits by the manifest).

Costs: a copy through a temporary directory holds each file on the local disk once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, BinaryIO

from .files import Digest, join, parent, parents

if TYPE_CHECKING:
    from .storage import Storage

__all__ = ["CopiedDirectory"]


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
