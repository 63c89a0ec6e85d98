"""``AtomicCheckpointIO``: Lightning's checkpoint files written whole or not at all.

Lightning's ``TorchCheckpointIO`` writes a local checkpoint in place, so a kill during the write
leaves a truncated ``last.ckpt`` that the next ``ckpt_path="last"`` fails to load. This one
writes a temporary file beside the target, syncs it and renames it over the old one, then syncs
the directory, so the rename survives a power loss (``_files.atomic_write``). Cost: one fsync of the file and one of the
directory per checkpoint.

A URL (``ModelCheckpoint(dirpath="s3://bucket/run/ckpt")``) is written through
``unbroken.checkpoint.FsspecStorage``: an object store shows an object once its upload completed,
never part of it; a failed upload is aborted (S3's multipart upload too) and retried with backoff,
and Lightning's draws-nothing rule holds (botocore's jittered retries are off). Its
``storage_options`` are the filesystem's (endpoint, credentials), else fsspec's defaults (the
``AWS_*`` environment variables), which Lightning's ``ModelCheckpoint`` uses to list the directory.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from .._files import atomic_write
from ..checkpoint import FsspecStorage, LocalStorage
from ..checkpoint.fsspec_storage import is_url


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose writes are atomic.

    A local checkpoint is written to a temporary file beside the target, synced, and renamed
    over it, so a file under the checkpoint's name is always a whole one. A URL's is uploaded
    whole or not at all, with retries.

    Args:
        storage_options: The fsspec options of a URL's filesystem (endpoint, credentials);
            fsspec's defaults when left out.
    """

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self._stores: dict[str, FsspecStorage] = {}

    def _store(self, url: str) -> FsspecStorage:
        import fsspec

        protocol = fsspec.core.split_protocol(url)[0] or ""
        if protocol not in self._stores:
            # No local copies: Lightning's files are not the Checkpointer's, which prunes them.
            self._stores[protocol] = FsspecStorage(url, self.storage_options, cache=False)
        return self._stores[protocol]

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Write a checkpoint whole or not at all: an atomic rename, or a whole upload."""
        target = os.fspath(path)
        if is_url(target):
            if storage_options is not None:
                raise TypeError(
                    "AtomicCheckpointIO.save_checkpoint takes no storage_options: give them to "
                    "AtomicCheckpointIO(storage_options=...)"
                )
            self._store(target).write(target, lambda out: torch.save(checkpoint, out))
            return
        if storage_options is not None:
            raise TypeError(
                "AtomicCheckpointIO.save_checkpoint takes no storage_options (a local file)"
            )
        # The Checkpointer's durable directories: each new one's entry synced in its parent.
        LocalStorage().make_directories(os.path.dirname(os.path.abspath(target)))
        atomic_write(target, lambda out: torch.save(checkpoint, out))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        """Load a checkpoint as Lightning does; a URL's through ``FsspecStorage``, with retries."""
        source = os.fspath(path)
        if not is_url(source):
            return super().load_checkpoint(path, map_location, weights_only)
        store = self._store(source)
        if not store.exists(source):
            raise FileNotFoundError(f"Checkpoint file not found: {source}")
        with store.open_read(source) as opened:
            return torch.load(opened, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint as Lightning does; a URL's through ``FsspecStorage``."""
        target = os.fspath(path)
        if not is_url(target):
            super().remove_checkpoint(path)
            return
        self._store(target).remove_tree(target)
