"""``unbroken inspect DIR`` and ``unbroken verify DIR``: what a run's checkpoints hold, and
whether a resume would find them whole.

``DIR`` is a run directory (``unbroken.Trainer``'s: its checkpoints are in ``DIR/checkpoints``),
a ``Checkpointer`` directory (one ``step-*`` subdirectory per checkpoint), or one checkpoint
directory. Nothing is changed on disk: leftovers of killed writers (``.tmp-*``) are ignored, and
a checkpoint moved aside (``.old-step-*``) is listed where ``load_latest`` would consider it.

A checkpoint *verifies* when its manifest is intact (its seal, its schema, every listed file
there with its size: ``manifest.read_manifest``), every listed file matches its sha256
(``manifest.verify_file``), and every file but DCP's shards loads with
``torch.load(weights_only=True)`` and fits its manifest entry (``manifest.load_file``,
``check_entry``): the checks with which ``Checkpointer.load_latest`` decides to skip a
checkpoint, so a file resealed over garbage or a pickle that would run code is reported as
corrupt, as ``load_latest`` would skip it. ``inspect`` also keeps the small entries, to find the
Trainer's loop counters (entry ``progress``) and the loaders' cursors (any saved
``unbroken.DataLoader``, ``CombinedLoader``, ``resumable`` or ``shuffle_buffer`` state, at the
top of an entry or nested in a dict); of a checkpoint saved by several ranks, rank 0's part.
``verify`` makes the same checks; it prints no positions.

Batches and samples are counts of what the user had received in the epoch (epochs count from
0), so "continue epoch 2 at batch 37" means 37 batches of epoch 2 were trained on and batch 37
(counting from 0) comes next.

Exit status: 0 when the newest checkpoint verifies (``inspect``: whenever checkpoints were
found); 1 (``verify``) when the newest checkpoint does not verify, even if an older one does;
2 for a usage error, a missing directory or no checkpoints found.

``--json`` prints one JSON document (``Report``) on stdout instead of the text::

    {"command": "inspect" | "verify",
     "directory": "<DIR as given>",
     "kind": "run" | "checkpoints" | "checkpoint",
     "checkpoints_directory": "<absolute path of the directory holding the checkpoints>",
     "checkpoints": [                       # oldest step first
        {"name": "step-000000120", "path": "<absolute path>", "step": 120,
         "written": "2025-01-31T12:00:00Z" | null,   # manifest.json's mtime, UTC
         "bytes": 123456,                            # every file under the directory
         "verified": true,
         "status": "ok" | "corrupt" | "unsupported", # unsupported: another format version
         "problems": ["000-model.pt does not match its sha256 in the manifest", ...],
         "world_size": 1 | null, "entries": ["model", "optimizer", ...] | null,
         "position": null | {"epoch": 2, "phase": "train" | "val" | "end" | null,
                             "batch": 37, "sample": 2368 | null,
                             "optimizer_step": 120 | null,
                             "source": "progress" | "<a loader's entry name>"},
         "loaders": [<loader>, ...]},                # the loaders' cursors, as below
        ...],
     "newest": "step-000000130",
     "ok": false,                            # the newest checkpoint verifies
     "resume": {"checkpoint": "step-000000120" | null,   # what load_latest would restore
                "step": 120 | null,
                "skipped": ["step-000000130"],           # newer ones it would skip as corrupt
                "fails": null | "<why load_latest would raise instead>",
                "position": <as above> | null,
                "loaders": [<loader>, ...],              # of the checkpoint it would load
                "summary": "resume would load checkpoint step-000000120 and ..."}}

    <loader>: {"name": "train_loader", "format": "unbroken.DataLoader", "version": 3,
               "seed": 0, "epoch": 2, "batches": 37, "samples": 2368}
               (the fields its state has: a CombinedLoader's "mode", and its children's in
               "loaders", named "train_loader[a]"; a resumable's "items")

``verify --json`` has the same shape, with every ``position`` null and every ``loaders`` empty. A usage
error prints ``{"command": ..., "directory": ..., "error": "<message>"}`` (and the message on
stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypedDict, cast

from ._units import human
from .checkpoint import layout
from .checkpoint.manifest import (
    MANIFEST,
    Manifest,
    check_entry,
    load_file,
    read_manifest,
    validate,
    verify_file,
)
from .checkpoint.storage import LocalStorage, Storage, join
from .data.states import COMBINED, LOADER, RESUMABLE, SHUFFLE_BUFFER
from .errors import CorruptCheckpoint, StateMismatch
from .train.checkpointing import PROGRESS, RUN_CHECKPOINTS, TRAIN_LOADER, VAL_LOADER
from .train.progress import COUNTERS, PHASES

__all__ = ["main"]

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


class Report(TypedDict):
    command: str
    directory: str
    kind: str
    checkpoints_directory: str
    checkpoints: list[CheckpointReport]
    newest: str
    ok: bool
    resume: Resume


class UsageError(Exception):
    """Nothing to report on: exit status 2, with this message."""


# ------------------------------------------------------------------------------ finding them


def locate(directory: Path, storage: Storage) -> tuple[str, Path, list[tuple[int, str]]]:
    """``(kind, the directory holding the checkpoints, [(step, path)] oldest first)``."""
    if not directory.exists():
        raise UsageError(f"{directory}: no such directory")
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory")
    named = _NAMED.fullmatch(directory.name)
    if named or (directory / MANIFEST).exists():
        step = int(named.group(1)) if named else _manifest_step(directory)
        return "checkpoint", directory.parent, [(step, str(directory))]
    found = layout.candidates(storage, str(directory))
    if found:
        return "checkpoints", directory, found
    inside = directory / RUN_CHECKPOINTS
    found = layout.candidates(storage, str(inside))
    if found:
        return "run", inside, found
    if inside.is_dir():
        raise UsageError(
            f"no checkpoints found in the run directory {directory}: {inside} holds no step-* "
            "checkpoint directory"
        )
    raise UsageError(
        f"no checkpoints found in {directory}: it is neither a run directory (with "
        f"{RUN_CHECKPOINTS}/ inside), a checkpoint directory (with step-* directories) nor a "
        f"checkpoint (with {MANIFEST})"
    )


def _manifest_step(directory: Path) -> int:
    """The step a checkpoint directory not named ``step-*`` says it holds (0 if unreadable:
    its verification then says what is wrong)."""
    try:
        step = json.loads((directory / MANIFEST).read_bytes()).get("step")
    except (OSError, ValueError, AttributeError, RecursionError):
        return 0
    return step if type(step) is int and step >= 0 else 0


# ------------------------------------------------------------------------------- checking one


def check(storage: Storage, path: str, step: int, read_states: bool) -> CheckpointReport:
    """One checkpoint: verified as ``load_latest`` verifies it, and (``read_states``) where it
    stands, from its small entries whose files verified."""
    problems: list[str] = []
    status = "ok"
    manifest: Manifest | None = None
    try:
        manifest = read_manifest(storage, path, step)
    except CorruptCheckpoint as error:
        problems.append(str(error))
        status = "corrupt"
        manifest = _sealed(storage, path, step)  # a file's size was off: the rest still reads
    except StateMismatch as error:
        problems.append(str(error))
        status = "unsupported"
    states: dict[str, Any] = {}
    if manifest is not None:
        for problem in _check_files(storage, path, manifest, states if read_states else None):
            status = "corrupt"
            if problem not in problems:
                problems.append(problem)
    return CheckpointReport(
        name=Path(path).name,
        path=os.path.abspath(path),
        step=step,
        written=_written(Path(path) / MANIFEST),
        bytes=_size(Path(path)),
        verified=status == "ok",
        status=status,
        problems=problems,
        world_size=manifest["world_size"] if manifest is not None else None,
        entries=list(manifest["entries"]) if manifest is not None else None,
        position=_position(states),
        loaders=loaders(states),
    )


def _sealed(storage: Storage, path: str, step: int) -> Manifest | None:
    """The manifest if it is intact itself (its seal and schema), its files aside."""
    try:
        with storage.open_read(join(path, MANIFEST)) as opened:
            return validate(opened.read(), step, path)
    except (OSError, ValueError):  # CorruptCheckpoint and StateMismatch are ValueErrors
        return None


def _written(manifest: Path) -> str | None:
    try:
        mtime = manifest.stat().st_mtime
    except OSError:
        return None
    return datetime.fromtimestamp(mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _size(directory: Path) -> int:
    total = 0
    for parent, _, files in os.walk(directory):
        for file in files:
            try:
                total += os.lstat(os.path.join(parent, file)).st_size
            except OSError:
                pass
    return total


def _check_files(
    storage: Storage, path: str, manifest: Manifest, states: dict[str, Any] | None
) -> list[str]:
    """Why ``load_latest`` would skip checkpoint ``path`` for its files (none: it would load
    them): each listed file matches its sha256, and each file of a replicated or per-rank entry
    loads with ``torch.load(weights_only=True)`` (which runs no code from the file) and fits
    what the manifest says of it, the very checks ``load_latest`` makes (a file whose sha256
    was resealed over garbage, a truncated zip or a pickle that would run code passes the hash
    alone). DCP's shard files are hashed only: DCP reads them. ``states``, if given, receives
    the entries worth reading for a position (``ALWAYS_READ``, or small), by name; of an entry
    saved by several ranks, rank 0's part."""
    problems: list[str] = []
    bad: set[str] = set()
    for file in manifest["files"]:
        try:
            verify_file(storage, path, manifest, file)
        except CorruptCheckpoint as error:
            bad.add(file)
            problems.append(str(error))
    for name, entry in manifest["entries"].items():
        files = [entry["file"]] if "file" in entry else entry.get("ranks", [])
        for file in files:
            if file in bad:
                continue
            try:
                value = load_file(storage, path, manifest, file, verify=False)  # hashed above
                check_entry(name, entry, value)
            except CorruptCheckpoint as error:
                problems.append(f"state[{name!r}]: {error}")
                continue
            small = name in ALWAYS_READ or manifest["files"][file]["size"] <= READ_LIMIT
            if states is not None and file == files[0] and small:
                states[name] = value
            del value  # one file in memory at a time
    return problems


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


# -------------------------------------------------------------------------------- the report


def report(command: str, given: str, read_states: bool) -> Report:
    """Everything the command prints, as data. Raises ``UsageError`` if there is nothing to
    report on."""
    storage = LocalStorage()
    kind, root, found = locate(Path(given), storage)
    checked = [check(storage, path, step, read_states) for step, path in found]
    return Report(
        command=command,
        directory=given,
        kind=kind,
        checkpoints_directory=os.path.abspath(root),
        checkpoints=checked,
        newest=checked[-1]["name"],
        ok=checked[-1]["verified"],
        resume=_resume(checked, kind),
    )


def _resume(checked: list[CheckpointReport], kind: str) -> Resume:
    """What ``load_latest`` would do: try the newest first, skip the corrupt ones, raise at one
    of another format version."""
    skipped: list[str] = []
    chosen: CheckpointReport | None = None
    fails = None
    for candidate in reversed(checked):
        if candidate["status"] == "unsupported":
            fails = candidate["problems"][0]
            break
        if candidate["verified"]:
            chosen = candidate
            break
        skipped.append(candidate["name"])
    one = kind == "checkpoint"
    return Resume(
        checkpoint=chosen["name"] if chosen else None,
        step=chosen["step"] if chosen else None,
        skipped=skipped,
        fails=fails,
        position=chosen["position"] if chosen else None,
        loaders=chosen["loaders"] if chosen else [],
        summary=_summary(chosen, skipped, fails, one),
    )


def _summary(
    chosen: CheckpointReport | None, skipped: list[str], fails: str | None, one: bool
) -> str:
    skips = f" (skipping {_names(skipped)}: corrupt)" if skipped else ""
    if fails is not None:
        return f"a resume would fail{skips}: {fails}"
    if chosen is None:
        what = "this checkpoint does not verify" if one else "no checkpoint verifies"
        return f"{what}: a resume would skip {_names(skipped)} and start fresh"
    where = _where(chosen["position"])
    text = f"resume would load checkpoint {chosen['name']}{where}"
    if skipped:
        text += f"; it would skip {_names(skipped)} (corrupt)"
    return text


def _where(position: Position | None) -> str:
    if position is None:
        return ""
    epoch, batch, phase = position["epoch"], position["batch"], position["phase"]
    sample = f" (sample {position['sample']})" if position["sample"] is not None else ""
    step = position["optimizer_step"]
    steps = f", optimizer step {step}" if step is not None else ""
    if phase == "val":
        return f" and continue the validation of epoch {epoch} at batch {batch}{sample}{steps}"
    if phase == "end":
        return f" and finish epoch {epoch}, then start epoch {epoch + 1}{steps}"
    if batch == 0 and phase == "train":
        # Only the save at the end of fit is taken before an epoch's first batch.
        finished = " (where the run ended: only a larger max_epochs or max_steps trains on)"
        finished = finished if epoch else ""
        return f" and start epoch {epoch} at its first batch{steps}{finished}"
    return f" and continue epoch {epoch} at batch {batch}{sample}{steps}"


def _names(names: list[str]) -> str:
    return ", ".join(names)


# ---------------------------------------------------------------------------------- printing


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Rows aligned under their headers; the columns in ``right`` right-aligned."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [
            str(cell).rjust(width) if i in right else str(cell).ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def text(document: Report) -> str:
    inspecting = document["command"] == "inspect"
    where = document["checkpoints_directory"]
    kind = {"run": "run directory", "checkpoints": "checkpoint directory"}.get(document["kind"])
    lines = [
        f"{kind} {document['directory']}: checkpoints in {where}"
        if kind
        else f"checkpoint {document['directory']}",
        "",
    ]
    headers = ["CHECKPOINT", "STEP"]
    if inspecting:
        headers += ["EPOCH", "BATCH", "SAMPLE", "OPT STEP"]
    headers += ["WRITTEN (UTC)", "SIZE", "VERIFIED"]
    rows = []
    for checkpoint in document["checkpoints"]:
        row = [checkpoint["name"], str(checkpoint["step"])]
        if inspecting:
            position = checkpoint["position"]
            if position is None:
                row += ["-", "-", "-", "-"]
            else:
                batch = str(position["batch"])
                if position["phase"] in ("val", "end"):
                    batch = f"{position['phase']} {batch}"
                row += [
                    str(position["epoch"]),
                    batch,
                    _cell(position["sample"]),
                    _cell(position["optimizer_step"]),
                ]
        verdict = {"ok": "ok", "corrupt": "CORRUPT", "unsupported": "UNSUPPORTED"}
        row += [
            checkpoint["written"] or "-",
            human(checkpoint["bytes"]),
            verdict[checkpoint["status"]],
        ]
        rows.append(row)
    right = {1, 2, 3, 4, 5, 7} if inspecting else {1, 3}
    lines += table(headers, rows, right)
    troubled = [c for c in document["checkpoints"] if c["problems"]]
    if troubled:
        lines.append("")
    for checkpoint in troubled:
        for problem in checkpoint["problems"]:
            lines.append(f"{checkpoint['name']}: {problem}")
    resume = document["resume"]
    if inspecting and resume["loaders"]:
        lines += ["", f"loaders in {resume['checkpoint']}:"]
        rows = []

        def add(loader: LoaderReport) -> None:
            rows.append(
                [
                    loader["name"],
                    loader.get("format", "-"),
                    loader.get("mode", "-"),
                    _cell(loader.get("seed")),
                    _cell(loader.get("epoch")),
                    _cell(loader.get("batches")),
                    _cell(loader.get("samples", loader.get("items"))),
                ]
            )
            for child in loader.get("loaders", []):
                add(child)

        for loader in resume["loaders"]:
            add(loader)
        headers = ["NAME", "FORMAT", "MODE", "SEED", "EPOCH", "BATCHES", "SAMPLES"]
        lines += ["  " + line for line in table(headers, rows, {3, 4, 5, 6})]
    lines.append("")
    lines.append(_verdict(document) if not inspecting else _sentence(resume["summary"]))
    return "\n".join(lines)


def _verdict(document: Report) -> str:
    """``verify``'s last line: whether the newest checkpoint verifies, and if not, what a
    resume would do instead."""
    newest, resume = document["checkpoints"][-1], document["resume"]
    if document["ok"]:
        return f"OK: the newest checkpoint, {newest['name']}, verifies"
    if newest["status"] == "unsupported":  # load_latest raises at it rather than skip it
        return (
            f"FAILED: the newest checkpoint, {newest['name']}, is of another format version; "
            f"a resume would fail: {newest['problems'][0]}"
        )
    if resume["checkpoint"] is not None:
        then = (
            f"a resume would skip {_names(resume['skipped'])} and fall back to "
            f"{resume['checkpoint']} (step {resume['step']})"
        )
    elif resume["fails"] is not None:
        then = (
            "a resume would fail"
            + (f" (after skipping {_names(resume['skipped'])})" if resume["skipped"] else "")
            + f": {resume['fails']}"
        )
    else:
        then = "no checkpoint verifies: a resume would start fresh"
    return (
        f"FAILED: the newest checkpoint, {newest['name']}, does not verify "
        f"({newest['problems'][0]}); {then}"
    )


def _sentence(summary: str) -> str:
    return summary[:1].upper() + summary[1:] + "."


# ------------------------------------------------------------------------------- the command


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "directory",
        metavar="DIR",
        help="a run directory (a Trainer's), a Checkpointer directory, or one checkpoint",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document")
    main_parser = argparse.ArgumentParser(
        prog="unbroken",
        description="Inspect and verify unbroken checkpoints (nothing on disk is changed).",
    )
    commands = main_parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser(
        "inspect",
        parents=[common],
        help="list the checkpoints: position, time, size, whether they verify; what a resume "
        "would do",
        description="List every checkpoint (step, epoch and batch, time written, size, whether "
        "it verifies), the loaders' cursors in the newest one that verifies, and what a resume "
        "would do. Exit 0 if checkpoints were found, 2 otherwise.",
    )
    commands.add_parser(
        "verify",
        parents=[common],
        help="exit 0 if the newest checkpoint verifies, 1 if it is corrupt",
        description="Check every checkpoint's manifest and the sha256 of each of its files. "
        "Exit 0 if the newest checkpoint verifies, 1 if it does not (even if an older one "
        "does), 2 if there is no checkpoint.",
    )
    return main_parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``unbroken`` command; returns its exit status."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:  # argparse's usage errors (2) and --help (0)
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    command, directory, as_json = args.command, args.directory, args.json
    try:
        document = report(command, directory, read_states=command == "inspect")
    except (UsageError, OSError) as error:  # OSError: a directory that cannot be listed
        print(f"unbroken {command}: error: {error}", file=sys.stderr)
        if as_json:
            print(json.dumps({"command": command, "directory": directory, "error": str(error)}))
        return EXIT_USAGE
    if as_json:
        print(json.dumps(document, indent=2))
    else:
        print(text(document))
    if command == "verify" and not document["ok"]:
        return EXIT_CORRUPT
    return EXIT_OK
