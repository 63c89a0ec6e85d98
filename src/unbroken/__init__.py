"""unbroken: PyTorch training that resumes exactly where a killed run stopped.

Public names: ``DataLoader`` (a resumable drop-in for torch's), ``sample_rng`` and
``sample_seed`` (the current sample's own randomness), ``Checkpointer`` (atomic, verified
checkpoints; ``load_latest`` returns a ``Restored``), ``GlobalRNG`` (the process's RNGs as a
checkpoint entry), ``Preemption`` (signals as a flag), ``DirectoryInUse`` (a run directory
another process trains in), ``CombinedLoader`` (several loaders as one, Lightning's modes) and
``Trainer`` (a loop that resumes bit for bit); ``resumable`` (any iterable, checkpointable) and
``shuffle_buffer`` (an exact, resumable shuffle for streams). ``unbroken.testing`` holds
``assert_resumes_exactly`` for checking a pipeline.
"""

from ._lock import DirectoryInUse
from ._rng import sample_rng, sample_seed
from ._restore import Restored
from .checkpoint import Checkpointer
from .combined import CombinedLoader
from .globalrng import GlobalRNG
from .loader import DataLoader
from .preemption import Preemption
from ._resumable import Resumable, resumable
from ._shuffle_buffer import ShuffleBuffer, shuffle_buffer
from .trainer import Trainer

__version__ = "0.1.0"
__all__ = [
    "Checkpointer",
    "CombinedLoader",
    "DataLoader",
    "DirectoryInUse",
    "GlobalRNG",
    "Preemption",
    "Restored",
    "Resumable",
    "ShuffleBuffer",
    "Trainer",
    "resumable",
    "sample_rng",
    "sample_seed",
    "shuffle_buffer",
]
assert sorted(__all__) == __all__
