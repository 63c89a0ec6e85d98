"""torch's own checks of a DataLoader's arguments, made by torch.

``unbroken.DataLoader`` takes torch's arguments and must refuse what torch refuses, with torch's
exception and message (code and tests written for torch's loader match on them). Rather than
copy those checks, which change between torch releases, the loader builds a torch DataLoader
from the very arguments it was given and lets it refuse them: that builds samplers and starts
no worker. Only then does it check what is its own (``in_order=False``, ``seed``, ...). One
refusal is not taken: an empty dataset with ``shuffle=True`` (see below).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import IterableDataset

from .sources.streams import is_stream


def refuse_what_torch_refuses(dataset: Any, **arguments: Any) -> None:
    """Raise what ``torch.utils.data.DataLoader(dataset, **arguments)`` raises, if anything.

    An iterable that is not an ``IterableDataset`` (``unbroken.shuffle_buffer``, ``resumable``)
    is left to unbroken's checks: torch would take it for a map-style dataset."""
    if is_stream(dataset) and not isinstance(dataset, IterableDataset):
        return
    if arguments.get("shuffle") and _empty(dataset):
        # torch's RandomSampler refuses an empty dataset when it is built; unbroken orders the
        # dataset's length at each epoch's start (it may grow), so it takes an empty one.
        arguments = {**arguments, "shuffle": False}
    with warnings.catch_warnings():
        # Its warnings (too many workers, ...) come from the loader that runs, not this one.
        warnings.simplefilter("ignore")
        torch.utils.data.DataLoader(dataset, **arguments)


def _empty(dataset: Any) -> bool:
    try:
        return len(dataset) == 0
    except TypeError:
        return False
