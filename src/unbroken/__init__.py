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
- ``unbroken.errors``: ``StateMismatch``, ``CorruptState``, ``CorruptCheckpoint`` (all
  ``ValueError``), ``DirectoryInUse``, ``RankFailure`` and ``DirectoryNotShared``.
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
from .errors import CorruptCheckpoint, CorruptState, DirectoryInUse, StateMismatch
from .train import EXIT_CODE, GlobalRNG, Preemption, Trainer

__version__ = "0.1.0"
__all__ = [
    "EXIT_CODE",
    "Checkpointer",
    "CombinedLoader",
    "CorruptCheckpoint",
    "CorruptState",
    "DataLoader",
    "DirectoryInUse",
    "GlobalRNG",
    "PerRank",
    "Preemption",
    "Restored",
    "Resumable",
    "Sharded",
    "ShuffleBuffer",
    "StateMismatch",
    "Trainer",
    "resumable",
    "sample_rng",
    "sample_seed",
    "shuffle_buffer",
]
