"""Resumable data: loaders whose position is a few integers, and the pieces they are built from.

- ``loader``: ``DataLoader``, its attributes and state; it runs torch's loader (``inner``) around
  a *source* of batches (the subpackage ``sources``: map-style orders, samplers, iterable
  datasets, a rank's share; one class each, registered in ``sources.SOURCES``), resumed in
  O(1); ``iterator``: what ``iter(loader)`` returns; ``torch_api``: torch's arguments and
  attributes, both ways (argument checks, samplers taken in and shown, the seed's draw).
- ``epochs``: the epoch protocol every resumable iterable here shares (``iter()`` continues a
  loaded epoch or starts the next, a ``break`` ends it, ``set_epoch``).
- ``combined`` (with its checks), ``iterable`` (``resumable``), ``buffered_shuffle``
  (``shuffle_buffer``): iterables built on that protocol.
- ``rng`` and ``bijection``: per-batch and per-sample randomness and the per-index shuffle, pure
  functions of (seed, epoch, position); ``keys``: the seed derivation (``derive_key``) and its
  named keys; ``states``: every state's schema; ``workers``: what DataLoader workers do with
  preemption signals.

Importing it imports torch; nothing runs at import time.
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
