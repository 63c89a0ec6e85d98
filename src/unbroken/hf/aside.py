"""What a resume does with the ``checkpoint-<step>`` folders newer than the one it resumed.

Each is judged by its seal (``seal.check``). A *damaged* one (a seal whose files changed or went
missing) is evidence of what damaged it: it is moved into ``<output_dir>/damaged/``
(``unbroken.checkpoint.verdict``: the newest 3 stay there, ``unbroken verify`` lists them),
never deleted. An *unsealed* one is a save that never finished (a process killed mid-save, the
expected end of a preemption): nothing in it is evidence, so it is removed. A *sealed* one is
whole, newer than a checkpoint the user chose to resume from: the resumed run writes its step
again, so it is removed too.

Rotation (``seal.prune``, which keeps the newest sealed folders) moves a folder it judges
damaged by its sizes aside in the same way.

Costs: a rename per damaged folder; a seal check by sizes (no file read) of a folder not judged
yet.
"""

from __future__ import annotations

import logging
import os
import shutil

from ..checkpoint.local import LocalStorage
from ..checkpoint.verdict import move_aside
from .seal import Verdict, check

log = logging.getLogger(__name__)


def put_aside(directory: str, folder: str, verdict: Verdict | None = None) -> str | None:
    """Move ``folder`` aside if damaged, else remove it (see the module).

    Args:
        directory: The output directory holding ``folder``.
        folder: A checkpoint folder newer than the one resumed.
        verdict: What ``seal.check`` found of it; ``None``: checked now, by sizes.

    Returns:
        Where a damaged folder is now; ``None`` if it was removed.
    """
    verdict = verdict if verdict is not None else check(folder, hashes=False)
    if verdict.status == "damaged":
        return move_aside(LocalStorage(), directory, folder, verdict.problems)
    why = "its save did not finish" if verdict.status == "unsealed" else "it is sealed"
    log.warning("removing %s, newer than the checkpoint resumed (%s)", folder, why)
    shutil.rmtree(folder, ignore_errors=True)
    return None


def judged(verdicts: list[Verdict]) -> dict[str, Verdict]:
    """``verdicts`` by the real path of their folder."""
    return {os.path.realpath(verdict.folder): verdict for verdict in verdicts}
