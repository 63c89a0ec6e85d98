"""An ``unbroken.DataLoader``'s data seed: given, a generator's, an adopted sampler's, or the
draw torch's ``RandomSampler`` would make; on several ranks, rank 0's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._checks import is_int
from ..distributed.world import World
from .views import Adopted

SEED_LIMIT = 1 << 64


def choose_seed(
    seed: int | None,
    generator: torch.Generator | None,
    taken: Adopted,
    ranks: tuple[int, int] | None,
) -> tuple[int, bool]:
    """The data seed and whether the user chose it (then a saved state must have the same)."""
    if seed is not None:
        if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        return seed, True
    if generator is not None:
        return generator.initial_seed() % SEED_LIMIT, True
    if taken.seed is not None:
        return taken.seed % SEED_LIMIT, taken.seed_given
    # The draw torch's RandomSampler would make from torch's global generator, so that
    # torch.manual_seed (or Lightning's seed_everything) reproduces the order and the samples'
    # randomness; made on a copy, so that building a loader never moves the training process's
    # draws (Lightning builds a val loader lazily, at a point a resumed run does not repeat).
    copy = torch.Generator()
    copy.set_state(torch.get_rng_state())
    drawn = int(torch.empty((), dtype=torch.int64).random_(generator=copy).item())
    if ranks is not None and ranks[1] > 1:
        drawn = _rank0_seed(drawn, ranks[1])
    return drawn, False


def _rank0_seed(drawn: int, world_size: int) -> int:
    """Rank 0's seed, so that every rank derives one global order even if their global
    generators differ: one broadcast, which every rank makes as it builds its loader."""
    world = World.current()
    if not world.initialized or world.size != world_size:
        raise ValueError(
            f"unbroken.DataLoader on {world_size} ranks needs seed= (or an initialized process "
            "group of that size, to take rank 0's): every rank derives the same global order "
            "from it"
        )
    box = [drawn]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])
