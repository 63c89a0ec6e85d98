"""Every random stream unbroken derives, named: one key per purpose, never two purposes per key.

A key is ``derive_key(seed, epoch, *purpose)``, and no two purposes share a tuple, so no two
streams can coincide by construction (the older layout keyed stream worker w as
``(seed, epoch, w)``, which is the shuffle's tuple for w = 1 and the worker seeds' for w = 2).

============================  ==================================  ==========================
purpose                       tuple                               used by
============================  ==================================  ==========================
samples of the global order   ``(seed, epoch)``                   map-style, ``read_range``
the per-index shuffle         ``(seed, epoch, 1)``                ``shuffle=True``
torch's worker base seed      ``(seed, epoch, 2)``                the inner torch loader
samples of stream worker w    ``(seed, epoch, 3, w)``             per-worker iterables
window w of a shuffle buffer  ``(seed, epoch, 4, w)``             ``shuffle_buffer``
============================  ==================================  ==========================

The first three are unchanged since the first state format (version 1), so map-style and
global-cursor states of version 1 still resume exactly; the last two changed with version 2
(see ``unbroken.data.states``). Under a key, ``rng`` derives the global generators' seeds of
the batch starting at a position (``batch_seeds``) and of that batch's ``collate_fn`` call
(``collate_seeds``), a sample's ``sample_seed_at`` and its ``sample_rng()`` seed
(``sample_rng_seed``).
"""

from __future__ import annotations

_SHUFFLE, _TORCH_WORKERS, _STREAM_WORKER, _WINDOW = 1, 2, 3, 4
_U64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """SplitMix64's finalizer: a cheap, well-spread 64-bit hash of a Python int."""
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def derive_key(*parts: int) -> int:
    """Hash a tuple of ints in [0, 2**64) (seed, epoch, ...) into one 64-bit key."""
    return extend_key(0x6A09E667F3BCC908, *parts)


def extend_key(key: int, *parts: int) -> int:
    """Fold more ``parts`` into a key: ``extend_key(derive_key(*a), *b) == derive_key(*a, *b)``,
    so a prefix used many times (an epoch's) is derived once."""
    for part in parts:
        key = mix64(key ^ part)
    return key


def samples(seed: int, epoch: int) -> int:
    """The key of the batches' and samples' seeds along an epoch's global order."""
    return derive_key(seed, epoch)


def shuffle(seed: int, epoch: int) -> int:
    """The key of the epoch's per-index shuffle (``IndexShuffle``)."""
    return derive_key(seed, epoch, _SHUFFLE)


def torch_workers(seed: int, epoch: int) -> int:
    """The seed of the generator from which torch draws its workers' base seed."""
    return derive_key(seed, epoch, _TORCH_WORKERS)


def stream_worker(seed: int, epoch: int, worker: int) -> int:
    """The key of the per-item seeds of one worker's replica of an iterable dataset."""
    return derive_key(seed, epoch, _STREAM_WORKER, worker)


def window(seed: int, epoch: int, index: int) -> int:
    """The key of a shuffle buffer's permutation of one window."""
    return derive_key(seed, epoch, _WINDOW, index)
