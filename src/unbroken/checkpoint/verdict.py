"""Judging a checkpoint: the one verdict behind ``load_latest`` and ``unbroken inspect/verify``,
and a damaged one moved aside (``move_aside``), never deleted.

A checkpoint is

- ``ok``: it loads;
- ``corrupt``: ``load_latest`` skips it, with the reasons (a manifest missing, malformed or not
  sealed; a listed file missing, of another size or sha256, or a symbolic link; a file of a
  replicated or per-rank entry that does not load with ``torch.load(weights_only=True)`` or does
  not fit what the manifest says of it);
- ``unsupported``: another format version wrote it, which is never skipped (``StateMismatch``).

A checkpoint that could not be read at all gets no verdict: a store that did not answer (after
its retries, or past its deadline) raises ``RemoteUnavailable`` from ``classify`` and
``load_latest`` alike, never "corrupt". Only what was read and found wrong (or a file the store
said is not there) makes a checkpoint corrupt, to be skipped, and moved aside by a later save
(below), never deleted.

The checks themselves are ``layout.read_manifest`` (the seal, the schema, every file's size),
``layout.verify_file`` (a file's sha256) and ``layout.load_entry_file`` (weights-only load and
the entry's own checks). ``load_latest`` splits them over the ranks (each hashes its share of the
replicated files and loads what it restores; the ranks then agree, and one rank's verdict is every
rank's); ``classify`` makes all of them in one process, every rank's parts included, so what it
says of a checkpoint is what a resume by any number of ranks would do. DCP's shard files are
hashed, not loaded: DCP reads them, collectively.

**Damaged checkpoints moved aside**, never deleted: the evidence of what damaged them. A
checkpoint that a resume read and judged damaged (``Checkpointer.load_latest``; the seal of an
``unbroken.hf`` folder that does not hold) is moved into ``<directory>/damaged/``, named
``<UTC time moved>-<its name>``. Beside its files, ``unbroken-damaged.json`` says where it was,
when it was moved, and why it was judged damaged::

    {"format": "unbroken.Damaged", "version": 1, "checkpoint": "<where it was>",
     "moved": "2026-01-31T12:00:00Z", "problems": ["000-model.pt does not match its sha256 ..."]}

Only the newest ``KEEP`` moved there stay: each older one is deleted, with a warning naming it.
No listing of checkpoints ever takes ``damaged/`` or what it holds for a checkpoint: the names
match neither ``step-<n>`` nor ``checkpoint-<n>``. ``unbroken verify`` lists them.

Costs: on a local disk one rename; on an object store a copy of every object of the checkpoint
in the store and a delete (``FsspecStorage.rename``), once per damaged checkpoint.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from ..errors import CorruptCheckpoint, RemoteUnavailable, StateMismatch
from .layout import MANIFEST, Manifest, load_entry_file, read_manifest, validate, verify_file
from .storage import Storage, basename, join

Status = Literal["ok", "corrupt", "unsupported"]
Keep = Callable[[Manifest, str, str, Any], None]
"""Called with (manifest, entry name, file, value) for each entry file that loaded."""


@dataclass(frozen=True)
class Verdict:
    """What ``load_latest`` would make of checkpoint ``path``."""

    path: str
    step: int
    status: Status
    problems: tuple[str, ...]
    """Why it is not ``ok``: each check that failed, in the order checked."""
    manifest: Manifest | None
    """The manifest if it is intact itself (even when a file is not), else ``None``."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def classify(storage: Storage, path: str, step: int, keep: Keep | None = None) -> Verdict:
    """Checkpoint ``path`` (saved as ``step``) checked whole: the manifest, every file's sha256,
    and every file of a replicated or per-rank entry loaded and checked (one in memory at a
    time; ``keep`` sees each that loaded, from a file that matched its sha256)."""
    problems: list[str] = []
    status: Status = "ok"
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
    if manifest is not None:
        for problem in _check_files(storage, path, manifest, keep):
            status = "corrupt" if status == "ok" else status
            if problem not in problems:
                problems.append(problem)
    return Verdict(path, step, status, tuple(problems), manifest)


def _sealed(storage: Storage, path: str, step: int) -> Manifest | None:
    """The manifest if it is intact itself (its seal and schema), its files aside."""
    try:
        with storage.open_read(join(path, MANIFEST)) as opened:
            return validate(opened.read(), step, path)
    except RemoteUnavailable:
        raise
    except (OSError, ValueError):  # CorruptCheckpoint and StateMismatch are ValueErrors
        return None


def _check_files(storage: Storage, path: str, manifest: Manifest, keep: Keep | None) -> list[str]:
    problems: list[str] = []
    bad: set[str] = set()
    for file in manifest["files"]:
        try:
            verify_file(storage, path, manifest, file)
        except CorruptCheckpoint as error:
            bad.add(file)
            problems.append(str(error))
    for name, spec in manifest["entries"].items():
        files = [spec["file"]] if "file" in spec else spec.get("ranks", [])
        for file in files:
            if file in bad:
                continue
            try:
                value = load_entry_file(storage, path, manifest, name, spec, file, verify=False)
            except CorruptCheckpoint as error:
                problems.append(f"state[{name!r}]: {error}")
                continue
            if keep is not None:
                keep(manifest, name, file, value)
            del value  # one file in memory at a time
    return problems


# The name it had when this was a module of its own: filters that users set still match.
log = logging.getLogger("unbroken.checkpoint.quarantine")

DIRECTORY = "damaged"
"""The folder, beside the checkpoints, that damaged checkpoints are moved into."""
KEEP = 3
"""How many damaged checkpoints stay there: the newest moved."""
REASON = "unbroken-damaged.json"
FORMAT, VERSION = "unbroken.Damaged", 1
_STAMP = "%Y-%m-%dT%H-%M-%S.%fZ"  # sorts as time does; no ":" (not in a Windows or S3 key)


@dataclass(frozen=True)
class Damaged:
    """A checkpoint moved aside, as ``listed`` finds it.

    Args:
        name: Its name in the ``damaged`` folder.
        path: Where it is now.
        checkpoint: Where it was (``None``: its reason file is missing or unreadable).
        moved: When it was moved, UTC, ISO 8601 (``None``: as ``checkpoint``).
        problems: Why it was judged damaged, one line each.
    """

    name: str
    path: str
    checkpoint: str | None
    moved: str | None
    problems: tuple[str, ...]


def move_aside(
    storage: Storage, root: str, path: str, problems: list[str], keep: int = KEEP
) -> str:
    """Move damaged checkpoint ``path`` into ``root/damaged/``, record why, and delete the
    oldest there beyond ``keep``; each step is logged at WARNING.

    Args:
        storage: The storage holding ``root``.
        root: The directory holding the checkpoints.
        path: The damaged checkpoint, directly under ``root``.
        problems: Why it was judged damaged.
        keep: How many damaged checkpoints stay (the newest moved).

    Returns:
        Where the checkpoint is now.
    """
    folder = join(root, DIRECTORY)
    storage.make_directories(folder)
    now = datetime.now(timezone.utc)
    target = join(folder, f"{now.strftime(_STAMP)}-{basename(path)}")
    storage.rename(path, target)
    storage.sync_directory(folder)
    storage.sync_directory(root)
    log.warning(
        "moved the damaged checkpoint %s to %s, to be looked into (it was skipped: %s); "
        "unbroken verify %s lists it",
        path,
        target,
        "; ".join(problems) or "damaged",
        root,
    )
    reason = {
        "format": FORMAT,
        "version": VERSION,
        "checkpoint": path,
        "moved": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "problems": list(problems),
    }
    try:
        storage.create(join(target, REASON), json.dumps(reason, indent=1).encode())
    except OSError as error:  # the checkpoint is aside; only the note of why is missing
        log.warning("could not write %s in %s: %s", REASON, target, error)
    _bound(storage, folder, keep)
    return target


def _bound(storage: Storage, folder: str, keep: int) -> None:
    """Delete the damaged checkpoints of ``folder`` beyond the newest ``keep``."""
    names = sorted(entry.name for entry in storage.list_directory(folder) if entry.is_directory)
    for name in names[: max(len(names) - keep, 0)]:
        log.warning(
            "deleting %s: only the newest %d damaged checkpoints are kept in %s",
            join(folder, name),
            keep,
            folder,
        )
        storage.remove_tree(join(folder, name))


def listed(storage: Storage, root: str) -> list[Damaged]:
    """The checkpoints moved aside from ``root``, the oldest moved first.

    Args:
        storage: The storage holding ``root``.
        root: The directory holding the checkpoints.

    Returns:
        Each one, with why it was judged damaged where its reason file says.
    """
    folder = join(root, DIRECTORY)
    if not storage.is_directory(folder):
        return []
    found = []
    for name in sorted(e.name for e in storage.list_directory(folder) if e.is_directory):
        path = join(folder, name)
        note = _reason(storage, join(path, REASON))
        problems = note.get("problems")
        found.append(
            Damaged(
                name=name,
                path=path,
                checkpoint=note.get("checkpoint")
                if isinstance(note.get("checkpoint"), str)
                else None,
                moved=note.get("moved") if isinstance(note.get("moved"), str) else None,
                problems=tuple(str(p) for p in problems) if isinstance(problems, list) else (),
            )
        )
    return found


def _reason(storage: Storage, path: str) -> dict[str, Any]:
    """A reason file's fields, or none where it is missing or not one."""
    try:
        with storage.open_read(path) as opened:
            note = json.loads(opened.read())
    except (OSError, ValueError, RecursionError):
        return {}
    return note if isinstance(note, dict) and note.get("format") == FORMAT else {}
