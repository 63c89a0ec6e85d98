"""Randomness derived from (seed, epoch, position), never captured.

**Global generators, per batch.** Before each batch is fetched, ``make_seeder``'s function seeds
the process-global torch, numpy and ``random`` generators from the epoch's key and the batch's
first position in the epoch's global order; the batch's samples then draw from them in turn. A
batch is fetched whole by one worker and its samples are fixed by the state's fingerprint (the
order, ``batch_size``), so a batch draws the same numbers whichever worker fetches it, however many
workers there are, and after any resume (which always starts at a batch boundary). On several
ranks, rank r's batches are positions ``[m*B, (m+1)*B)`` of the global order whatever the world
size, so they draw the same numbers too. Seeding once per batch rather than once per sample
divides the cost by the batch size: it is the seeding calls themselves that cost (docs/benchmarks/unit-costs.md,
rows ``seed_torch``, ``seed_numpy`` and ``seed_random``; ``random``'s is the dearest).

**Global generators, per collate.** ``collate_fn`` runs once per batch, in the worker that
fetched it or (``num_workers=0``) in the training process. Right before it, ``make_seeder``'s
function with ``collate_seeds`` seeds the chosen global generators again, from the same key and
position: a masking or mixing collator (transformers' ``DataCollatorForLanguageModeling``) then
draws the same numbers for a batch at any worker count and after any resume, and how much the
batch's samples drew does not move its stream. ``sources.fetch.SeededCollate`` skips that
seeding for torch's ``default_collate``/``default_convert``, which draw nothing (the three
seeding calls saved). In the training process, torch's generator is put back after
the collate as it is after the samples (``keep_main_torch_rng``): the collator's draws never
reach the step's.

**Distinct streams.** torch's CPU generator and numpy's legacy one keep only 32 bits of a seed,
so seeds drawn at random from a 64-bit hash would repeat by the birthday bound (an epoch of
1.28M samples seeded per sample had 164 pairs of positions drawing identical numbers). The
32-bit seed is therefore a keyed *bijection* of the position (``stream32``): two batches of one
epoch never share a seed. torch, numpy and ``random`` get three different seeds (the plain
position's seed xor a constant per generator): MT19937 seeded alike in torch and numpy gives the
same raw stream, which would correlate a torch flip with a numpy crop of the same sample.

**Per sample, on demand.** ``sample_rng()`` gives the sample being fetched its own
``torch.Generator`` (seeded with ``stream32`` of its own position, on first use only, so samples
that don't ask pay nothing) and ``sample_seed()`` its 64-bit seed, e.g. for
``numpy.random.default_rng(unbroken.sample_seed())``. These two depend on the sample's position
only, not on its batch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch.utils.data import get_worker_info

GLOBAL_RNGS = ("torch", "numpy", "random")
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Xor'ed into a batch's seed per generator, so torch, numpy and random never share a stream.
_NUMPY, _RANDOM, _SAMPLE_RNG = 0x5BD1E995, 0x2545F491, 0x68E31DA4
_COLLATE = 0x1B873593  # xor'ed into the key of a batch's collate_fn seeds

Seeder = Callable[[int, int], None]
Seeds = Callable[[int, int], tuple[int, int, int]]


class _Current:
    """The sample being fetched in this process (each DataLoader worker is its own process):
    its epoch key (None outside a fetch) and position, and what ``sample_rng()`` was last seeded
    for. One object with slots: setting a field per sample costs ~30 ns."""

    __slots__ = ("key", "position", "generator", "seeded_for")

    def __init__(self) -> None:
        self.key: int | None = None
        self.position = 0
        self.generator: torch.Generator | None = None
        self.seeded_for: tuple[int, int] | None = None


CURRENT = _Current()


def check_global_rngs(global_rngs: Iterable[str]) -> tuple[str, ...]:
    chosen = tuple(global_rngs) if not isinstance(global_rngs, str) else (global_rngs,)
    unknown = [name for name in chosen if name not in GLOBAL_RNGS]
    if unknown:
        raise ValueError(
            f"global_rngs: unknown generator(s) {unknown}; expected a subset of {GLOBAL_RNGS}, "
            "e.g. global_rngs=('torch',) or global_rngs=() to seed none"
        )
    return tuple(name for name in GLOBAL_RNGS if name in chosen)


def stream32(key: int, position: int) -> int:
    """A 32-bit seed for ``position`` of the epoch keyed by ``key`` (64 bits): for a fixed key,
    a bijection of ``position mod 2**32``, so distinct positions of an epoch get distinct seeds.
    Each step is invertible modulo 2**32 (adding the key, multiplying by an odd number taken
    from the key, an xorshift); MT19937's own seeding then spreads the bits."""
    x = ((position + key) * ((key >> 32) | 1)) & _U32
    return x ^ (x >> 16)


def batch_seeds(key: int, position: int) -> tuple[int, int, int]:
    """The seeds of torch's, numpy's and ``random``'s global generators for the batch whose
    first sample is at ``position`` of the epoch keyed by ``key``: the documented derivation."""
    seed = stream32(key, position)
    return seed, seed ^ _NUMPY, seed ^ _RANDOM


def collate_seeds(key: int, position: int) -> tuple[int, int, int]:
    """The seeds of torch's, numpy's and ``random``'s global generators for the ``collate_fn``
    call of the batch whose first sample is at ``position`` of the epoch keyed by ``key``: the
    documented derivation, a bijection of the position under a key of its own (so distinct per
    batch, and never tied to the stream of the batch's samples)."""
    seed = stream32(key ^ _COLLATE, position)
    return seed, seed ^ _NUMPY, seed ^ _RANDOM


def make_seeder(global_rngs: tuple[str, ...], seeds: Seeds = batch_seeds) -> Seeder:
    """Return ``seed(key, position)``: seed the chosen global generators with ``seeds(key,
    position)``. With ``batch_seeds`` (the samples' seeder), it also makes the batch starting
    at ``position`` the current one for ``sample_seed()``/``sample_rng()``; with
    ``collate_seeds`` (the collate's), it leaves that alone.

    Bound methods are looked up once here: the call runs once per batch.
    """
    torch_seed = torch.default_generator.manual_seed if "torch" in global_rngs else None
    numpy_seed = np.random.seed if "numpy" in global_rngs else None
    random_seed = random.seed if "random" in global_rngs else None
    current = CURRENT if seeds is batch_seeds else None

    def seed(key: int, position: int) -> None:
        if current is not None:
            current.key, current.position = key, position
            current.seeded_for = None  # the same sample fetched again must restart its stream
        if torch_seed is None and numpy_seed is None and random_seed is None:
            return
        torch_value, numpy_value, random_value = seeds(key, position)
        if torch_seed is not None:
            torch_seed(torch_value)
        if numpy_seed is not None:
            numpy_seed(numpy_value)
        if random_seed is not None:
            random_seed(random_value)

    return seed


def sample_seed_at(key: int, position: int) -> int:
    """The 64-bit seed of the sample at ``position`` of the epoch keyed by ``key``."""
    x = ((key + position * _GOLDEN) & _U64) * 0xBF58476D1CE4E5B9 & _U64
    return x ^ (x >> 31)


def sample_rng_seed(key: int, position: int) -> int:
    """The 32-bit seed of ``sample_rng()`` for the sample at ``position``: distinct per position
    of an epoch, and never the global generators' seed of the batch the sample starts."""
    return stream32(key ^ _SAMPLE_RNG, position)


def keep_main_torch_rng(global_rngs: tuple[str, ...]) -> torch.Tensor | None:
    """In the training process itself (``num_workers=0``), the state of torch's generator to put
    back once the batch is fetched and collated, so that dropout and the rest of the training
    step draw the same numbers whatever the loader or the collator did and whatever
    ``num_workers`` is (row ``torch_rng_back`` of docs/benchmarks/unit-costs.md).

    numpy's and ``random``'s global generators are not put back: saving and restoring their
    624-word states would cost every batch far more (rows ``numpy_rng_back`` and
    ``random_rng_back``). With ``num_workers=0`` they are left as the batch's collate (or,
    if it is not seeded, its last sample) left them: deterministic, so resumes stay exact, but
    different from ``num_workers > 0``.
    """
    if "torch" not in global_rngs or get_worker_info() is not None:
        return None
    return torch.default_generator.get_state()


def clear_sample(saved_torch_state: torch.Tensor | None = None) -> None:
    CURRENT.key = None
    if saved_torch_state is not None:
        torch.default_generator.set_state(saved_torch_state)


def _current() -> _Current:
    if CURRENT.key is None:
        raise RuntimeError(
            "unbroken.sample_seed()/sample_rng() are only defined while unbroken.DataLoader "
            "fetches a sample: call them inside your dataset's __getitem__"
        )
    return CURRENT


def sample_seed() -> int:
    """The 64-bit seed of the sample being fetched, derived from (seed, epoch, position).

    Call it inside ``__getitem__`` of a dataset loaded by ``unbroken.DataLoader``, e.g.
    ``numpy.random.default_rng(unbroken.sample_seed())``.

    Returns:
        The seed, an int in [0, 2**64): the same for the same sample after any resume.

    Raises:
        RuntimeError: no ``unbroken.DataLoader`` is fetching a sample in this process.
    """
    current = _current()
    assert current.key is not None
    return sample_seed_at(current.key, current.position)


def sample_rng() -> torch.Generator:
    """The current sample's own ``torch.Generator``, e.g. ``torch.rand(3, generator=...)``.

    Seeded on first use for each sample (so samples that don't ask pay nothing); repeated
    calls within one sample return the same generator, continuing its stream. Don't keep it
    across samples: the next sample re-seeds it.

    Returns:
        The generator, seeded from the sample's (seed, epoch, position).

    Raises:
        RuntimeError: no ``unbroken.DataLoader`` is fetching a sample in this process.
    """
    current = _current()
    key, position = current.key, current.position
    assert key is not None
    if current.generator is None:
        current.generator = torch.Generator()
    if current.seeded_for != (key, position):
        current.generator.manual_seed(sample_rng_seed(key, position))
        current.seeded_for = (key, position)
    return current.generator
