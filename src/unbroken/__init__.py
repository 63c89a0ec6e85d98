"""unbroken: PyTorch training that resumes exactly where a killed run stopped.

Public names: ``DataLoader`` (a resumable drop-in for torch's), ``sample_rng`` and
``sample_seed`` (the current sample's own randomness); ``unbroken.testing`` holds
``assert_resumes_exactly`` for checking a pipeline.
"""

from ._rng import sample_rng, sample_seed
from .loader import DataLoader

__version__ = "0.1.0"
__all__ = ["DataLoader", "sample_rng", "sample_seed"]
assert sorted(__all__) == __all__
