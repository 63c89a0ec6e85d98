"""The per-batch path of ``unbroken.DataLoader`` without workers runs a fixed, small set of
unbroken's own Python functions: a guard against per-batch work creeping in, counted (not
timed, so it holds on a loaded machine). ``benchmarks/loader_tiny.py`` times the same path in a
training loop."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

import unbroken

PACKAGE = str(Path(unbroken.__file__).parent)
BATCHES = 20


def own_calls(loader) -> Counter:
    """Calls of unbroken's own Python functions (file:function) over ``BATCHES`` batches of an
    iteration already started, so the epoch's set-up is left out."""
    iterator = iter(loader)
    next(iterator)
    calls: Counter = Counter()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE):
            calls[f"{Path(code.co_filename).name}:{code.co_name}"] += 1

    previous = sys.getprofile()  # a profiler the run is under gets its hook back
    sys.setprofile(profile)
    try:
        for _ in range(BATCHES):
            next(iterator)
    finally:
        sys.setprofile(previous)
    return calls


# The shuffle computes a block of 64 batches' indices at once: those calls come once per block.
PER_BLOCK = {"bijection.py:range", "bijection.py:at", "bijection.py:_encrypt"}


@pytest.mark.parametrize(
    ("global_rngs", "most"), [(("torch", "numpy", "random"), 12), ((), 10)], ids=["all", "none"]
)
@pytest.mark.parametrize("collate_fn", [None, default_collate], ids=["implicit", "explicit"])
def test_calls_per_batch(global_rngs, most, collate_fn) -> None:
    data = torch.randn(256, 4)
    loader = unbroken.DataLoader(
        data, batch_size=2, shuffle=True, seed=0, global_rngs=global_rngs, collate_fn=collate_fn
    )
    calls = own_calls(loader)
    per_batch = {name: n / BATCHES for name, n in calls.items() if name not in PER_BLOCK}
    assert sum(per_batch.values()) <= most, per_batch
    # torch's collate draws nothing: the generators are seeded once a batch, for its samples.
    assert per_batch["rng.py:seed"] == 1, per_batch
