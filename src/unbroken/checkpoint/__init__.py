"""Checkpoints that are whole and verified, or ignored.

- ``manager``: ``Checkpointer`` (save, retention, ``load_latest``).
- ``manifest``: the sealed manifest that makes a checkpoint directory verifiable.
- ``disk``: the storage operations a checkpoint needs (atomic write, fsync, rename, free space).
- ``background``: asynchronous saves; ``weights_only``: copies that ``torch.load(weights_only=
  True)`` can read back; ``restore``: loading entries into live objects (``Restored``).
"""

from .manager import Checkpointer
from .manifest import MANIFEST
from .restore import Restored

__all__ = ["MANIFEST", "Checkpointer", "Restored"]
