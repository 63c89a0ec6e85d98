"""Durable writes for checkpoints: hashed on the way, fsynced, and errors that say what happened.

``write_file`` hashes each byte as it passes to the file, then flushes and fsyncs it;
``make_directories`` and ``fsync_dir`` make new directory entries durable. ``torch.save``
turns an error of the file it writes into ``RuntimeError: [enforce fail at
inline_container.cc] unexpected pos``; the writer keeps the real ``OSError`` and raises that
instead. ``disk_full`` turns ENOSPC (and EDQUOT) into an error that says the disk is full, how
much the checkpoint needs and how much is free. Costs: one sha256 pass (~1 GB/s) over what is
written, one fsync per file and per directory.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

FULL = (errno.ENOSPC, errno.EDQUOT)


class _HashingWriter:
    """A write-only file that hashes what passes through, so each byte is handled once."""

    def __init__(self, file) -> None:
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as error:  # torch.save replaces it with "unexpected pos": keep it
            self.error = self.error or error
            raise
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self.file.flush()


def write_file(path: Path, write: Callable[[Any], Any]) -> dict:
    """Create ``path`` with what ``write(file)`` writes; fsynced. Its ``sha256`` and ``size``."""
    with open(path, "xb") as file:
        out = _HashingWriter(file)
        try:
            write(out)
        finally:
            if out.error is not None:
                raise out.error from None  # the cause; torch's own error is only its symptom
        file.flush()
        os.fsync(file.fileno())
    return {"sha256": out.sha256.hexdigest(), "size": out.size}


def fsync_dir(path: Path) -> None:
    if os.name == "posix":  # elsewhere directories cannot be opened, and renames are journaled
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_directories(path: Path) -> None:
    """``mkdir -p path``, each new directory's entry fsynced in its parent."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        fsync_dir(directory.parent)


def remove(path: Path, doomed_prefix: str) -> None:
    # Renamed first, so that a writer killed mid-delete leaves no half checkpoint in view.
    doomed = path.with_name(f"{doomed_prefix}{path.name}-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------- disk full


def disk_full(error: OSError, directory: Path, step: int, entries: dict, keep: int,
              kept: list[Path]) -> OSError:
    """``error`` (ENOSPC or EDQUOT) as an ``OSError`` that says what to do; call it after the
    temporary directory is removed, so that what is free is what a new save would have."""
    # Each file adds its zip directory (about 1 kB); the manifest adds about as much.
    needed = sum(estimate_size(value) + 1024 for value in entries.values()) + 1024
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    used = sum(_du(path) for path in kept)
    where = (f"the disk holding {directory} is full" if error.errno == errno.ENOSPC else
             f"the disk quota that holds {directory} is used up")
    message = (
        f"{os.strerror(error.errno)}: checkpoint step {step} was not saved, as {where}. It "
        f"needs about {_human(needed)} ({needed} bytes, an estimate from the sizes of its "
        "tensors and values)" +
        (f" and {_human(free)} ({free} bytes) are free there" if free is not None else "") +
        (f"; the {len(kept)} checkpoint{'s' * (len(kept) > 1)} kept there take"
         f"{'s' * (len(kept) == 1)} {_human(used)}" if kept else "") +
        f". Free space on that disk or give the Checkpointer a directory on a larger one (it "
        f"needs room for keep={keep} checkpoints plus the one being written). Nothing was "
        "changed: the earlier checkpoints are as they were.")
    return OSError(error.errno, message)


def estimate_size(value: Any, seen: set | None = None) -> int:
    """About how many bytes ``torch.save`` writes for ``value``: tensors' storages (each once,
    as torch.save writes them) plus its plain values, and a little for each container."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        try:
            storage = value.untyped_storage()
            key = (storage.device, storage.data_ptr(), storage.nbytes())
            if key in seen:
                return 0
            seen.add(key)
            return storage.nbytes() + 400
        except (NotImplementedError, RuntimeError):  # sparse and others: an upper bound
            return value.numel() * value.element_size() + 400
    if isinstance(value, dict):
        return 16 + sum(estimate_size(k, seen) + estimate_size(v, seen)
                        for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return 16 + sum(estimate_size(item, seen) for item in value)
    if isinstance(value, (str, bytes, bytearray)):
        return 8 + len(value)
    return 16 if not isinstance(value, int) else 8 + value.bit_length() // 8


def _du(path: Path) -> int:
    try:
        return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
    except OSError:
        return 0


def _human(size: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")
