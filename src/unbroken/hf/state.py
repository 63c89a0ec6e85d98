"""What ``unbroken.hf.Trainer`` adds to a transformers checkpoint folder, named once.

Each rank r writes ``unbroken-state-rank<r>.json``::

    {"format": "unbroken.hf.TrainerState", "version": 1, "rank": 0, "world_size": 2,
     "global_step": 40,
     "loader": <unbroken.DataLoader.state_dict()>,
     "logging": {"tr_loss": 1.38, "tr_loss_dtype": "float32", "globalstep_last_logged": 35}}

``logging`` is this rank's loss summed since the last log (``internals``). The CLI reads these
files too, without importing transformers: this module imports nothing of it.
"""

from __future__ import annotations

FORMAT = "unbroken.hf.TrainerState"
VERSION = 1


def state_file(rank: int) -> str:
    """The name of rank ``rank``'s state file in a checkpoint folder."""
    return f"unbroken-state-rank{rank}.json"
