"""One training process per run directory: an OS lock that dies with its holder.

A restarted job whose old process still runs (a scheduler that requeued too early, a user who
started the command twice) would otherwise write the same checkpoints and log rows twice. The
lock is a POSIX record lock (``fcntl.lockf``) on ``<directory>/.lock``: the kernel releases it
when the holding process ends, however it ends, so a SIGKILL leaves no stale lock (the file
itself stays, and means nothing without the lock). Record locks are not inherited by forked
DataLoader workers, so a worker outliving a killed trainer does not hold the directory either,
and they work on NFS, where ``flock`` may not. The holder's pid is written into the file for the
error message of the process that is refused.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from ..errors import DirectoryInUse
from .ranks import Job

NAME = ".lock"
_held: dict[str, int] = {}  # real path -> fd: record locks never conflict within one process


class DirectoryLock:
    """``rank``: a data-parallel job's rank r > 0 locks ``.lock-rank-r`` (rank 0 ``.lock``), so
    the ranks of one job do not exclude each other and those of two jobs do."""

    def __init__(self, directory: str | os.PathLike, rank: int = 0) -> None:
        self.path = Path(directory) / (NAME if rank == 0 else f"{NAME}-rank-{rank}")
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        try:
            import fcntl
        except ImportError:  # Windows: no record locks here; one writer is the user's promise
            return
        key = os.path.realpath(self.path)
        if key in _held:
            raise DirectoryInUse(
                f"{self.path.parent} is in use by another Trainer.fit in this process (pid "
                f"{os.getpid()}); train in another directory, or let that fit() return first."
            )
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise not_writable(self.path.parent, error) from error
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if error.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            raise DirectoryInUse(
                f"{self.path.parent} is in use by another training process (pid {holder}): two "
                "processes writing one run directory would duplicate its checkpoints and log "
                "rows. Stop that process first, or train in another directory."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd, _held[key] = fd, fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            _held.pop(os.path.realpath(self.path), None)
            os.close(fd)  # closing the descriptor releases the lock

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def not_writable(directory: Any, error: OSError) -> OSError:
    """``error`` (of the same type and errno) saying what the Trainer needs of its directory."""
    return type(error)(
        error.errno,
        f"the run directory {directory} is not writable ({error.strerror}): the Trainer writes "
        "its checkpoints, its log and its lock file (.lock) there. Give it a writable directory "
        "(to look at a run on a read-only disk, use `unbroken inspect` or `unbroken verify`, "
        "which write nothing)",
    )


class Lock(Protocol):
    def acquire(self) -> None: ...  # raises DirectoryInUse if another job holds it
    def release(self) -> None: ...


@contextmanager
def held_by_every_rank(lock: Lock | None, job: Job, directory: Any) -> Iterator[None]:
    """The run directory's lock (this rank's ``lock``; ``None``: this rank takes none) held
    while the block runs, taken by every rank or by none: a rank refused alone would leave the
    others waiting for it in their first collective."""
    refused = None
    try:
        if lock is not None:
            lock.acquire()
    except DirectoryInUse as error:
        refused = error
    (anyone,) = job.any_of(refused is not None)
    if anyone:
        if lock is not None:
            lock.release()
        raise refused or DirectoryInUse(
            f"{directory} is in use by another training job: another rank of this job found "
            "its lock held. Stop that job first, or train in another directory."
        )
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
