"""Resumable data: loaders whose position is a few integers, and the pieces they are built from.

- ``loader``: ``DataLoader``, torch's loader around a *source* of batches (the subpackage
  ``sources``: map-style orders, samplers, iterable datasets, a rank's share; one table picks
  one), resumed in O(1); ``iterator``: what ``iter(loader)`` returns; ``views``: torch's
  sampler attributes onto the loader's order; ``arguments``: torch's argument checks.
- ``epochs``: the epoch protocol every resumable iterable here shares (``iter()`` continues a
  loaded epoch or starts the next, a ``break`` ends it, ``set_epoch``).
- ``combined``, ``iterable`` (``resumable``), ``shuffling`` (``shuffle_buffer``): iterables
  built on that protocol.
- ``rng`` and ``shuffle``: per-batch and per-sample randomness and the per-index shuffle, pure
  functions of (seed, epoch, position); ``workers``: what DataLoader workers do with preemption signals.
"""

from .buffered_shuffle import ShuffleBuffer, shuffle_buffer
from .combined import CombinedLoader
from .iterable import Resumable, resumable
from .loader import DataLoader
from .rng import sample_rng, sample_seed

__all__ = [
    "CombinedLoader",
    "DataLoader",
    "Resumable",
    "ShuffleBuffer",
    "resumable",
    "sample_rng",
    "sample_seed",
    "shuffle_buffer",
]
