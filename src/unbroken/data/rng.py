"""Per-sample randomness derived from (seed, epoch, position), never captured.

Before each sample is fetched, ``seed_sample`` seeds the process-global torch, numpy and
``random`` generators from a 64-bit value derived from the loader's seed, the epoch and the
sample's position in the epoch's global order. A random transform inside ``__getitem__``
therefore draws the same numbers whichever worker runs it and however many workers there
are, and a resumed run needs no RNG state at all.

``sample_rng()`` gives the current sample its own ``torch.Generator`` (seeded lazily, only
when asked for) and ``sample_seed()`` its 64-bit seed, e.g. for
``numpy.random.default_rng(unbroken.sample_seed())``.

Cost per sample, measured on this project's 2-core CI machine (see benchmarks/RESULTS.md):
torch's CPU generator ~1.0 us (``torch.default_generator.manual_seed``; ``torch.manual_seed``
also walks every accelerator and costs ~100 us), numpy's legacy global generator ~1.3 us,
``random`` ~3.4 us. ``global_rngs`` on the DataLoader chooses which are seeded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch.utils.data import get_worker_info

from .shuffle import mix64

GLOBAL_RNGS = ("torch", "numpy", "random")
_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

# The sample being fetched in this process (each DataLoader worker is its own process).
_current_seed: int | None = None
_sample_generator: torch.Generator | None = None
_generator_seeded_for: int | None = None


def check_global_rngs(global_rngs: Iterable[str]) -> tuple[str, ...]:
    chosen = tuple(global_rngs) if not isinstance(global_rngs, str) else (global_rngs,)
    unknown = [name for name in chosen if name not in GLOBAL_RNGS]
    if unknown:
        raise ValueError(
            f"global_rngs: unknown generator(s) {unknown}; expected a subset of {GLOBAL_RNGS}, "
            "e.g. global_rngs=('torch',) or global_rngs=() to seed none"
        )
    return tuple(name for name in GLOBAL_RNGS if name in chosen)


def make_seeder(global_rngs: tuple[str, ...]) -> Callable[[int], None]:
    """Return ``seed(sample_seed)`` that seeds the chosen global generators, fast.

    Bound methods are looked up once here: the call runs once per sample.
    """
    torch_seed = torch.default_generator.manual_seed if "torch" in global_rngs else None
    numpy_seed = np.random.seed if "numpy" in global_rngs else None
    random_seed = random.seed if "random" in global_rngs else None

    def seed(value: int) -> None:
        global _current_seed, _generator_seeded_for
        _current_seed = value
        _generator_seeded_for = None  # the same sample fetched twice must restart its stream
        if torch_seed is not None:
            torch_seed(value)
        if numpy_seed is not None:
            numpy_seed(value & 0xFFFFFFFF)  # numpy's legacy seeding takes 32 bits
        if random_seed is not None:
            random_seed(value)

    return seed


def sample_seed_at(epoch_key: int, position: int) -> int:
    """The 64-bit seed of the sample at ``position`` of the epoch keyed by ``epoch_key``."""
    x = ((epoch_key + position * _GOLDEN) & _U64) * 0xBF58476D1CE4E5B9 & _U64
    return x ^ (x >> 31)


def keep_main_torch_rng(global_rngs: tuple[str, ...]) -> torch.Tensor | None:
    """In the training process itself (``num_workers=0``), the state of torch's generator to put
    back once the batch is fetched, so that dropout and the rest of the training step draw the
    same numbers whatever the loader did and whatever ``num_workers`` is. ~1.2 us a batch.

    numpy's and ``random``'s global generators are not put back: saving and restoring them costs
    ~57 us and ~10 us a batch. With ``num_workers=0`` they are left as the batch's last sample
    left them (deterministic, so resumes stay exact, but different from ``num_workers > 0``).
    """
    if "torch" not in global_rngs or get_worker_info() is not None:
        return None
    return torch.default_generator.get_state()


def clear_sample(saved_torch_state: torch.Tensor | None = None) -> None:
    global _current_seed
    _current_seed = None
    if saved_torch_state is not None:
        torch.default_generator.set_state(saved_torch_state)


def sample_seed() -> int:
    """The 64-bit seed of the sample being fetched, derived from (seed, epoch, position).

    Call it inside ``__getitem__`` of a dataset loaded by ``unbroken.DataLoader``.
    """
    if _current_seed is None:
        raise RuntimeError(
            "unbroken.sample_seed()/sample_rng() are only defined while unbroken.DataLoader "
            "fetches a sample: call them inside your dataset's __getitem__"
        )
    return _current_seed


def sample_rng() -> torch.Generator:
    """The current sample's own ``torch.Generator``, e.g. ``torch.rand(3, generator=...)``.

    Seeded on first use for each sample (so samples that don't ask pay nothing); repeated
    calls within one sample return the same generator, continuing its stream. Don't keep it
    across samples: the next sample re-seeds it.
    """
    global _sample_generator, _generator_seeded_for
    seed = sample_seed()
    if _sample_generator is None:
        _sample_generator = torch.Generator()
    if _generator_seeded_for != seed:
        # A different stream from the global generator's, which got ``seed`` itself.
        _sample_generator.manual_seed(mix64(seed))
        _generator_seeded_for = seed
    return _sample_generator
