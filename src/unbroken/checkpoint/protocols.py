"""What differs between fsspec's filesystems, in one place, keyed by the URL's protocol.

``FsspecStorage`` talks to every store through fsspec's common interface; only these differ:

- **The store's time of an object** (``modified``): the field of ``fs.info`` that holds it
  (S3's ``LastModified``, GCS's ``updated``, Azure's ``last_modified``, the memory
  filesystem's ``created``, a local file's ``mtime``); elsewhere ``fs.modified``, one more
  request.
- **Uploads left by killed writers** (``abort_uploads``): S3 keeps and bills a multipart upload
  that was never completed, unseen, until it is aborted; s3fs can list and abort them. Other
  stores have nothing to abort.

Reaching the store first (the bucket, or a URL's first part: ``FsspecStorage.check``) and
botocore's retries (``retry.drawing_nothing``) are the rest of what the protocol decides.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from typing import Any, TypeVar

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
