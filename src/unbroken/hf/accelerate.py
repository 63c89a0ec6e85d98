"""Sealed ``Accelerator.save_state`` folders, and a resume from the newest whole one.

Accelerate writes a checkpoint file by file and marks nothing complete, so a process killed
inside ``save_state`` leaves a folder that ``load_state`` crashes on, or half loads. These two
functions put that folder under a seal (``unbroken.hf.seal``):

- ``save_state(accelerator, directory, step)`` saves into ``directory/checkpoint-<step>``,
  waits for every process to write its files, then seals the folder and keeps the newest
  ``keep`` sealed ones;
- ``load_state(accelerator, directory)`` loads the newest sealed ``checkpoint-<step>``, skips
  newer unsealed or damaged ones with a warning naming each, removes the unsealed ones, moves
  the damaged ones aside (``aside``), and returns the step
  (0 when the directory holds no checkpoint yet: the job's first run).

They take any object with Accelerate's ``save_state``, ``load_state``, ``wait_for_everyone``,
``is_main_process``, ``is_local_main_process`` and ``project_configuration``; nothing here
imports Accelerate. The exact data position comes from an ``unbroken.DataLoader`` registered
with ``accelerator.register_for_checkpointing`` and kept out of ``accelerator.prepare``
(docs/accelerate.md says why).

Under ``torchrun --max-restarts``, the process group must come from
``unbroken.distributed.init_process_group``, called before the Accelerator is built. Accelerate
calls torch's own when it finds none, and a restarted attempt's gloo group then reads the
addresses of the dead attempt's processes from torchrun's store: the restart fails with
"connectFullMesh failed" or hangs. Both functions refuse such a group, on the first attempt
already, with a ``RuntimeError`` that names the fix.

Cost: on top of Accelerate's own save, one read of every file of the folder (sha256, fsync) on
the process that seals, two barriers per save, and a sha256 of the folders checked at resume.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from ..distributed.process_group import refuse_unrestartable_group
from .aside import put_aside
from .seal import UnsealedCheckpointWarning, prune, resume_point, seal

log = logging.getLogger(__name__)
PREFIX = "checkpoint"


def save_state(accelerator: Any, directory: str, step: int, keep: int | None = None) -> str:
    """``accelerator.save_state`` into ``directory/checkpoint-<step>``, sealed once whole.

    Call it on every process, after an optimizer step (``accelerator.sync_gradients``): the
    gradients of an open accumulation window are not saved. ``keep`` sealed checkpoints are
    kept (all when None); older ones are removed only after the new one is sealed. Returns the
    folder.

    Raises:
        ValueError: the Accelerator names its checkpoints itself
            (``ProjectConfiguration(automatic_checkpoint_naming=True)``).
        RuntimeError: under ``torchrun --max-restarts``, the process group was not started by
            ``unbroken.distributed.init_process_group``: a restart could not start it again.
    """
    _refuse_automatic_naming(accelerator)
    _refuse_unrestartable_group()
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 (or None to keep all), got {keep}")
    folder = os.path.join(directory, f"{PREFIX}-{step}")
    accelerator.save_state(folder)
    accelerator.wait_for_everyone()  # every process's random states are in the folder
    if _writes(accelerator):
        seal(folder)
        if keep is not None:
            for removed in prune(directory, keep, step, PREFIX):
                log.info("removing %s (keep=%d)", removed, keep)
    accelerator.wait_for_everyone()  # no process goes on (or dies) believing an unsealed save
    return folder


def load_state(accelerator: Any, directory: str) -> int:
    """Load the newest sealed ``checkpoint-<step>`` of ``directory``; return its step.

    Returns 0, loading nothing, when ``directory`` holds no checkpoint folder. Folders newer
    than the one loaded are unsealed or damaged: each is named in an
    ``UnsealedCheckpointWarning`` (on the main process). An unsealed one is removed, since the
    resumed run writes it again; a damaged one is moved into ``directory/damaged/``, never
    deleted (``unbroken.hf.aside``).

    Raises:
        CorruptCheckpoint: checkpoint folders exist but none is sealed and whole.
        RuntimeError: under ``torchrun --max-restarts``, the process group was not started by
            ``unbroken.distributed.init_process_group``: a restart could not start it again.
    """
    _refuse_automatic_naming(accelerator)
    _refuse_unrestartable_group()
    with warnings.catch_warnings():
        if not accelerator.is_main_process:  # one warning per job, not one per process
            warnings.simplefilter("ignore", UnsealedCheckpointWarning)
        path, skipped = resume_point(directory, PREFIX)
    if path is None:
        log.info("no checkpoint in %s: training from the start", directory)
        return 0
    accelerator.load_state(path)
    accelerator.wait_for_everyone()  # every process chose and read before any folder goes
    if _writes(accelerator):
        for verdict in skipped:  # a damaged one is moved aside, never deleted (``aside``)
            put_aside(directory, verdict.folder, verdict)
    accelerator.wait_for_everyone()
    log.info("resumed from %s", path)
    return int(os.path.basename(path).rsplit("-", 1)[1])


def _writes(accelerator: Any) -> bool:
    """Whether this process seals and removes: the one Accelerate writes shared files on."""
    if accelerator.project_configuration.save_on_each_node:
        return bool(accelerator.is_local_main_process)
    return bool(accelerator.is_main_process)


def _refuse_automatic_naming(accelerator: Any) -> None:
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError(
            "unbroken.hf.accelerate names checkpoints checkpoint-<step> itself, and Accelerate's "
            "automatic_checkpoint_naming would ignore that name (and rotate folders before the "
            "new one is whole). Build the Accelerator without "
            "ProjectConfiguration(automatic_checkpoint_naming=True), and pass keep= to "
            "save_state instead of total_limit."
        )


def _refuse_unrestartable_group() -> None:
    refuse_unrestartable_group(
        "Accelerate (or your script)",
        "before building the Accelerator; Accelerate then uses that group",
    )
