"""Where a run's files live: a local directory, or a URL in object storage.

A local run directory holds ``checkpoints/``, ``metrics.csv``, ``tensorboard/`` and the lock
file, written in place. A run directory at a URL (``s3://bucket/runs/exp1``) holds the same
names, so that a job restarted on another machine, with an empty disk, finds everything:

- **checkpoints** go through its ``Storage``, an ``FsspecStorage`` (any fsspec URL: the
  manifest, written last, commits a checkpoint);
- **the lock** is a lease object with a heartbeat (``lease``);
- **metrics.csv** cannot be appended to in an object store. It is written to a local working
  copy (in a temporary directory) and the copy is uploaded whole each time a checkpoint records
  its size, and when the run ends; a resumed run downloads it, and the checkpoint's size cuts
  it back (``CSVLog``), so it reads back byte for byte as an uninterrupted run's. One upload
  of the log per checkpoint: a log of 1 MB costs about as much as a small checkpoint file.
- **TensorBoard** events are written locally and this process's event files uploaded at each
  checkpoint and at the end; the files of earlier processes stay where they are, and the
  resumed writer purges their events after the checkpoint as it does on a local disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..checkpoint.fsspec_storage import REMOTE_TIMEOUT, is_url, storage_for
from ..checkpoint.storage import Storage, join
from .agreement import Agreement
from .lease import Lease
from .lock import DirectoryLock, Lock, held_by_every_rank, not_writable

CHECKPOINTS, METRICS, TENSORBOARD = "checkpoints", "metrics.csv", "tensorboard"


class RunDirectory:
    """A run directory, local or in object storage (see the module)."""

    def __init__(
        self, directory: str | os.PathLike, storage_options: dict[str, Any] | None = None
    ) -> None:
        text = os.fspath(directory)
        self.remote = is_url(text)
        if not self.remote and storage_options:
            raise ValueError(
                f"storage_options are for a run directory at a URL such as "
                f"'s3://bucket/runs/exp1', and {text!r} is a local path: leave them out"
            )
        self.location = text.rstrip("/") if self.remote else text.removeprefix("file://")
        self.storage_options = dict(storage_options or {})
        self.storage: Storage | None = None
        self.local = Path(self.location) if not self.remote else Path()  # set by open()
        self.lease: Lease | None = None  # rank 0's, held while locked() runs (a URL)

    def __str__(self) -> str:
        return self.location

    @property
    def checkpoints(self) -> str:
        return join(self.location, CHECKPOINTS)

    def open(self, remote_timeout: float = REMOTE_TIMEOUT) -> None:
        """Make the directory (or check the store: bucket, endpoint, credentials) and, for a
        URL, the local working directory of the log; ``remote_timeout``: seconds an operation
        on the store may go without progress before it fails (``RemoteUnavailable``)."""
        if self.remote:
            self.storage = storage_for(self.location, self.storage_options, timeout=remote_timeout)[
                0
            ]
            self.local = Path(tempfile.mkdtemp(prefix="unbroken-run-"))
            return
        try:
            self.local.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise not_writable(self.local, error) from error

    def close(self) -> None:
        if self.remote and self.local != Path():
            shutil.rmtree(self.local, ignore_errors=True)

    @contextmanager
    def locked(self, job: Agreement, lease_seconds: float) -> Iterator[None]:
        """One job at a time: the OS lock of every rank (local), or rank 0's lease (a URL),
        refused on every rank if refused on one. Rank 0's changes to a URL pass its lease's
        fence: a job that lost the lease stops before it changes anything more."""
        if not self.remote:
            lock: Lock | None = DirectoryLock(self.local, job.world.rank)
        else:
            assert self.storage is not None
            lock = Lease(self.storage, self.location, lease_seconds) if job.world.first else None
        with held_by_every_rank(lock, job, self.location):
            self.lease = lock if isinstance(lock, Lease) else None
            if self.storage is not None and self.lease is not None:
                self.storage.fence = self.lease.fence
            try:
                yield
            finally:
                if self.storage is not None:
                    self.storage.fence = None
                self.lease = None

    # The log's remote copy (a URL only).
    def remote_name(self, name: str) -> str:
        """The URL of the run directory's ``name`` (said in errors)."""
        return join(self.location, name)

    def download(self, name: str) -> None:
        """The remote ``name`` into the local working directory, if it exists."""
        if self.storage is not None:
            remote, storage = join(self.location, name), self.storage
            if storage.exists(remote):
                with storage.open_read(remote) as opened:
                    (self.local / name).write_bytes(opened.read())

    def upload(self, name: str, size: int | None = None) -> None:
        """The local ``name`` (its first ``size`` bytes) to the remote run directory, whole."""
        if self.storage is not None:
            data = (self.local / name).read_bytes()
            data = data if size is None else data[:size]
            self.storage.write(join(self.location, name), lambda out: out.write(data))

    def upload_tree(self, name: str) -> None:
        """Every file under the local ``name`` (this process's) to the remote one."""
        if self.storage is None or not (self.local / name).is_dir():
            return
        for path in sorted((self.local / name).rglob("*")):
            if path.is_file():
                self.upload(str(path.relative_to(self.local)))
