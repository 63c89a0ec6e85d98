"""Checkpoints that are whole and verified, or ignored.

- ``manager``: ``Checkpointer`` (save, retention, ``load_latest``), one process or every rank
  of a ``torch.distributed`` job together (``group``: how the ranks agree; ``per_rank``:
  ``PerRank`` entries; ``sharded``: ``Sharded`` entries, FSDP2 models and optimizers through
  DCP).
- ``manifest``: the sealed manifest that makes a checkpoint directory verifiable.
- ``storage``: the filesystem operations a checkpoint needs, as the protocol ``Storage``
  (hashed, fsynced writes, renames, listing, free space), and ``LocalStorage``; ``space``: how
  much a checkpoint needs, and the error that says the disk is full.
- ``background``: asynchronous saves; ``weights_only``: copies that ``torch.load(weights_only=
  True)`` can read back; ``restore``: loading entries into live objects (``Restored``).
"""

from .manager import Checkpointer
from .manifest import MANIFEST
from .objects import ObjectStorage
from .per_rank import PerRank
from .restore import Restored
from .sharded import Sharded
from .storage import LocalStorage, Storage

__all__ = [
    "MANIFEST",
    "Checkpointer",
    "LocalStorage",
    "ObjectStorage",
    "PerRank",
    "Restored",
    "Sharded",
    "Storage",
]
