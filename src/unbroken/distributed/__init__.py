"""Data parallelism on ``torch.distributed`` (torchrun).

- ``sharding``: each rank's share of one global order for a map-style dataset or a
  global-cursor stream, resumable on any number of ranks (``unbroken.DataLoader(..., rank=, world_size=)``, or the ranks of the
  initialized process group).

Still to come here (issue 10): other iterable datasets per rank, checkpoints with a part per rank,
agreement on preemption across ranks, the Trainer under torchrun.
"""

__all__: list[str] = []
