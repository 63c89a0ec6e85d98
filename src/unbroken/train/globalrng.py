"""``GlobalRNG``: the training process's random generators as a checkpointable object.

Dropout, random masking and anything else random in the training loop draws from the
process-global generators: torch's CPU generator, every initialized CUDA device's, numpy's
legacy global ``RandomState`` and Python's ``random``. ``GlobalRNG().state_dict()`` captures
them all as tensors and plain values (what ``torch.load(weights_only=True)`` accepts), and
``load_state_dict`` puts them back, so the loop continues the same random stream after a resume.

Cost: numpy's and random's 624-word states dominate a capture or a restore (docs/benchmarks/unit-costs.md, rows
``globalrng_capture`` and ``globalrng_restore``).

``seed_step`` derives them instead: the Trainer seeds every generator before each optimizer
step's first batch (and each validation batch) from the seed, the phase, the epoch, the step
and the rank. A checkpoint taken at a step boundary then needs no rank's generator state: a
survivor can save for a rank that died (``train.jit``), and a job resumed on another number of
ranks draws what the new rank would have drawn. Cost: three seeds a step (torch's default
generator, numpy's and random's), a fraction of ``torch.manual_seed``, which seeds every backend
torch knows (rows ``seed_step`` and ``torch_manual_seed`` of the unit costs).
"""

from __future__ import annotations

import functools
import random
from typing import Any, cast

import numpy as np
import torch

from ..data.keys import derive_key, extend_key
from ..errors import CorruptState, StateMismatch

TRAIN, VAL = 1, 2  # the phase in a step's seed


class GlobalRNG:
    """Checkpoint entry for the process-global RNGs: ``{"rng": unbroken.GlobalRNG()}``."""

    def state_dict(self) -> dict:
        """Capture torch's, every initialized CUDA device's, numpy's and ``random``'s generators.

        Returns:
            Their states as tensors and plain values (``torch.load(weights_only=True)`` reads
            them).
        """
        legacy = cast("tuple[str, Any, int, int, float]", np.random.get_state(legacy=True))
        kind, keys, position, has_gauss, cached_gaussian = legacy
        version, words, gauss_next = random.getstate()
        state = {
            "torch": torch.get_rng_state(),
            "numpy": {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
            "random": {
                "version": version,
                "words": torch.tensor(words, dtype=torch.int64),
                "gauss_next": gauss_next,
            },
            # Only devices that were used: asking an uninitialized CUDA would initialize it.
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Put the generators back as ``state_dict()`` captured them.

        Args:
            state: What ``state_dict()`` returned.

        Raises:
            CorruptState: the state does not have the expected keys.
            StateMismatch: it holds another number of CUDA generators than this process sees.
        """
        expected = {"torch", "numpy", "random", "cuda"}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CorruptState(f"GlobalRNG state: expected the keys {sorted(expected)}, got {got}")
        numpy_state, random_state, cuda = state["numpy"], state["random"], state["cuda"]
        if cuda and len(cuda) != torch.cuda.device_count():
            raise StateMismatch(
                "GlobalRNG",
                "CUDA devices",
                len(cuda),
                torch.cuda.device_count(),
                message=(
                    f"GlobalRNG state holds {len(cuda)} CUDA generator states but this process "
                    f"sees {torch.cuda.device_count()} CUDA devices; resume on the same devices"
                ),
            )
        torch.set_rng_state(state["torch"])
        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["keys"].numpy().astype(np.uint32),
                numpy_state["position"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
        random.setstate(
            (
                random_state["version"],
                tuple(random_state["words"].tolist()),
                random_state["gauss_next"],
            )
        )
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


def seed_everything(seed: int) -> None:
    """Seed the process RNGs of a fresh run (a resume restores them from ``GlobalRNG``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@functools.lru_cache(maxsize=8)
def _phase_key(seed: int, phase: int, epoch: int) -> int:
    """``derive_key(seed, phase, epoch)``: the same for every step of a phase's epoch."""
    return derive_key(seed % 2**64, phase, epoch)


def seed_step(seed: int, phase: int, epoch: int, step: int, rank: int) -> None:
    """Seed the process RNGs for one step (``phase``: ``TRAIN`` or ``VAL``) of one rank, from
    ``derive_key(seed, phase, epoch, step, rank)``: the epoch's prefix is derived once."""
    key = extend_key(_phase_key(seed, phase, epoch), step, rank)
    random.seed(key)
    np.random.seed(key % 2**32)
    torch.default_generator.manual_seed(key % 2**63)
    if torch.cuda.is_initialized():  # a CUDA generator exists only once CUDA is used
        torch.cuda.manual_seed_all(key % 2**63)
