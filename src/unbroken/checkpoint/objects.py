"""``Storage`` in object storage (S3, GCS, Azure, MinIO, ...) through fsspec.

An object store has no directories and no rename, so a checkpoint commits differently from a
local disk (``LocalStorage``), with the same guarantee, "whole and verified, or not there":

- **Parts first, the manifest last.** Every rank uploads its files under the checkpoint's prefix
  (``.../step-000000123/``); rank 0 writes ``manifest.json`` once every part is there. The
  manifest is the commit: a prefix without one is not a checkpoint (``layout.committed`` lists
  only prefixes that hold one), and ``layout.clean`` deletes what a killed writer left.
- **Replacing a checkpoint** of the same step first deletes its manifest (it is no longer in
  view), then its parts; a writer killed in between leaves the previous checkpoints, never a mix.
- **Retention** deletes an old checkpoint's manifest before its parts, for the same reason.
- **An upload that fails** mid-way is aborted (S3's multipart upload too: nothing of it stays
  billed or in view) and retried with backoff (``unbroken.retry``); a file is written from its
  start again, so ``fill`` must be callable more than once (the Checkpointer's are: they
  serialize a copy held in memory).
- **Reads** download a whole object once, with retries, and keep it for the next read only:
  ``load_latest`` hashes a file, then loads it, from one download. An object larger than
  ``transfer.DOWNLOAD_PART`` is downloaded in parts, ``fs.max_concurrency`` at a time.
- **A store that stops answering** fails an operation once it has gone ``timeout`` seconds
  without progress (``retry``: the client's connect and read timeouts, and a deadline on the
  whole operation, its retries included; an upload progresses with each part, a download with
  each batch of parts). The checkpoint's own code tells "could not read" (``RemoteUnavailable``:
  a resume fails, naming the store) from "read, and damaged" (skipped): an unreachable store is
  never taken for a corrupt checkpoint.
- **A failed upload's file** is closed in every case, its multipart upload aborted where the
  store still answers (else ``layout.clean`` aborts it later): an S3 file left open would try
  to finish its upload when the interpreter exits, and never let it exit.
- **A local copy** of every file this machine uploaded or downloaded is kept in a cache
  directory (``cache``; by default ``$XDG_CACHE_HOME/unbroken/checkpoints``, else
  ``~/.cache/...``, one folder per URL), named by its sha256. When a checkpoint is read, a file
  whose copy is there and hashes to what the manifest says is read from the disk instead of
  downloaded (``expect``); a copy that does not match is deleted and the file downloaded. A
  job restarted on the same machine downloads only the manifests; a new machine has no copies.
  Each save prunes the copies no kept checkpoint lists. ``cache=False``: none.

The filesystem is made lazily in each process (an fsspec filesystem made before a fork is not
used after it) with botocore's own retries off, as for ``StreamingDataset`` (``retry``: they
draw from the user's ``random``).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
from collections.abc import Callable
from functools import partial
from typing import Any, BinaryIO, TypeVar, cast

from ..retry import Deadline, filesystem, retrying
from .manifest import MANIFEST
from .storage import Digest, Entry, LocalStorage, Storage, join
from .transfer import Hashing, LocalCopy, cache_directory, discard, download, file_sha256

T = TypeVar("T")

REMOTE_TIMEOUT = 60.0
"""Seconds an operation on a store may go without progress before it fails (the default)."""


def is_url(directory: str) -> bool:
    """Whether ``directory`` names a store other than the local filesystem."""
    import fsspec

    protocol = fsspec.core.split_protocol(directory)[0]
    return protocol not in (None, "file", "local")


def storage_for(
    directory: str,
    storage_options: dict[str, Any] | None = None,
    cache: bool = True,
    timeout: float = REMOTE_TIMEOUT,
) -> tuple[Storage, str]:
    """The ``Storage`` of ``directory`` and the path it takes: ``LocalStorage`` for a path (or
    a ``file://`` URL, as a path), else an ``ObjectStorage`` for the URL, checked at once (an
    unknown protocol, an unreachable endpoint or a missing bucket raise here, before anything
    is trained); ``cache=False``: no local copies (``unbroken verify`` checks the store itself);
    ``timeout``: seconds an operation on the store may go without progress."""
    if not is_url(directory):
        if storage_options:
            raise ValueError(
                f"storage_options are for a URL such as 's3://bucket/run', and {directory!r} is "
                "a local path: leave them out"
            )
        return LocalStorage(), directory.removeprefix("file://")
    storage = ObjectStorage(directory, storage_options, cache=cache, timeout=timeout)
    storage.check()
    return storage, directory.rstrip("/")


class ObjectStorage:
    """``Storage`` on an fsspec filesystem without rename (see the module).

    Args:
        url: The store's root, e.g. ``s3://bucket/runs/exp1``.
        storage_options: The fsspec options of its filesystem (``endpoint_url``, keys...).
        retries: How many times a failed operation is retried.
        backoff: The first wait between retries, in seconds; it doubles each time.
        cache: A directory for local copies of what is read, ``True`` for the default one,
            ``False`` for none.
        timeout: Seconds an operation may go without progress before it fails.
    """

    renames = False
    """A checkpoint commits by its manifest, written last (``layout``)."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retries: int = 4,
        backoff: float = 0.5,
        cache: str | bool = True,
        timeout: float = REMOTE_TIMEOUT,
    ) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.deadline = Deadline(timeout)
        self.cache = cache_directory(self.url, cache)
        self._known: dict[str, str] = {}  # path -> its verified local copy (expect)
        self.protocol = fsspec.core.split_protocol(self.url)[0] or "file"
        self.storage_options = dict(storage_options or {})
        self.retries, self.backoff = retries, backoff
        self._fs: Any = None
        self._pid = -1
        self._last: tuple[str, bytes] | None = None  # the last object read, whole
        self.sent = self.received = 0  # bytes uploaded and downloaded by this process

    def __getstate__(self) -> dict[str, Any]:
        skip = ("_fs", "_pid", "_last", "sent", "received", "_known")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs, self._pid, self._last = None, -1, None
        self.sent = self.received = 0
        self._known = {}

    @property
    def fs(self) -> Any:
        """The fsspec filesystem, made again in a forked process (``ValueError`` if unknown)."""
        if self._fs is None or self._pid != os.getpid():
            try:
                self._fs = filesystem(self.url, self.storage_options, self.deadline.seconds)[0]
            except (ValueError, ImportError) as error:
                raise ValueError(
                    f"cannot store checkpoints at {self.url}: fsspec does not know the protocol "
                    f"{self.protocol!r} here ({error}). Use a local path, or a URL whose "
                    "filesystem is installed (s3:// needs s3fs, gs:// gcsfs, az:// adlfs)"
                ) from None
            self._pid = os.getpid()
        return self._fs

    def _call(self, what: str, path: str, call: Callable[[], T], missing: str = "") -> T:
        """``call()`` as one operation on ``path`` (``retry.retrying``: its retries, under the
        deadline); ``what`` (a verb) names it in errors."""
        return retrying(
            what, self._url(path), call, self.retries, self.backoff, missing, self.deadline
        )

    def _url(self, path: str) -> str:
        return path if "://" in path else f"{self.protocol}://{path}"

    def check(self) -> None:
        """Check now that the store can be used.

        Raises:
            ValueError: fsspec does not know the URL's protocol.
            RemoteUnavailable: the endpoint does not answer.
            FileNotFoundError: the bucket (or container) does not exist.
        """
        bucket = self.fs._strip_protocol(self.url).split("/")[0]
        try:  # not exists(): s3fs says False for an endpoint that does not answer
            self._call("reach", bucket, lambda: self.fs.info(bucket))
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"cannot store checkpoints at {self.url}: the bucket {bucket!r} does not exist "
                "(or these credentials may not see it). Create it first, or check the URL and "
                "storage_options",
            ) from None

    # Reading.
    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache()
        return bool(self._call("look for", path, lambda: self.fs.exists(path)))

    def is_directory(self, path: str) -> bool:
        self.fs.invalidate_cache()
        return bool(self._call("look for", path, lambda: self.fs.isdir(path)))

    def list_directory(self, path: str) -> list[Entry]:
        self.fs.invalidate_cache()
        try:
            found = self._call("list", path, lambda: self.fs.ls(path, detail=True))
        except FileNotFoundError:
            return []
        return [
            Entry(info["name"].rstrip("/").rpartition("/")[2], info["type"] == "directory")
            for info in found
        ]

    def expect(self, path: str, sha256: str, size: int) -> None:
        """Say what a file holds, from a manifest, so a cached copy can serve its reads.

        If the cache holds that content, checked by its hash, later reads of ``path`` take it
        from the local disk.

        Args:
            path: The file in the store.
            sha256: Its content's sha256 (hex), as the manifest lists it.
            size: Its size in bytes.
        """
        self._known.pop(path, None)  # a copy found before may be gone (pruned) or changed
        if self.cache is None:
            return
        local = os.path.join(self.cache, sha256)
        try:
            if os.path.getsize(local) == size and file_sha256(local) == sha256:
                self._known[path] = local
                return
            os.unlink(local)  # not what its name says: downloaded again
        except OSError:
            pass

    def open_read(self, path: str) -> BinaryIO:
        # A file is hashed, then loaded: the read right after a download, of the same object,
        # takes that download; any other read lets it go (nothing stays in memory, or stale).
        last, self._last = self._last, None
        if path in self._known:
            return open(self._known[path], "rb")
        if last is not None and last[0] == path:
            return io.BytesIO(last[1])
        data = self._call("download", path, lambda: download(self.fs, path))
        self.received += len(data)
        self._last = (path, data)
        self._keep_copy(data)
        return io.BytesIO(data)

    def size(self, path: str) -> int:
        self.fs.invalidate_cache()
        return int(self._call("look for", path, lambda: self.fs.size(path)))

    def is_link(self, path: str) -> bool:
        return False

    def free_space(self, path: str) -> int:
        return 1 << 62  # an object store does not fill up as a disk does

    # Writing.
    def make_directory(self, path: str) -> None:
        pass  # a prefix exists once an object is under it

    def make_directories(self, path: str) -> None:
        pass

    def sync_directory(self, path: str) -> None:
        pass  # an object is durable once its upload returned

    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> Digest:
        self.fenced()
        self._last = None
        self._known.pop(path, None)
        return self._call(
            "upload",
            path,
            lambda: self._upload(path, fill),
            missing="or its multipart upload was aborted meanwhile (by another job cleaning up "
            "this directory?): one job at a time may write it",
        )

    def _upload(self, path: str, fill: Callable[[BinaryIO], object]) -> Digest:
        out = self.fs.open(path, "wb")
        copy = LocalCopy(self.cache)
        hashing = Hashing(out, copy)
        try:
            fill(cast(BinaryIO, hashing))
            self.fenced()  # again before the object appears: the fill may have taken long
        except BaseException as error:
            discard(out)
            copy.drop()
            if hashing.error is not None and hashing.error is not error:
                raise hashing.error from None  # the cause; torch.save's own error is a symptom
            raise
        try:
            out.close()  # the upload's end: the object appears whole
        except BaseException:
            discard(out)  # its last part or its completion failed: abort what is left
            copy.drop()
            raise
        self.sent += hashing.size
        digest = Digest(hashing.sha256.hexdigest(), hashing.size)
        copy.keep(digest.sha256)
        return digest

    def _keep_copy(self, data: bytes) -> None:
        if self.cache is not None and data:
            copy = LocalCopy(self.cache)
            copy.write(data)
            copy.keep(hashlib.sha256(data).hexdigest())

    def prune_cache(self, kept: list[str]) -> None:
        """Delete the cached copies that no kept checkpoint lists.

        The rest stay for a restart on this machine. The writer calls it once old checkpoints
        are dropped.

        Args:
            kept: The kept checkpoints' directories; their manifests' sha256s are kept.
        """
        if self.cache is None or not os.path.isdir(self.cache):
            return
        listed: set[str] = set()
        try:
            for path in kept:
                manifest = join(path, MANIFEST)
                data = self._call("download", manifest, partial(download, self.fs, manifest))
                listed.update(spec.get("sha256") for spec in json.loads(data)["files"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return  # not known: nothing is deleted
        for name in os.listdir(self.cache):
            if name not in listed:
                try:
                    os.unlink(os.path.join(self.cache, name))
                except OSError:
                    pass

    def rename(self, source: str, target: str) -> None:
        # Not atomic here (a copy, then a delete): the Checkpointer does not rename on a store
        # that cannot (``renames``); this is for tools.
        self.fenced()
        self._call("rename", source, lambda: self.fs.mv(source, target, recursive=True))

    def remove_tree(self, path: str) -> None:
        self.fenced()
        self._last = None
        try:
            self._call("delete", path, lambda: self.fs.rm(path, recursive=True))
        except (FileNotFoundError, OSError):
            pass  # as LocalStorage: what cannot be removed stays, and is cleaned up later

    def abort_uploads(self, prefix: str) -> None:
        """Abort the multipart uploads left by writers killed mid-upload.

        S3 keeps and bills such uploads, unseen, until they are aborted. This works only where
        the filesystem can list them (s3fs). Call it when no upload of this job is under way.

        Args:
            prefix: The path under which uploads are aborted.
        """
        self.fenced()
        lister = getattr(self.fs, "list_multipart_uploads", None)
        if lister is None:
            return
        bucket, _, key = self.fs._strip_protocol(prefix).partition("/")
        try:
            uploads = self._call("list the uploads in", prefix, lambda: lister(bucket))
        except Exception:
            return  # a store or a policy without the listing: the uploads stay, as before
        for upload in uploads:
            if upload.get("Key", "").startswith(key.rstrip("/") + "/"):
                try:
                    abort = partial(self.fs.abort_mpu, bucket, upload["Key"], upload["UploadId"])
                    self._call("abort an upload to", f"{bucket}/{upload['Key']}", abort)
                except Exception:
                    pass

    def commit(self, staged: str, target: str, aside: str) -> None:
        assert staged == target, "an object store writes a checkpoint in place (layout.stage)"
        # The manifest, written last (by the Writing), was the commit.

    fence: Callable[[], None] | None = None
    """Called before every change (the Trainer's run directory: its lease's ``fence``)."""

    def fenced(self) -> None:
        """Raise if this job may change the store no more (``fence``: ``DirectoryInUse``)."""
        if self.fence is not None:
            self.fence()
