"""What ``FsspecStorage`` does below its operations: the bytes of one object on their way to and
from a store, the local copies it keeps of them, and what differs between fsspec's filesystems.

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

**Local copies** (``Copies``) of what this machine uploaded or downloaded. A copy is a file in
the cache directory (by default ``$XDG_CACHE_HOME/unbroken/checkpoints``, else
``~/.cache/...``, one folder per URL) named by its content's sha256. When a checkpoint is read,
a file whose copy is there and hashes to what the manifest says is read from the disk instead
of downloaded (``Copies.expect``); a copy that does not match is deleted and the file
downloaded. A job restarted on the same machine downloads only the manifests; a new machine has
no copies. Each save prunes the copies no kept checkpoint lists. Best effort throughout: a full
or read-only disk only means no copy. A copy that cannot be written (ENOSPC, EDQUOT, EROFS...)
is dropped, its file closed and deleted whatever the disk says, and the save or read goes on:
the checkpoint is in the store all the same. The ``unbroken`` logger says so at WARNING, once
until a copy as large is kept again: the directory, the disk's error, and for a full disk how
much the copy needed and how much is free. (A log record, not a ``warnings`` warning: a filter
that turns warnings into errors must not fail the upload that the copy rides along with.)

**What differs between fsspec's filesystems**, keyed by the URL's protocol; ``FsspecStorage``
talks to every store through fsspec's common interface, and only these differ:

- **The store's time of an object** (``modified``): the field of ``fs.info`` that holds it
  (S3's ``LastModified``, GCS's ``updated``, Azure's ``last_modified``, the memory
  filesystem's ``created``, a local file's ``mtime``); elsewhere ``fs.modified``, one more
  request.
- **Uploads left by killed writers** (``abort_uploads``): S3 keeps and bills a multipart upload
  that was never completed, unseen, until it is aborted; s3fs can list and abort them. Other
  stores have nothing to abort.

Reaching the store first (the bucket, or a URL's first part: ``FsspecStorage.check``) and
botocore's retries (``retry.drawing_nothing``) are the rest of what the protocol decides.

Costs: a download holds the object in memory once (the parts, then the joined bytes: twice, for
the moment of the join); an upload's pieces are views, not copies. A copy is written as the
bytes pass (no second read); ``expect`` hashes a copy once per read of a checkpoint (~1 GB/s).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from typing import Any, TypeVar

from .._log import logger
from .._units import human
from ..retry import progressed

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


T = TypeVar("T")
Call = Callable[[str, str, Callable[[], Any]], Any]  # (what, path, call): retried, as FsspecStorage

_MODIFIED = {
    "s3": "LastModified",
    "s3a": "LastModified",
    "gs": "updated",
    "gcs": "updated",
    "az": "last_modified",
    "abfs": "last_modified",
    "abfss": "last_modified",
    "memory": "created",
    "file": "mtime",
    "local": "mtime",
}
_MULTIPART = ("s3", "s3a")


def modified(protocol: str, fs: Any, path: str, info: dict[str, Any]) -> datetime:
    """The store's time of the last write of ``path``, in UTC, from its ``info`` (see the
    module); ``fs.modified`` where the protocol's field is not known or not there."""
    value = info.get(_MODIFIED.get(protocol, ""))
    if value is None:
        value = fs.modified(path)
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, timezone.utc)
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if not isinstance(value, datetime):
        raise ValueError(f"{protocol}:// gives no time of {path} (its info: {value!r})")
    return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)


def abort_uploads(protocol: str, fs: Any, prefix: str, call: Call) -> None:
    """Abort the multipart uploads under ``prefix`` that killed writers left, where the store
    keeps them (S3); each request through ``call``. Best effort: a store or a policy without
    the listing leaves them, as before."""
    if protocol not in _MULTIPART:
        return
    bucket, _, key = fs._strip_protocol(prefix).partition("/")
    try:
        uploads = call("list the uploads in", prefix, partial(fs.list_multipart_uploads, bucket))
    except Exception:
        return
    for upload in uploads:
        if upload.get("Key", "").startswith(key.rstrip("/") + "/"):
            try:
                abort = partial(fs.abort_mpu, bucket, upload["Key"], upload["UploadId"])
                call("abort an upload to", f"{bucket}/{upload['Key']}", abort)
            except Exception:
                pass
