"""The type checks every part's argument and state validation makes: a ``bool`` is an ``int``
to Python, but ``True`` is never a valid count, size, seed or timeout."""

from __future__ import annotations

from typing import Any, TypeGuard


def is_int(value: Any) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> TypeGuard[int | float]:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


SEED_LIMIT = 1 << 64  # seeds are unsigned 64-bit keys (data.keys)


def check_seed(name: str, value: Any) -> None:
    """A seed: an int in [0, 2**64), or a ``ValueError`` naming ``name``."""
    if not is_int(value) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")


def check_keep(name: str, value: Any) -> None:
    """How many committed checkpoints to keep: two at least, or a ``ValueError``."""
    if not is_int(value) or value < 2:
        raise ValueError(
            f"{name} must be an int >= 2, got {value!r}: with a single checkpoint, one that is "
            "corrupted (a disk error, a truncated copy) leaves nothing to resume from"
        )
