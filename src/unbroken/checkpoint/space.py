"""Room for a checkpoint: how much one needs, and an error that says so when the disk is full.

``disk_full`` turns ENOSPC (and EDQUOT) into an ``OSError`` of the same errno that says the disk
is full, how much the checkpoint needs, how much is free and how much the kept checkpoints take.
``estimate_size`` walks the state once (no copy, no serialization); it runs only after a save
failed for want of space.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import torch

from .._units import human
from .storage import Storage, join

FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(
    error: OSError,
    storage: Storage,
    directory: str,
    step: int,
    entries: dict,
    keep: int,
    kept: list[str],
) -> OSError:
    """``error`` (ENOSPC or EDQUOT) as an ``OSError`` that says what to do; call it after the
    temporary directory is removed, so that what is free is what a new save would have."""
    assert error.errno is not None  # FULL holds it
    # Each file adds its zip directory (about 1 kB); the manifest adds about as much.
    needed = sum(estimate_size(value) + 1024 for value in entries.values()) + 1024
    free: int | None
    try:
        free = storage.free_space(directory)
    except OSError:
        free = None
    used = sum(_du(storage, path) for path in kept)
    where = (
        f"the disk holding {directory} is full"
        if error.errno == errno.ENOSPC
        else f"the disk quota that holds {directory} is used up"
    )
    message = (
        f"{os.strerror(error.errno)}: checkpoint step {step} was not saved, as {where}. It "
        f"needs about {human(needed)} ({needed} bytes, an estimate from the sizes of its "
        "tensors and values)"
        + (f" and {human(free)} ({free} bytes) are free there" if free is not None else "")
        + (
            f"; the {len(kept)} checkpoint{'s' * (len(kept) > 1)} kept there take"
            f"{'s' * (len(kept) == 1)} {human(used)}"
            if kept
            else ""
        )
        + f". Free space on that disk or give the Checkpointer a directory on a larger one (it "
        f"needs room for keep={keep} checkpoints plus the one being written). Nothing was "
        "changed: the earlier checkpoints are as they were."
    )
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
        return 16 + sum(estimate_size(k, seen) + estimate_size(v, seen) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return 16 + sum(estimate_size(item, seen) for item in value)
    if isinstance(value, (str, bytes, bytearray)):
        return 8 + len(value)
    return 16 if not isinstance(value, int) else 8 + value.bit_length() // 8


def _du(storage: Storage, directory: str) -> int:
    """The bytes of the files directly in ``directory`` (a checkpoint has no subdirectories)."""
    try:
        return sum(
            storage.size(join(directory, entry.name))
            for entry in storage.list_directory(directory)
            if not entry.is_directory
        )
    except OSError:
        return 0
