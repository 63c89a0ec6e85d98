"""``FsspecStorage``: ``Storage`` on any fsspec filesystem (S3, GCS, Azure, MinIO, ``memory://``).

fsspec is the extension point for remote stores: any URL whose filesystem is installed goes
through this one class (what differs between protocols is in ``transfer``). A store has no
rename that moves a directory in one step, so a checkpoint commits differently from a local
disk (``LocalStorage``), with the same guarantee, "whole and verified, or not there":

- **Parts first, the manifest last.** Every rank uploads its files under the checkpoint's prefix
  (``.../step-000000123/``); rank 0 writes ``manifest.json`` once every part is there. The
  manifest is the commit (``stage`` gives the target itself, ``commit`` does nothing more): a
  prefix without one is not a checkpoint (``is_committed``), and ``layout.clean`` deletes what
  a killed writer left.
- **Replacing a checkpoint** of the same step first deletes its manifest (it is no longer in
  view), then its parts (``retire``); a writer killed in between leaves the previous
  checkpoints, never a mix. **Retention** deletes an old checkpoint the same way.
- **An upload that fails** mid-way is aborted (S3's multipart upload too: nothing of it stays
  billed or in view) and retried with backoff (``unbroken.retry``); a file is written from its
  start again, so ``fill`` must be callable more than once (the Checkpointer's are: they
  serialize a copy held in memory). A failed upload's file is closed in every case
  (``transfer.discard``): an S3 file left open would try to finish its upload when the
  interpreter exits, and never let it exit.
- **Reads** download a whole object once, with retries, and keep it for the next read only:
  ``load_latest`` hashes a file, then loads it, from one download. An object larger than
  ``transfer.DOWNLOAD_PART`` is downloaded in parts, ``fs.max_concurrency`` at a time. DCP's
  files are written by DCP on this machine and uploaded, and downloaded before DCP reads them
  (the ``Storage`` defaults).
- **A store that stops answering** fails an operation once it has gone ``timeout`` seconds
  without progress (``retry``: the client's timeouts, and a deadline on the whole operation,
  its retries included). The checkpoint's own code tells "could not read" (``RemoteUnavailable``:
  a resume fails, naming the store) from "read, and damaged" (skipped).
- **Local copies** of what this machine uploaded or downloaded serve later reads (``transfer``;
  ``cache=False``: none).

The filesystem is made lazily in each process (an fsspec filesystem made before a fork is not
used after it) with botocore's own retries off, as for ``StreamingDataset`` (``retry``: they
draw from the user's ``random``).


``storage_for`` picks the ``Storage`` of a directory: ``LocalStorage`` for a path,
``FsspecStorage`` for a URL. Any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...) goes
through the one ``FsspecStorage``; a ``file://`` URL is a local path. Costs: for a URL, one
request that reaches its bucket.
"""

from __future__ import annotations

import errno
import io
import json
import os
from collections.abc import Callable
from functools import partial
from typing import Any, BinaryIO, TypeVar, cast

from ..retry import Deadline, filesystem, retrying
from . import transfer
from .layout import MANIFEST
from .local import LocalStorage
from .storage import Digest, Entry, Stat, Storage, join
from .transfer import Copies, Hashing, discard, download

__all__ = ["FsspecStorage", "REMOTE_TIMEOUT", "is_url", "storage_for"]


T = TypeVar("T")

REMOTE_TIMEOUT = 60.0
"""Seconds an operation on a store may go without progress before it fails (the default)."""


class FsspecStorage(Storage):
    """``Storage`` on an fsspec filesystem, committing by the manifest (see the module).

    Args:
        url: The store's root, e.g. ``s3://bucket/runs/exp1`` or ``memory://runs/exp1``.
        storage_options: The fsspec options of its filesystem (``endpoint_url``, keys...).
        retries: How many times a failed operation is retried.
        backoff: The first wait between retries, in seconds; it doubles each time.
        cache: A directory for local copies of what is read, ``True`` for the default one,
            ``False`` for none.
        timeout: Seconds an operation may go without progress before it fails.
    """

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
        self.copies = Copies(self.url, cache)
        self.protocol = fsspec.core.split_protocol(self.url)[0] or "file"
        self.storage_options = dict(storage_options or {})
        self.retries, self.backoff = retries, backoff
        self._fs: Any = None
        self._pid = -1
        self._last: tuple[str, bytes] | None = None  # the last object read, whole
        # Each committed checkpoint's manifest version, as the last listing said (``committed_
        # among``), and the sha256s that version lists (``prune_cache``), read once per version.
        self._versions: dict[str, str] = {}
        self._listed: dict[str, tuple[str, set[str]]] = {}
        self.sent = self.received = 0  # bytes uploaded and downloaded by this process

    def __getstate__(self) -> dict[str, Any]:
        skip = ("_fs", "_pid", "_last", "_versions", "_listed", "sent", "received")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs, self._pid, self._last = None, -1, None
        self._versions, self._listed = {}, {}
        self.sent = self.received = 0

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
        url = path if "://" in path else f"{self.protocol}://{path}"
        return retrying(what, url, call, self.retries, self.backoff, missing, self.deadline)

    def check(self) -> None:
        """Check now that the store can be used: its bucket (a URL's first part) answers.

        Raises:
            ValueError: fsspec does not know the URL's protocol.
            RemoteUnavailable: the endpoint does not answer.
            FileNotFoundError: the bucket (or container) does not exist.
        """
        bucket = self.fs._strip_protocol(self.url).split("/")[0]
        if not bucket:  # a filesystem without buckets (memory://): made, nothing to reach
            return
        try:  # not exists(): s3fs says False for an endpoint that does not answer
            self._call("reach", bucket, lambda: self.fs.info(bucket))
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"cannot store checkpoints at {self.url}: the bucket {bucket!r} does not exist "
                "(or these credentials may not see it). Create it first, or check the URL and "
                "storage_options",
            ) from None

    def tried_once(self) -> FsspecStorage:
        once = object.__new__(type(self))
        once.__dict__.update(self.__dict__)  # the same client and deadline
        once.retries, once.backoff = 0, 0.0
        return once

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
        finally:  # not kept: s3fs would answer later reads of new objects "not found" from it
            self.fs.invalidate_cache(path)
        return [
            Entry(info["name"].rstrip("/").rpartition("/")[2], info["type"] == "directory")
            for info in found
        ]

    def expect(self, path: str, sha256: str, size: int) -> None:
        self.copies.expect(path, sha256, size)

    def open_read(self, path: str) -> BinaryIO:
        # A file is hashed, then loaded: the read right after a download, of the same object,
        # takes that download; any other read lets it go (nothing stays in memory, or stale).
        last, self._last = self._last, None
        if path in self.copies.known:
            return open(self.copies.known[path], "rb")
        if last is not None and last[0] == path:
            return io.BytesIO(last[1])
        data = self._call("download", path, lambda: download(self.fs, path))
        self.received += len(data)
        self._last = (path, data)
        self.copies.keep(data)
        return io.BytesIO(data)

    def size(self, path: str) -> int:
        self.fs.invalidate_cache()
        return int(self._call("look for", path, lambda: self.fs.size(path)))

    def is_link(self, path: str) -> bool:
        return False

    def free_space(self, path: str) -> int:
        return 1 << 62  # an object store does not fill up as a disk does

    def blocker(self, path: str) -> str | None:
        return None  # an object and a prefix of one name live side by side

    # Writing.
    def make_directory(self, path: str) -> None:
        pass  # a prefix exists once an object is under it

    def make_directories(self, path: str) -> None:
        pass

    def sync_directory(self, path: str) -> None:
        pass  # an object is durable once its upload returned

    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> Digest:
        self._fenced()
        self._last = None
        self.copies.known.pop(path, None)
        return self._call(
            "upload",
            path,
            lambda: self._upload(path, fill),
            missing="or its multipart upload was aborted meanwhile (by another job cleaning up "
            "this directory?): one job at a time may write it",
        )

    def _upload(self, path: str, fill: Callable[[BinaryIO], object]) -> Digest:
        out = self.fs.open(path, "wb")
        copy = self.copies.new()
        hashing = Hashing(out, copy)
        try:
            fill(cast(BinaryIO, hashing))
            self._fenced()  # again before the object appears: the fill may have taken long
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

    def prune_cache(self, kept: list[str]) -> None:
        """Delete the local copies that no kept checkpoint lists; the rest stay for a restart
        on this machine. The writer calls it once old checkpoints are dropped. Each kept
        checkpoint's manifest is read once by this process (a new manifest of it, again).

        Args:
            kept: The kept checkpoints' directories; their manifests' sha256s are kept.
        """
        if self.copies.directory is None or not os.path.isdir(self.copies.directory):
            return
        listed: set[str] = set()
        try:
            for path in kept:
                version = self._versions.get(path)
                known = self._listed.get(path)
                if version is None or known is None or known[0] != version:
                    manifest = join(path, MANIFEST)  # a version not read yet (or not listed)
                    data = self._call("download", manifest, partial(download, self.fs, manifest))
                    files = json.loads(data)["files"].values()
                    known = (version or "", {spec.get("sha256") for spec in files})
                    if version is not None:
                        self._listed[path] = known
                listed.update(known[1])
        except (OSError, ValueError, KeyError, AttributeError):
            return  # not known: nothing is deleted
        self._listed = {path: self._listed[path] for path in kept if path in self._listed}
        self.copies.prune(listed)

    def rename(self, source: str, target: str) -> None:
        # Not atomic here: the commit protocol never renames on a store; tools and
        # ``verdict.move_aside`` do. Each object is copied (in the store), then the source deleted,
        # its manifest first: a move cut short leaves the source whole or out of view. Object
        # by object: s3fs's recursive ``mv`` of a prefix fails on the prefix itself.
        self._fenced()
        self.fs.invalidate_cache()
        base = self.fs._strip_protocol(source).rstrip("/")
        names = self._call("list", source, lambda: self.fs.find(source))
        if not names:
            raise FileNotFoundError(errno.ENOENT, f"cannot rename {source}: nothing is there")
        for name in names:
            relative = name[len(base) :].lstrip("/")
            copy = join(target, relative) if relative else target
            self._call("copy", name, partial(self.fs.copy, name, copy))
        if any(name.endswith("/" + MANIFEST) for name in names):
            self.remove_tree(join(source, MANIFEST))
        self.remove_tree(source)

    def remove_tree(self, path: str) -> None:
        self._fenced()
        self._last = None
        try:
            self._call("delete", path, lambda: self.fs.rm(path, recursive=True))
        except (FileNotFoundError, OSError):
            pass  # as LocalStorage: what cannot be removed stays, and is cleaned up later

    def abort_uploads(self, prefix: str) -> None:
        """Abort the uploads that writers killed mid-upload left under ``prefix``, where the
        store keeps them (``transfer``). Call it when no upload of this job is under way.

        Args:
            prefix: The path under which uploads are aborted.
        """
        self._fenced()
        transfer.abort_uploads(self.protocol, self.fs, prefix, self._call)

    # The commit protocol: the manifest, written last, commits a checkpoint written in place.
    def stage(self, target: str, temporary: str) -> str:
        if self.exists(target):  # the same step saved again
            self.retire(target, temporary)
        return target

    def commit(self, staged: str, target: str, aside: str) -> None:
        assert staged == target, "a store writes a checkpoint in place (stage)"

    def abandon(self, staged: str) -> None:
        try:
            committed = self.is_committed(staged)
        except Exception:
            return  # not known: left for layout.clean
        if not committed:
            self.remove_tree(staged)

    def retire(self, path: str, aside: str) -> None:
        self.remove_tree(join(path, MANIFEST))  # out of view first
        self.remove_tree(path)

    def is_committed(self, path: str) -> bool:
        return self.exists(join(path, MANIFEST))

    def committed_among(self, paths: list[str]) -> list[str]:
        # One listing of every object under the directory (1,000 a request), never a request per
        # checkpoint; each manifest's version is kept for ``prune_cache``.
        if not paths:
            return []
        root = paths[0].rstrip("/").rpartition("/")[0]
        self.fs.invalidate_cache()
        try:
            found = self._call("list", root, lambda: self.fs.find(root, detail=True))
        except FileNotFoundError:
            found = {}
        finally:  # not kept: s3fs would answer later reads of new objects "not found" from it
            self.fs.invalidate_cache(root)
        versions = {
            name.rstrip("/").rpartition("/")[0]: json.dumps(info, sort_keys=True, default=str)
            for name, info in found.items()
            if name.rstrip("/").rpartition("/")[2] == MANIFEST
        }
        self._versions = {}  # only what this listing saw: none left of retired checkpoints
        for path in paths:
            version = versions.get(self.fs._strip_protocol(path).rstrip("/"))
            if version is not None:
                self._versions[path] = version
        return [path for path in paths if path in self._versions]

    # Whole small objects.
    def create(self, path: str, data: bytes) -> None:
        self._call("create", path, lambda: self.fs.pipe_file(path, data, mode="create"))

    def read_bytes(self, path: str) -> bytes:
        return bytes(self._call("read", path, lambda: self.fs.cat_file(path)))

    def overwrite(self, path: str, data: bytes) -> None:
        self._call("write", path, lambda: self.fs.pipe_file(path, data))

    def delete(self, path: str) -> None:
        self._call("delete", path, lambda: self.fs.rm_file(path))

    def stat(self, path: str) -> Stat:
        def look() -> Stat:
            self.fs.invalidate_cache(path)  # the store's answer, not a listing's
            info = dict(self.fs.info(path))
            from fsspec.utils import tokenize  # here: `import unbroken` imports no fsspec

            return Stat(transfer.modified(self.protocol, self.fs, path, info), tokenize(info))

        return self._call("look at", path, look)

    def tree_size(self, path: str) -> int:
        return int(self._call("measure", path, lambda: self.fs.du(path)))


def is_url(directory: str) -> bool:
    """Whether ``directory`` names a store other than the local filesystem.

    Args:
        directory: A path or a URL.

    Returns:
        True for a URL of any protocol but ``file://``.
    """
    import fsspec

    protocol = fsspec.core.split_protocol(directory)[0]
    return protocol not in (None, "file", "local")


def storage_for(
    directory: str,
    storage_options: dict[str, Any] | None = None,
    cache: bool = True,
    timeout: float = REMOTE_TIMEOUT,
) -> tuple[Storage, str]:
    """The ``Storage`` of ``directory`` and the path it takes there.

    Args:
        directory: A local path (or ``file://`` URL), or a URL of any fsspec protocol.
        storage_options: The fsspec options of a URL's filesystem.
        cache: Whether a URL's storage keeps local copies (``unbroken verify``: no, it checks
            the store itself).
        timeout: Seconds an operation on a store may go without progress.

    Returns:
        ``(LocalStorage(), path)`` for a path; ``(FsspecStorage, url)`` for a URL, checked at
        once, before anything is trained.

    Raises:
        ValueError: ``storage_options`` for a local path; a protocol fsspec does not know.
    """
    if not is_url(directory):
        if storage_options:
            raise ValueError(
                f"storage_options are for a URL such as 's3://bucket/run', and {directory!r} is "
                "a local path: leave them out"
            )
        return LocalStorage(), directory.removeprefix("file://")
    storage = FsspecStorage(directory, storage_options, cache=cache, timeout=timeout)
    storage.check()
    return storage, directory.rstrip("/")
