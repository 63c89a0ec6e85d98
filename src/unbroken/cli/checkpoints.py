"""Finding a directory's checkpoints and checking each as ``load_latest`` would; what its
small entries say of where the run stands (the Trainer's counters, the loaders' cursors); the
damaged checkpoints moved aside beside them (``damaged``)."""

from __future__ import annotations

import json
import os
import re
from datetime import timezone
from typing import Any, TypedDict, cast

from ..checkpoint import layout
from ..checkpoint import verdict as quarantine
from ..checkpoint.fsspec_storage import is_url
from ..checkpoint.layout import MANIFEST, Manifest
from ..checkpoint.storage import Storage, basename, join, parent
from ..checkpoint.verdict import classify
from ..data.states import COMBINED, LOADER, RESUMABLE, SHUFFLE_BUFFER
from ..train.checkpointing import LOG, PROGRESS, TRAIN_LOADER, VAL_LOADER
from ..train.progress import COUNTERS, PHASES
from ..train.rundir import CHECKPOINTS as RUN_CHECKPOINTS

LOADER_FORMATS = (LOADER.name, COMBINED.name, RESUMABLE.name, SHUFFLE_BUFFER.name)
# Entries read to find positions: the Trainer's always, others only if this small (a loader's
# state is a few hundred bytes; a model's is not worth unpickling to find none).
ALWAYS_READ = (PROGRESS, TRAIN_LOADER, VAL_LOADER)
READ_LIMIT = 1 << 20
_NESTING = 4  # how deep inside a dict entry loader states are looked for
_NAMED = re.compile(r"(?:\.old-)?step-(\d+)(?:-[0-9a-f]+)?")

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE = 0, 1, 2


class Position(TypedDict):
    epoch: int
    phase: str | None
    batch: int
    sample: int | None
    optimizer_step: int | None
    source: str


class CheckpointReport(TypedDict):
    name: str
    path: str
    step: int
    written: str | None
    bytes: int
    verified: bool
    status: str
    problems: list[str]
    world_size: int | None
    entries: list[str] | None
    position: Position | None
    loaders: list[LoaderReport]
    log_bytes: int | None
    log_sha256: str | None


class LoaderReport(TypedDict, total=False):
    name: str
    format: str
    version: int
    seed: int
    mode: str
    epoch: int
    batches: int
    samples: int
    items: int
    loaders: list[LoaderReport]


class Resume(TypedDict):
    checkpoint: str | None
    step: int | None
    skipped: list[str]
    fails: str | None
    position: Position | None
    loaders: list[LoaderReport]
    summary: str


class LogReport(TypedDict):
    path: str
    bytes: int | None
    expected: int
    sha256: str | None
    ok: bool
    problem: str | None


class DamagedReport(TypedDict):
    name: str
    path: str
    checkpoint: str | None
    moved: str | None
    problems: list[str]


class Report(TypedDict):
    command: str
    directory: str
    kind: str
    checkpoints_directory: str
    checkpoints: list[CheckpointReport]
    newest: str
    ok: bool
    resume: Resume
    log: LogReport | None
    damaged: list[DamagedReport]


class UsageError(Exception):
    """Nothing to report on: exit status 2, with this message."""


# ------------------------------------------------------------------------------ finding them


def locate(directory: str, storage: Storage) -> tuple[str, str, list[tuple[int, str]]]:
    """``(kind, the directory holding the checkpoints, [(step, path)] oldest first)``; a local
    path or a URL, read through ``storage``."""
    if not storage.exists(directory):
        raise UsageError(f"{directory}: no such directory")
    if not storage.is_directory(directory):
        raise UsageError(f"{directory} is not a directory")
    named = _NAMED.fullmatch(basename(directory))
    if named or storage.exists(join(directory, MANIFEST)):
        step = int(named.group(1)) if named else _manifest_step(storage, directory)
        return "checkpoint", parent(directory), [(step, directory)]
    found = layout.candidates(storage, directory)
    if found:
        return "checkpoints", directory, found
    inside = join(directory, RUN_CHECKPOINTS)
    found = layout.candidates(storage, inside)
    if found:
        return "run", inside, found
    if storage.is_directory(inside):
        raise UsageError(
            f"no checkpoints found in the run directory {directory}: {inside} holds no step-* "
            "checkpoint directory"
        )
    raise UsageError(
        f"no checkpoints found in {directory}: it is neither a run directory (with "
        f"{RUN_CHECKPOINTS}/ inside), a checkpoint directory (with step-* directories), a "
        f"checkpoint (with {MANIFEST}), nor, on a local disk, a Hugging Face output directory "
        "or checkpoint (checkpoint-<step> folders with unbroken-seal.json or trainer_state.json)"
    )


def damaged(storage: Storage, root: str) -> list[DamagedReport]:
    """The checkpoints moved aside from ``root`` as damaged (``checkpoint.verdict``), the
    oldest moved first: out of a resume's view, so listed, never judged again."""
    return [
        DamagedReport(
            name=found.name,
            path=found.path if is_url(found.path) else os.path.abspath(found.path),
            checkpoint=found.checkpoint,
            moved=found.moved,
            problems=list(found.problems),
        )
        for found in quarantine.listed(storage, root)
    ]


def _manifest_step(storage: Storage, directory: str) -> int:
    """The step a checkpoint directory not named ``step-*`` says it holds (0 if unreadable:
    its verification then says what is wrong)."""
    try:
        with storage.open_read(join(directory, MANIFEST)) as opened:
            step = json.loads(opened.read()).get("step")
    except (OSError, ValueError, AttributeError, RecursionError):
        return 0
    return step if type(step) is int and step >= 0 else 0


# ------------------------------------------------------------------------------- checking one


def check(storage: Storage, path: str, step: int, read_states: bool) -> CheckpointReport:
    """One checkpoint: judged as ``load_latest`` judges it (``checkpoint.verdict.classify``), and
    (``read_states``) where it stands, from its small entries whose files verified; always,
    the size of the Trainer's log that it records and the sha256 of those bytes (``log_bytes``,
    ``log_sha256``: what a resume needs)."""
    states: dict[str, Any] = {}

    def keep(manifest: Manifest, name: str, file: str, value: Any) -> None:
        spec = manifest["entries"][name]
        first = spec["file"] if "file" in spec else spec.get("ranks", [""])[0]  # rank 0's part
        wanted = name in ALWAYS_READ or manifest["files"][file]["size"] <= READ_LIMIT
        if file == first and ((read_states and wanted) or name == LOG):
            states[name] = value

    verdict = classify(storage, path, step, keep)
    log = states.pop(LOG, None)  # what a resume needs of the run's log: no position
    log_bytes = log.get("bytes") if isinstance(log, dict) else None
    log_sha256 = log.get("sha256") if isinstance(log, dict) else None
    manifest = verdict.manifest
    return CheckpointReport(
        name=basename(path),
        path=path if is_url(path) else os.path.abspath(path),
        step=step,
        written=_written(storage, join(path, MANIFEST)),
        bytes=_size(storage, path),
        verified=verdict.ok,
        status=verdict.status,
        problems=list(verdict.problems),
        world_size=manifest["world_size"] if manifest is not None else None,
        entries=list(manifest["entries"]) if manifest is not None else None,
        position=_position(states),
        loaders=loaders(states),
        log_bytes=log_bytes if type(log_bytes) is int else None,
        log_sha256=log_sha256 if isinstance(log_sha256, str) else None,
    )


def _written(storage: Storage, manifest: str) -> str | None:
    """The store's time of the seal (a file's mtime on a disk), in UTC."""
    try:
        when = storage.stat(manifest).modified
    except (OSError, ValueError):
        return None
    return str(when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))


def _size(storage: Storage, directory: str) -> int:
    try:
        return storage.tree_size(directory)
    except OSError:
        return 0


def _is_progress(value: Any) -> bool:
    """Whether ``value`` is the Trainer's ``Progress`` state (its loop counters)."""
    return (
        isinstance(value, dict)
        and all(type(value.get(name)) is int for name in COUNTERS)
        and value.get("phase") in PHASES
    )


def _is_loader(value: Any) -> bool:
    return isinstance(value, dict) and value.get("format") in LOADER_FORMATS


def loaders(states: dict[str, Any]) -> list[LoaderReport]:
    """The cursors of every loader state among ``states`` (entries, or dicts inside them)."""
    found: list[LoaderReport] = []

    def visit(name: str, value: Any, depth: int) -> None:
        if _is_loader(value):
            found.append(_loader(name, value))
        elif isinstance(value, dict) and depth < _NESTING and not _is_progress(value):
            for key, item in value.items():
                visit(f"{name}.{key}", item, depth + 1)

    for name, value in states.items():
        visit(name, value, 0)
    return found


def _loader(name: str, state: dict[str, Any]) -> LoaderReport:
    report: dict[str, Any] = {"name": name}
    for field in ("format", "version", "seed", "mode", "epoch", "batches", "samples", "items"):
        value = state.get(field)
        if type(value) is (str if field in ("format", "mode") else int):
            report[field] = value
    children = state.get("loaders")
    if state.get("format") == COMBINED.name and isinstance(children, list):
        keys = state.get("keys")
        names = keys if isinstance(keys, list) else list(range(len(children)))
        report["loaders"] = [
            _loader(f"{name}[{key}]", child["state"])
            for key, child in zip(names, children)
            if isinstance(child, dict) and _is_loader(child.get("state"))
        ]
    return cast(LoaderReport, report)


def _position(states: dict[str, Any]) -> Position | None:
    """Where a resume from these states continues: the Trainer's counters if there are any,
    else the first loader's cursor (the train loader's, if it is named so)."""
    found = loaders(states)
    by_name = {loader["name"]: loader for loader in found}
    progress = states.get(PROGRESS)
    if not _is_progress(progress):
        progress = next((value for value in states.values() if _is_progress(value)), None)
    if progress is not None:
        phase = progress["phase"]
        batch = progress["val_batches"] if phase == "val" else progress["epoch_batches"]
        loader = by_name.get(VAL_LOADER if phase == "val" else TRAIN_LOADER, {})
        return Position(
            epoch=progress["epoch"],
            phase=phase,
            batch=batch,
            sample=loader.get("samples"),
            optimizer_step=progress["steps"],
            source=PROGRESS,
        )
    first = by_name.get(TRAIN_LOADER) or next(
        (loader for loader in found if "epoch" in loader and "batches" in loader), None
    )
    if first is None or "epoch" not in first or "batches" not in first:
        return None
    return Position(
        epoch=first["epoch"],
        phase=None,
        batch=first["batches"],
        sample=first.get("samples"),
        optimizer_step=None,
        source=first["name"],
    )
