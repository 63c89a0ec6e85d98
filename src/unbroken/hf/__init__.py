"""Exact resume inside Hugging Face ``transformers.Trainer`` and Accelerate (extra ``[hf]``).

- ``Trainer``: ``transformers.Trainer`` whose training data comes from an
  ``unbroken.DataLoader``, whose checkpoints are sealed, and whose resume continues exactly;
  ``ExactResumeMixin`` gives the same to a subclass of ``transformers.Trainer`` of your own
  (module ``trainer``; ``callback``: the callback doing the work; ``loader``: the training loader
  as transformers sees it; ``state``: what a checkpoint folder gets; ``internals``: what is
  touched of transformers beyond its public API; ``aside``: what a resume does with the folders
  newer than the one it resumed).
- ``seal``, ``check``, ``last_sealed``: checkpoint folders written whole or ignored (``seal``),
  for the Trainer's checkpoints and for ``accelerate.Accelerator.save_state`` folders.
- ``accelerate``: ``save_state`` / ``load_state`` for a loop of your own with
  Accelerate: sealed ``checkpoint-<step>`` folders, the newest sealed one loaded
  (``docs/accelerate.md``).

``unbroken.hf.seal`` needs neither transformers nor Accelerate; ``Trainer`` imports transformers
when first used.
"""

from __future__ import annotations

from typing import Any

from .seal import UnsealedCheckpointWarning, Verdict, check, last_sealed, seal

__all__ = [
    "ExactResumeMixin",
    "Trainer",
    "UnsealedCheckpointWarning",
    "Verdict",
    "check",
    "last_sealed",
    "seal",
]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "ExactResumeMixin"):
        from . import trainer  # imports transformers: only when asked for

        return getattr(trainer, name)
    raise AttributeError(f"module 'unbroken.hf' has no attribute {name!r}")
