"""The training loop and what it needs to be killed at any instant.

- ``trainer``: ``Trainer``, the loop, top to bottom, with its saves and the exit after a
  preemption; ``ending``: its clean-up and the line that says how a run ended.
  ``Preemption`` (scheduler signals as a flag) and ``EXIT_CODE`` are
  ``unbroken.preemption``'s, re-exported here.
- ``options``: ``TrainerOptions``, its options: each default, doc and check in one place.
- ``globalrng``: ``GlobalRNG``, the process's RNGs as a checkpoint entry, and the per-step seeds.
- ``progress``: the loop's counters (their saved schema), its bar, and where a start's time went
  before the first step; ``csvlog``: the metrics log that rewinds with a resume;
  ``determinism``: deterministic kernels.
- ``rundir``: where a run's files live, a local directory or a URL; ``lock``: one process per
  local run directory; ``lease``: one job per run directory in object storage.
- ``steps``: the user's step functions, the callbacks' hooks, the optimizer step, and ``fit``'s
  loaders, checked; ``checkpointing``: what a Trainer checkpoint holds and what a resume checks;
  ``schedule``: when a periodic one is due.
- ``agreement``: what the ranks of a data-parallel job agree on; ``jit``: just-in-time saves, a
  survivor saving the job when a rank dies (``jit_shards``: each shard of an HSDP model written
  by a survivor that holds it); ``watchdog``: a hung rank noticed through torchrun's store.
"""

from ..preemption import DEFAULT_SIGNALS, EXIT_CODE, Preemption
from .globalrng import GlobalRNG
from .options import TrainerOptions
from .trainer import Trainer

__all__ = ["DEFAULT_SIGNALS", "EXIT_CODE", "GlobalRNG", "Preemption", "Trainer", "TrainerOptions"]
