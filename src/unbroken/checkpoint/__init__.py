"""Checkpoints that are whole and verified, or ignored.

- ``manager``: ``Checkpointer`` (save, retention, ``load_latest``), one process or every rank
  of a ``torch.distributed`` job together (``group``: how the ranks agree; ``sharded``:
  ``Sharded`` entries, FSDP2 models and optimizers through DCP).
- The write path: ``writing`` (rank 0 stages the temporary directory, every rank writes its
  entries, rank 0 seals the manifest and commits; background saves; the disk-full error),
  ``entries`` (one class per kind of entry: how it is written, described and read back;
  ``PerRank`` entries), ``weights_only`` (what ``torch.load(weights_only=True)`` can read back,
  checked as an entry is copied).
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
  copies ``FsspecStorage`` keeps, and what differs between fsspec's filesystems.
"""

from .entries import PerRank
from .fsspec_storage import FsspecStorage, storage_for
from .loading import Restored
from .local import LocalStorage
from .manager import Checkpointer
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
