"""The bytes of one object on their way to and from a store, for ``FsspecStorage``.

- ``download``: a whole object, in one ranged request if it is small, else in parts of
  ``DOWNLOAD_PART`` bytes, ``fs.max_concurrency`` in flight at a time (as s3fs itself does);
  each batch of parts is progress for the operation's deadline (``retry.progressed``).
- ``Hashing``: the write-only file a checkpoint is serialized into: it hashes what passes on its
  way to the store and to the local copy, hands the store pieces of at most a part (torch.save
  writes a whole tensor at once: each part uploaded is progress, and the client buffers one part,
  not a tensor), and keeps the store's error, which torch.save would hide behind its own.
- ``discard``: a failed upload aborted and its file marked closed in every case. An fsspec file
  left open tries to finish its upload when it is collected, at the interpreter's exit too; if
  the store is gone, the process never exits.

Costs: a download holds the object in memory once (the parts, then the joined bytes: twice, for
the moment of the join); an upload's pieces are views, not copies.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..retry import progressed
from .copies import LocalCopy

DOWNLOAD_PART = 16 << 20
"""Bytes per ranged request of a large download."""


def download(fs: Any, path: str) -> bytes:
    """Object ``path`` of filesystem ``fs``, whole (see the module)."""
    size = int(fs.info(path, refresh=True)["size"])  # not a listing's: it may be stale
    if size <= DOWNLOAD_PART:
        return bytes(fs.cat_file(path, start=0, end=size)) if size else b""
    starts = list(range(0, size, DOWNLOAD_PART))
    batch = max(1, int(getattr(fs, "max_concurrency", 1) or 1))
    parts: list[bytes] = []
    for first in range(0, len(starts), batch):
        chosen = starts[first : first + batch]
        ends = [min(start + DOWNLOAD_PART, size) for start in chosen]
        for part in fs.cat_ranges([path] * len(chosen), chosen, ends):
            if isinstance(part, BaseException):  # fsspec returns a failed range's error
                raise part
            parts.append(part)
        progressed()
    data = b"".join(parts)
    if len(data) != size:  # the object changed between the requests: read it again
        raise ConnectionError(f"{path} changed while it was downloaded")
    return data


def discard(out: Any) -> None:
    """Abort the upload of ``out`` (an fsspec file being written) and mark it closed, whatever
    happens (see the module). An abort that fails (the store gone, or the upload aborted
    already) leaves what it could not abort to the next save's clean-up (``abort_uploads``)."""
    try:
        out.discard()  # aborts a multipart upload: no part of it stays
    except Exception:
        pass
    finally:
        out.closed = True  # its close (at garbage collection) must not upload


class Hashing:
    """A write-only file that hashes what passes through it on its way to the store (and into
    the local copy); see the module."""

    def __init__(self, file: Any, copy: LocalCopy) -> None:
        self.file, self.copy, self.sha256, self.size = file, copy, hashlib.sha256(), 0
        self.error: BaseException | None = None  # the store's, which torch.save hides

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        step = max(1, int(getattr(self.file, "blocksize", 0) or len(view) or 1))
        try:
            for start in range(0, len(view), step):
                self.file.write(view[start : start + step])
                progressed()
        except BaseException as error:
            self.error = self.error or error
            raise
        self.copy.write(data)
        self.sha256.update(data)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        pass  # the upload flushes by whole parts; a flush of a small one would fail on S3
