"""Data parallelism on ``torch.distributed`` (torchrun).

- ``sharding``: each rank's share of one global order for a map-style dataset or a
  global-cursor stream, resumable on any number of ranks (``unbroken.DataLoader(...,
  rank=, world_size=)``, or the ranks of the initialized process group).
- ``process_group``: ``init_process_group``, torch's, with each ``torchrun --max-restarts``
  attempt reading only its own keys of the agent's store.

The checkpoints of a data-parallel job are ``unbroken.Checkpointer``'s (collective, with
``PerRank`` entries), its loop ``unbroken.Trainer``'s.
"""

from .process_group import init_process_group

__all__ = ["init_process_group"]
