"""One training process per run directory: an OS lock that dies with its holder.

A restarted job whose old process still runs (a scheduler that requeued too early, a user who
started the command twice) would otherwise write the same checkpoints and log rows twice. The
lock is a POSIX record lock (``fcntl.lockf``) on ``<directory>/.lock``: the kernel releases it
when the holding process ends, however it ends, so a SIGKILL leaves no stale lock (the file
itself stays, and means nothing without the lock). Record locks are not inherited by forked
DataLoader workers, so a worker outliving a killed trainer does not hold the directory either,
and they work on NFS, where ``flock`` may not. The holder's pid is written into the file for the
error message of the process that is refused.

A lock that no kernel frees (the lease in object storage: ``lease``) names its holder instead
(``identity``: host, machine, pid and the process's start time, torchrun's run id and restart
count), and ``gone`` tells from that record, by reading ``/proc`` (no request), whether its
holder is known to be dead: its process gone from this machine, or its torchrun job restarted.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from ..errors import DirectoryInUse
from .agreement import Agreement

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


# Who holds a lock, and whether it still lives (the lease in object storage names its holder
# so; a local lock needs none of it: the kernel frees it with its holder).
def _process(pid: int) -> tuple[str, int] | None:
    """``(state, start time in clock ticks since boot)`` of process ``pid`` here, or ``None``."""
    try:  # the 3rd and 22nd fields, counted after the command name (it may hold spaces)
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _machine() -> str | None:
    """This kernel's boot and pid namespace: processes with the same value see each other's
    pids (a container on the same host has another namespace, and its own pid 7)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def identity() -> dict[str, Any]:
    """This process, as a lease names its holder."""
    pid, restart = os.getpid(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    found = _process(pid)
    return {
        "host": socket.gethostname(),
        "machine": _machine(),
        "pid": pid,
        "started": found[1] if found else None,
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "restart": int(restart) if restart.isdigit() else None,
    }


def gone(holder: dict[str, Any], me: dict[str, Any]) -> str | None:
    """Why ``holder`` is known to hold the lease no more (seen by ``me``), or ``None``."""
    if holder.get("released"):
        return "it released the lease as it ended"
    run_id, restart = me.get("run_id"), me.get("restart")
    if run_id not in (None, "", "none") and holder.get("run_id") == run_id:  # torchrun's own
        before = holder.get("restart")
        if isinstance(before, int) and restart is not None and restart > before:
            return f"torchrun restarted job {run_id} (restart {before} -> {restart})"
    if me.get("machine") is None or (holder.get("host"), holder.get("machine")) != (
        me["host"],
        me["machine"],
    ):
        return None  # another machine: only its renewals tell
    pid = holder.get("pid")
    found = _process(pid) if isinstance(pid, int) else None
    if found is None or found[0] in ("Z", "X") or found[1] != holder.get("started"):
        return "its process is gone from this machine"
    if pid == me["pid"]:  # this process, whose fit ended without releasing it (not in _held)
        return "it is this process, which holds it no more"
    return None


def describe(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"


class Lock(Protocol):
    def acquire(self) -> None: ...  # raises DirectoryInUse if another job holds it
    def release(self) -> None: ...


@contextmanager
def held_by_every_rank(lock: Lock | None, agreement: Agreement, directory: Any) -> Iterator[None]:
    """The run directory's lock (this rank's ``lock``; ``None``: this rank takes none) held
    while the block runs, taken by every rank or by none: a rank refused alone would leave the
    others waiting for it in their first collective."""
    refused = None
    try:
        if lock is not None:
            lock.acquire()
    except DirectoryInUse as error:
        refused = error
    (anyone,) = agreement.any_of(refused is not None)
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
