"""Checkpoints that are whole and verified, or ignored.

- ``manager``: ``Checkpointer`` (save, retention, ``load_latest``), one process or every rank
  of a ``torch.distributed`` job together (``group``: how the ranks agree; ``per_rank``:
  ``PerRank`` entries; ``sharded``: ``Sharded`` entries, FSDP2 models and optimizers through
  DCP).
- The write path: ``writing`` (every rank writes its entries, rank 0 seals and commits),
  ``entries`` (one class per kind of entry: how it is written, described and read back).
- ``layout``: a checkpoint on disk: the names in its directory and what they say after a kill,
  the sealed manifest that makes it verifiable, its format, and the checks of one read back.
- The read path: ``loading`` (the newest whole checkpoint, every rank together, restored into
  the live objects: ``Restored``), ``verdict`` (the one judgement of a checkpoint, shared with
  ``unbroken verify``, and a damaged one moved aside, never deleted).
- ``storage``: every operation on where checkpoints live, as the protocol ``Storage`` that a
  backend subclasses, with the commit protocol as its methods, what its composite operations do
  by default, and the values they take and give; ``local``: ``LocalStorage`` (fsynced writes,
  renamed into place); ``fsspec_storage``: ``FsspecStorage``, any fsspec URL (S3, GCS,
  ``memory://``: the manifest, written last, commits), and ``storage_for``, which picks a
  storage for a path or a URL; ``transfer``: one object's bytes to and from a store, the local
  copies ``FsspecStorage`` keeps, and what differs between fsspec's filesystems; ``space``: how
  much a checkpoint needs, and the error that says the disk is full.
- ``background``: asynchronous saves; ``weights_only``: copies that ``torch.load(weights_only=
  True)`` can read back.
"""

from .fsspec_storage import FsspecStorage, storage_for
from .loading import Restored
from .local import LocalStorage
from .manager import Checkpointer
from .per_rank import PerRank
from .sharded import Sharded
from .storage import Storage

__all__ = [
    "Checkpointer",
    "FsspecStorage",
    "LocalStorage",
    "PerRank",
    "Restored",
    "Sharded",
    "Storage",
    "storage_for",
]
