"""Data parallelism on ``torch.distributed`` (torchrun).

- ``world``: ``World``, this process's rank and world size, read in one place.
- ``process_group``: ``init_process_group``, torch's, with each ``torchrun --max-restarts``
  attempt reading only its own keys of the agent's store.

Each rank's share of one global order is a data concern: ``unbroken.data.sources.sharding``. The
checkpoints of a data-parallel job are ``unbroken.Checkpointer``'s (collective, with
``PerRank`` entries), its loop ``unbroken.Trainer``'s.
"""

from .process_group import init_process_group

__all__ = ["init_process_group"]
