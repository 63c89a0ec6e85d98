"""Hugging Face checkpoint folders for ``inspect``/``verify``: found, checked against their seal.

transformers' Trainer writes ``checkpoint-<step>/`` folders into its output directory;
``unbroken.hf.Trainer`` seals each once every rank has written (``unbroken.hf.seal``). A folder
is judged as that Trainer's resume judges it: ``ok`` when its seal holds (every listed file
there, with its size and sha256: each file is read once), ``unsealed`` without a seal (a save
that did not finish, or one that no ``unbroken.hf`` code sealed), ``damaged`` when the seal
does not hold. ``inspect`` also reads two small JSON files of a sealed folder: the global step
in ``trainer_state.json`` and rank 0's loader state in ``unbroken-state-rank0.json``.
Local paths only: ``unbroken.hf.seal`` reads the folder with ``os``.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from typing import Any

from ..checkpoint.local import LocalStorage
from ..hf.seal import SEAL, checkpoints
from ..hf.seal import check as check_seal
from ..hf.state import FORMAT as STATE_FORMAT
from ..hf.state import state_file
from .checkpoints import CheckpointReport, Position, _size, loaders

HF_RUN, HF_CHECKPOINT = "hf-run", "hf-checkpoint"
KINDS = (HF_RUN, HF_CHECKPOINT)
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
RANK0_STATE = state_file(0)  # what unbroken.hf.Trainer writes next to it
LOADER = "train_loader"  # the name the report gives the state's "loader"
_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR
_NAMED = re.compile(re.escape(_PREFIX) + r"-(\d+)")
_READ_LIMIT = 1 << 20  # a state file is a few kilobytes; anything larger is not one


def locate(directory: str) -> tuple[str, str, list[tuple[int, str]]] | None:
    """``(kind, the directory holding the folders, [(step, path)] oldest first)`` for a Hugging
    Face output directory or one of its checkpoint folders; ``None`` when ``directory`` is
    neither.

    A ``checkpoint-<step>`` folder is recognised by its seal or ``trainer_state.json``, or, with
    neither (a save killed early), by a sibling that has one; a folder of another name by its
    seal. An output directory holds at least one recognised ``checkpoint-<step>`` folder; every
    ``checkpoint-<step>`` folder in it is reported."""
    if not os.path.isdir(directory):
        return None
    parent = os.path.dirname(os.path.abspath(directory))
    named = _NAMED.fullmatch(os.path.basename(os.path.abspath(directory)))
    sealed = os.path.isfile(os.path.join(directory, SEAL))
    if sealed or (named and (_marked(directory) or _is_run(parent))):
        step = int(named.group(1)) if named else _global_step(directory)
        return HF_CHECKPOINT, parent, [(step or 0, directory)]
    if _is_run(directory):
        return HF_RUN, directory, sorted(checkpoints(directory, _PREFIX))
    return None


def _marked(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in (SEAL, TRAINER_STATE))


def _is_run(directory: str) -> bool:
    return any(_marked(path) for _, path in checkpoints(directory, _PREFIX))


def check(path: str, step: int, read_states: bool) -> CheckpointReport:
    """One folder, judged by ``unbroken.hf.seal.check`` (sizes and sha256); with
    ``read_states``, where a sealed one stands (nothing is read from a folder that is not)."""
    verdict = check_seal(path)
    problems = [verdict.reason()] if verdict.status == "unsealed" else list(verdict.problems)
    state = _json(os.path.join(path, RANK0_STATE)) if verdict.sealed else None
    if not (isinstance(state, dict) and state.get("format") == STATE_FORMAT):
        state = None
    world_size = state.get("world_size") if state is not None else None
    found = []
    position = None
    if read_states and state is not None and isinstance(state.get("loader"), dict):
        found = loaders({LOADER: state["loader"]})
        position = _position(found, _json(os.path.join(path, TRAINER_STATE)), state)
    return CheckpointReport(
        name=os.path.basename(os.path.abspath(path)),
        path=os.path.abspath(path),
        step=step,
        written=_written(os.path.join(path, SEAL)),
        bytes=_size(LocalStorage(), path),
        verified=verdict.sealed,
        status={"sealed": "ok"}.get(verdict.status, verdict.status),
        problems=problems,
        world_size=world_size if type(world_size) is int else None,
        entries=_files(path),
        position=position,
        loaders=found,
        log_bytes=None,
        log_sha256=None,
    )


def no_resume(kind: str, root: str, checked: list[CheckpointReport]) -> str:
    """Why ``unbroken.hf.Trainer`` would raise rather than resume: no folder is sealed."""
    if kind == HF_CHECKPOINT:
        return (
            f"unbroken.hf.Trainer refuses to resume from {checked[0]['path']} ("
            f"{checked[0]['problems'][0]}); resume_from_checkpoint=True takes the newest sealed "
            "checkpoint in the output directory"
        )
    return (
        f"no checkpoint-<step> folder in {os.path.abspath(root)} is sealed, so "
        "unbroken.hf.Trainer's resume_from_checkpoint=True raises; train without it to start "
        "afresh"
    )


def _position(found: list[Any], trainer_state: Any, state: dict[str, Any]) -> Position | None:
    """Where a resume continues: the loader's cursor, and the global step of
    ``trainer_state.json`` (else of the unbroken state)."""
    loader = found[0] if found else {}
    if "epoch" not in loader or "batches" not in loader:
        return None
    step = trainer_state.get("global_step") if isinstance(trainer_state, dict) else None
    step = step if type(step) is int else state.get("global_step")
    return Position(
        epoch=loader["epoch"],
        phase=None,
        batch=loader["batches"],
        sample=loader.get("samples"),
        optimizer_step=step if type(step) is int else None,
        source=RANK0_STATE,
    )


def _global_step(folder: str) -> int | None:
    state = _json(os.path.join(folder, TRAINER_STATE))
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if type(step) is int and step >= 0 else None


def _json(path: str) -> Any:
    """A small JSON file's content, or ``None`` if it is missing, too large or not JSON."""
    try:
        if os.path.getsize(path) > _READ_LIMIT:
            return None
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError, RecursionError):
        return None


def _written(path: str) -> str | None:
    try:
        when = datetime.fromtimestamp(os.stat(path).st_mtime, timezone.utc)
    except OSError:
        return None
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _files(folder: str) -> list[str]:
    found = []
    for root, directories, names in os.walk(folder):
        directories.sort()
        for name in sorted(names):
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != SEAL:
                found.append(relative)
    return found
