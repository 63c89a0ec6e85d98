"""The training loop and what it needs to be killed at any instant.

- ``trainer``: ``Trainer``, the loop, top to bottom.
- ``options``: ``TrainerOptions``, its options: each default, doc and check in one place.
- ``preemption``: ``Preemption``, scheduler signals as a flag; ``EXIT_CODE``.
- ``globalrng``: ``GlobalRNG``, the process's RNGs as a checkpoint entry.
- ``progress``: the loop's counters (their saved schema) and bar; ``csvlog``: the metrics log
  that rewinds with a resume; ``lock``: one process per run directory; ``determinism``:
  deterministic kernels.
- ``hooks``: the callbacks' hooks and ``fit``'s loaders, checked; ``steps``: the user's step
  functions and the optimizer step; ``checkpointing``: what a Trainer checkpoint holds and what
  a resume checks; ``schedule``: when a periodic one is due; ``agreement``: what the ranks of a
  data-parallel job agree on.
"""

from ..errors import DirectoryInUse
from ..preemption import DEFAULT_SIGNALS, EXIT_CODE, Preemption
from .globalrng import GlobalRNG
from .options import TrainerOptions
from .trainer import Trainer

__all__ = [
    "DEFAULT_SIGNALS",
    "EXIT_CODE",
    "DirectoryInUse",
    "GlobalRNG",
    "Preemption",
    "Trainer",
    "TrainerOptions",
]
