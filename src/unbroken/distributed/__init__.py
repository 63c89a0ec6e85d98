"""Data parallelism on ``torch.distributed`` (torchrun).

- ``world``: ``World``, this process's rank and world size, read in one place.
- ``process_group``: ``init_process_group``, torch's, with each ``torchrun --max-restarts``
  attempt reading only its own keys of the agent's store.
- ``reduction``: ``exact_reduce``, a DDP model whose gradient sums do not depend on DDP's
  bucket layout, so a resumed step on 3 or more ranks is bit for bit the uninterrupted one.

Each rank's share of one global order is a data concern: ``unbroken.data.sources.sharding``. The
checkpoints of a data-parallel job are ``unbroken.Checkpointer``'s (collective, with
``PerRank`` entries), its loop ``unbroken.Trainer``'s.
"""

from .process_group import init_process_group
from .reduction import InexactReduction, exact_reduce

__all__ = ["InexactReduction", "exact_reduce", "init_process_group"]
