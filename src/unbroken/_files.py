"""Local files written whole or not at all: ``atomic_write`` and ``sync_directory``.

``atomic_write(path, data)`` writes a temporary file beside ``path`` (same directory, so the
rename cannot cross filesystems), flushes and fsyncs it, renames it over ``path`` with
``os.replace`` (atomic on POSIX and Windows), then fsyncs the directory so that the rename
itself survives a power loss. A reader sees the old file or the new one, never a part; a
failure (an error of ``data``'s fill, a full disk, a kill) leaves the old file as it was, and
an error removes the temporary. Cost: one fsync of the file and one of its directory.

``os.fsync`` and ``os.replace`` are looked up when called, not bound at import, so that tests
that patch them see every call.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO

Fill = Callable[[BinaryIO], object]


def atomic_write(
    path: str | os.PathLike[str], data: bytes | Fill, temporary: str | None = None
) -> None:
    """Replace ``path`` with ``data``, whole or not at all (see the module).

    Args:
        path: The file to write; its directory must exist.
        data: The bytes, or a function that writes them to the binary file it is given
            (``lambda out: torch.save(state, out)``).
        temporary: The temporary's name in the same directory, for a caller that must
            recognise it (to leave it out of a listing, or to sweep those of killed
            processes); by default a fresh hidden name, ``.<name>.<random>.tmp``.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    if temporary is None:
        handle, part = tempfile.mkstemp(
            prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory
        )
        file = os.fdopen(handle, "wb")
    else:
        part = os.path.join(directory, temporary)
        file = open(part, "wb")  # closed by the `with` below, before the rename
    try:
        with file:
            if callable(data):
                data(file)
            else:
                file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(part, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
        raise
    sync_directory(directory)


def sync_directory(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries durable: the names created, renamed or removed in it.

    Args:
        path: The directory.
    """
    if os.name == "posix":  # elsewhere directories cannot be opened, and renames are journaled
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
