"""``World``: where this process stands in a data-parallel job, read in one place.

Every part that behaves differently on several ranks (the loader's share of the order and its
seed, the Checkpointer's collectives, the Trainer's agreements, who prints) asks ``World``,
which reads ``torch.distributed``'s default process group, or takes ``rank=``/``world_size=``
given by hand (``World.given``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .._checks import is_int


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` ranks; ``initialized``: whether a default process
    group exists (a job of one rank may have one too)."""

    rank: int = 0
    size: int = 1
    initialized: bool = False

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def first(self) -> bool:
        return self.rank == 0

    @staticmethod
    def current() -> World:
        """The default process group's rank and size, or one process if there is none."""
        if dist.is_available() and dist.is_initialized():
            return World(dist.get_rank(), dist.get_world_size(), initialized=True)
        return World()

    @staticmethod
    def given(rank: int | None, world_size: int | None) -> World | None:
        """``rank`` and ``world_size`` as given (both, or neither to take the default process
        group's), checked; None for a single process without either."""
        if rank is None and world_size is None:
            world = World.current()
            return world if world.initialized else None
        if rank is None or world_size is None:
            raise ValueError(
                f"pass both rank= and world_size= (or neither, to take them from the initialized "
                f"process group), got rank={rank!r}, world_size={world_size!r}"
            )
        for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size, got rank={rank}, world_size={world_size}")
        return World(rank, world_size, initialized=World.current().initialized)
