"""Remote I/O's retry policy, owned once, below the checkpoints and the streaming datasets: which
errors are worth another attempt (a connection that failed or timed out; not credentials,
paths or a full local disk), how many and how long apart (``retrying``: bounded attempts,
exponential backoff, then ``RemoteUnavailable`` naming the URL and the last error; a missing
object is not retried, ``FileNotFoundError`` says so at once).

**The global random generators are the user's.** The loader seeds them for each batch, and the
batch's samples draw from them in turn, so a library that draws from them while a sample is
fetched shifts that batch's augmentation: botocore does, for the jitter of its retries (its
``random.random()``), so a transient S3 fault used to change the weights. So:

- For S3, botocore makes one attempt per request (``config_kwargs={"retries":
  {"total_max_attempts": 1}}``, unless ``storage_options`` sets botocore's retries) and
  transient errors are retried by s3fs and by ``retrying`` here, with backoffs that draw nothing.
  That covers the prefetcher's download threads, which run beside the training loop.
- A call made by the thread that reads samples (a worker's, or the training process's main
  thread) puts Python's ``random`` state back as it was before the call (~10 us a call), so a
  client of another protocol drawing for its own retries does not shift the sample's draws
  either. (A client drawing from it on a prefetch thread can, for protocols other than S3.)
"""

from __future__ import annotations

import errno
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import RemoteUnavailable

T = TypeVar("T")


# Errors of the storage's client libraries that say the connection failed; s3fs lets some
# through unwrapped (botocore's EndpointConnectionError is no OSError).
_CLIENT_PACKAGES = {"botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google"}


# Errors of this machine, not of the connection: a full or read-only disk, paths, permissions.
_LOCAL_ERRNOS = {
    errno.ENOSPC,
    errno.EROFS,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EISDIR,
    errno.ENOTDIR,
}


def _transient(error: Exception) -> bool:
    """Whether a failed request may succeed if tried again: a connection that failed or timed
    out, not credentials, paths or a full local disk."""
    if isinstance(error, OSError) and error.errno in _LOCAL_ERRNOS:
        return False
    if isinstance(
        error, (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
    ):  # FileExistsError: a conditional create refused, an answer
        return False
    if isinstance(error, (OSError, TimeoutError)):
        return True
    name = type(error).__name__
    if "Credential" in name or "ParamValidation" in name or "Forbidden" in name:
        return False  # botocore's NoCredentialsError, ParamValidationError; google's 403
    return type(error).__module__.partition(".")[0] in _CLIENT_PACKAGES


def retrying(
    what: str, where: str, call: Callable[[], T], retries: int, backoff: float, missing: str = ""
) -> T:
    """``call()``, retried ``retries`` times on errors of the connection, ``backoff * 2**k``
    seconds apart; ``what`` (a verb) and ``where`` (a URL) name it in errors, ``missing`` adds
    to the advice when the object does not exist."""
    for attempt in range(retries + 1):
        try:
            return _keeping_random(call)
        except FileNotFoundError as error:  # not retried; said with what was asked for
            raise FileNotFoundError(
                f"could not {what} {where}: it does not exist ({error}). Check the URL (and "
                f"the bucket){', ' + missing if missing else ''}"
            ) from error
        except Exception as error:
            if not _transient(error):
                raise
            if attempt == retries:
                raise RemoteUnavailable(
                    f"could not {what} {where} after {attempt + 1} attempt(s): "
                    f"{type(error).__name__}: {error}. Check the URL, the endpoint and the "
                    "credentials in storage_options, and that the storage is reachable."
                ) from error
            time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")


def filesystem(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """``(fsspec filesystem, path)`` of ``url``: a filesystem of this process's own
    (``skip_instance_cache``: fsspec caches them per process, and one inherited through a fork
    would use its parent's event loop), with botocore's jittered retries off
    (``drawing_nothing``). Raises ``ValueError`` or ``ImportError`` for a protocol fsspec does
    not know here."""
    import fsspec

    options = drawing_nothing(url, storage_options)
    fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    return fs, path


def drawing_nothing(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` with botocore's retries (whose jitter draws from ``random``) down to
    one attempt for an S3 URL, unless the options set them (see the module)."""
    import fsspec

    protocol = fsspec.core.split_protocol(url)[0]
    if protocol not in ("s3", "s3a"):
        return storage_options
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    return {**storage_options, "config_kwargs": config}


def _keeping_random(call: Callable[[], T]) -> T:
    """``call()``; on the thread that reads samples, with Python's ``random`` state put back
    after it (see the module). Not on other threads: their draws would race the reader's."""
    if threading.current_thread() is not threading.main_thread():
        return call()
    state = random.getstate()
    try:
        return call()
    finally:
        random.setstate(state)
