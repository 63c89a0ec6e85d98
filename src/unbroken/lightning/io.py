"""``AtomicCheckpointIO``: Lightning's checkpoint files written whole or not at all.

Lightning's ``TorchCheckpointIO`` writes a local checkpoint in place, so a kill during the write
leaves a truncated ``last.ckpt`` that the next ``ckpt_path="last"`` fails to load. This one
writes a temporary file beside the target, syncs it and renames it over the old one (then syncs
the directory, so the rename survives a power loss). Cost: one fsync of the file and one of the
directory per checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ..checkpoint.storage import LocalStorage


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose local writes are atomic: the checkpoint is
    written to a temporary file beside the target, synced, and renamed over it, so a file under
    the checkpoint's name is always a whole one. Paths with a protocol (``s3://``...) are written
    by Lightning, as before."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        target = os.fspath(path)
        if "://" in target:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                "AtomicCheckpointIO.save_checkpoint takes no storage_options (a local file)"
            )
        directory = os.path.dirname(os.path.abspath(target))
        storage = LocalStorage()  # the Checkpointer's durable directories and syncs
        storage.make_directories(directory)
        handle, temporary = tempfile.mkstemp(
            prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory
        )
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            os.unlink(temporary)
            raise
        storage.sync_directory(directory)  # the rename is durable once the directory is synced
