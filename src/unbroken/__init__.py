"""unbroken: PyTorch training that resumes exactly where a killed run stopped.

The public API is the names below (and ``unbroken.testing``); import them from ``unbroken``.
The implementation is grouped by concern, and each subpackage's ``__all__`` says what it
offers; the modules inside are internal and may move:

- ``unbroken.data``: ``DataLoader`` (a resumable drop-in for torch's), ``CombinedLoader``
  (several loaders as one, Lightning's modes), ``resumable`` (any iterable, checkpointable),
  ``shuffle_buffer`` (an exact, resumable shuffle for streams), ``sample_rng`` and
  ``sample_seed`` (the current sample's own randomness).
- ``unbroken.checkpoint``: ``Checkpointer`` (atomic, verified checkpoints; ``load_latest``
  returns a ``Restored``; collective under ``torch.distributed``, ``PerRank`` entries saved
  by every rank, ``Sharded`` ones (FSDP2) through ``torch.distributed.checkpoint``).
- ``unbroken.train``: ``Trainer`` (a loop that resumes bit for bit), ``Preemption`` (signals
  as a flag), ``GlobalRNG`` (the process's RNGs as a checkpoint entry).
- ``unbroken.distributed``: data parallelism (``DataLoader(rank=, world_size=)``, or torchrun).
- ``unbroken.streaming``: sharded datasets in object storage: ``write_shards``,
  ``index_parquet``, ``StreamingDataset`` (the ``streaming`` and ``s3`` extras); also
  reachable as ``unbroken.StreamingDataset`` etc., imported on first use.
- ``unbroken.errors``: ``StateMismatch``, ``CorruptState``, ``CorruptCheckpoint``,
  ``CorruptShard`` (all ``ValueError``), ``DirectoryInUse``, ``RankFailure``,
  ``DirectoryNotShared`` and ``RemoteUnavailable``.
- ``unbroken.testing``: ``assert_resumes_exactly`` for checking a pipeline.
"""

from .checkpoint import Checkpointer, PerRank, Restored, Sharded
from .data import (
    CombinedLoader,
    DataLoader,
    Resumable,
    ShuffleBuffer,
    resumable,
    sample_rng,
    sample_seed,
    shuffle_buffer,
)
from .errors import (
    CorruptCheckpoint,
    CorruptShard,
    CorruptState,
    DirectoryInUse,
    RemoteUnavailable,
    StateMismatch,
)
from .train import EXIT_CODE, GlobalRNG, Preemption, Trainer

__version__ = "0.1.0"  # the only place: pyproject.toml reads it (tool.setuptools.dynamic)
__all__ = [
    "Checkpointer",
    "CombinedLoader",
    "CorruptCheckpoint",
    "CorruptShard",
    "CorruptState",
    "DataLoader",
    "DirectoryInUse",
    "EXIT_CODE",
    "GlobalRNG",
    "PerRank",
    "Preemption",
    "RemoteUnavailable",
    "Restored",
    "Resumable",
    "Sharded",
    "ShuffleBuffer",
    "StateMismatch",
    "StreamingDataset",
    "Trainer",
    "index_parquet",
    "resumable",
    "sample_rng",
    "sample_seed",
    "shuffle_buffer",
    "write_shards",
]

# unbroken.streaming needs pyarrow, fsspec and filelock (the "streaming" extra): imported when
# one of its names is first used, so `import unbroken` does not need them.
_STREAMING = ("StreamingDataset", "index_parquet", "write_shards")


def __getattr__(name: str) -> object:
    if name in _STREAMING:
        from . import streaming

        return getattr(streaming, name)
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
