"""Where a sharded dataset lives: any fsspec URL (``s3://``, ``gs://``, ``file://``, a path).

``Remote`` holds the URL and the fsspec ``storage_options`` (plain data, so a dataset pickles
to its workers) and opens the filesystem lazily, once per process: an fsspec filesystem made
before a fork is not used after it (s3fs runs an event loop on a thread, which a forked child
does not have). Every call goes through ``unbroken.retry.retrying``: a bounded number of
attempts with exponential backoff, then ``RemoteUnavailable`` naming the URL and the last
error; a missing object is not retried. The retry policy and what it does to keep the global
random generators the user's live in ``unbroken.retry``, shared with the checkpoints:
botocore's jittered retries are off for S3, and the reading thread's ``random`` state is put
back after each call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from .._checks import is_int
from ..retry import filesystem, retrying

T = TypeVar("T")


class Remote:
    """A directory of objects behind an fsspec URL, with bounded retries."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retries: int = 3,
        backoff: float = 0.5,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(
                f"url must be a non-empty string such as 's3://bucket/ds', got {url!r}"
            )
        if not is_int(retries) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.retries, self.backoff = retries, backoff
        self._fs: Any = None
        self._root = ""
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_fs", "_root", "_pid")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs, self._root, self._pid = None, "", -1

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            self._fs, self._root = filesystem(self.url, self.storage_options)
            self._pid = os.getpid()
        return self._fs

    def path(self, name: str) -> str:
        """The filesystem path of ``name`` (relative to the URL)."""
        self.fs  # noqa: B018 - sets _root
        return f"{self._root}/{name}" if name else self._root

    def where(self, name: str) -> str:
        """``name`` as a URL, for messages."""
        return f"{self.url}/{name}"

    def retrying(self, what: str, name: str, call: Callable[[], T]) -> T:
        """``call()``, retried on errors of the connection (not on a missing object)."""
        return retrying(
            what,
            self.where(name),
            call,
            self.retries,
            self.backoff,
            missing="or that the dataset was not deleted or rewritten since its index was read "
            "(refresh_index=True reads the index again)",
        )

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of object ``name`` (a byte range if given; negative ``start`` counts from
        the end)."""
        path = self.path(name)
        return self.retrying("read", name, lambda: self.fs.cat_file(path, start=start, end=end))

    def download(self, name: str, local: str) -> None:
        """Copy object ``name`` to the local file ``local`` (overwritten)."""
        path = self.path(name)
        self.retrying("download", name, lambda: self.fs.get_file(path, local))

    def write(self, name: str, data: bytes) -> None:
        path = self.path(name)

        def put() -> None:
            with self.fs.open(path, "wb") as out:
                out.write(data)

        self.retrying("write", name, put)

    def upload(self, local: str, name: str) -> None:
        path = self.path(name)
        self.retrying("upload", name, lambda: self.fs.put_file(local, path))

    def list(self, suffix: str) -> list[tuple[str, int]]:
        """``(name relative to the URL, size)`` of every object below it ending in ``suffix``,
        sorted by name."""
        root = self.path("")
        found = self.retrying("list", "", lambda: self.fs.find(root, detail=True))
        out = []
        for path, info in found.items():
            if info.get("type", "file") == "file" and path.endswith(suffix):
                out.append((path[len(root) :].lstrip("/"), int(info["size"])))
        return sorted(out)

    def makedirs(self) -> None:
        root = self.path("")
        self.retrying("create", "", lambda: self.fs.makedirs(root, exist_ok=True))
