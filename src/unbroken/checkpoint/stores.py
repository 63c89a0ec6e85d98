"""Which ``Storage`` serves a directory: ``LocalStorage`` for a path, ``FsspecStorage`` for a URL.

Any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...) goes through the one ``FsspecStorage``;
a ``file://`` URL is a local path. Costs: for a URL, one request that reaches its bucket.
"""

from __future__ import annotations

from typing import Any

from .fsspec_storage import REMOTE_TIMEOUT, FsspecStorage
from .local import LocalStorage
from .storage import Storage

__all__ = ["is_url", "storage_for"]


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
