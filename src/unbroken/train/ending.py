"""How ``Trainer.fit`` ends: its clean-up, which never hides the error that ended it, and the
one line that says how the run ended.

``close`` waits for the background save and closes the logs (uploading them, for a run
directory at a URL). When ``fit`` is failing already, a failure of the clean-up is added to
that error as a note (Python 3.11+; logged at ERROR on 3.10), never raised in its place: the
user sees the cause (a resume that met a frozen store says nothing was skipped or deleted)
first. A process that logged nothing leaves the store's ``metrics.csv`` as it was.

``summary`` is the last line's body: epochs, optimizer steps and the final checkpoint, said as
``finished: ...`` after training, or ``already complete: ...`` by a rerun that had nothing to
train. Costs: nothing per step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from .._log import logger
from ..checkpoint.layout import final_name
from ..checkpoint.manager import Checkpointer
from ..checkpoint.storage import join
from .csvlog import RunLog
from .progress import Progress

# What a rerun of a finished run says after its summary.
NOTHING_TO_TRAIN = (
    "nothing to train (raise max_epochs or max_steps to train on, or train in a new directory)"
)


def close(checkpointer: Checkpointer, run_log: RunLog, failed: BaseException | None) -> None:
    """The end of a fit: the background save waited for, the logs closed (uploaded, for a URL).

    Args:
        checkpointer: The run's checkpointer.
        run_log: The run's logs.
        failed: The error ending the fit, if any: kept (see ``clean_up``).

    Raises:
        Exception: without ``failed``, what the background save or the upload raised.
    """
    if run_log.rows == 0 and run_log.csv is not None:
        # Nothing logged: a start that failed before its first batch (a resume that met a
        # frozen store) or a run already complete. This process has nothing to add to the
        # store's copy, and an upload to a store that just failed would fail again.
        run_log.csv.publish = None
    clean_up((checkpointer.close, run_log.close), failed)


def clean_up(steps: Iterable[Callable[[], object]], failed: BaseException | None) -> None:
    """Run every step of a clean-up, each even when one before it failed.

    Args:
        steps: The clean-up's steps, in order.
        failed: The error already on its way out, if any. It stays the error: a step's own
            failure is added to it as a note (Python 3.11+; logged at ERROR on 3.10), never
            raised in its place, so the user sees the cause first.

    Raises:
        Exception: without ``failed``, the first step's failure (the later ones noted on it).
    """
    first = failed
    for step in steps:
        try:
            step()
        except Exception as error:
            if first is None:
                first = error
                continue
            failure = f"{type(error).__name__}: {error}"
            if sys.version_info >= (3, 11):
                first.add_note(f"then, cleaning up after it: {failure}")
            else:  # no notes: said before the error's traceback
                logger.error(f"cleaning up after {type(first).__name__} ({first}): {failure}")
    if first is not None and first is not failed:
        raise first


def summary(progress: Progress, max_steps: int | None, directory: str) -> str:
    """Epochs, optimizer steps and the final checkpoint of a loop that ended.

    Args:
        progress: The loop's counters at its end.
        max_steps: The Trainer's ``max_steps`` (said when it ended the loop).
        directory: The checkpoints' directory.

    Returns:
        ``"3 epochs, 48 optimizer steps; final checkpoint runs/exp1/checkpoints/step-000000054"``.
    """
    epochs = f"{progress.epoch} epoch{'s' * (progress.epoch != 1)}"
    steps = f"{progress.steps} optimizer step{'s' * (progress.steps != 1)}"
    reached = max_steps is not None and progress.steps >= max_steps
    why = f" (max_steps={max_steps} reached)" if reached else ""
    # The last save is at the loop's end, named by its tick (a rerun's: the one restored).
    final = join(directory, final_name(progress.ticks))
    return f"{epochs}, {steps}{why}; final checkpoint {final}"
