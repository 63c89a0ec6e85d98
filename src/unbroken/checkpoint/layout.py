"""The names inside a checkpoint directory, and what they say after a writer was killed.

- ``step-000000123``: a committed checkpoint (renamed into place whole).
- ``.tmp-step-000000123-<pid>-<hex>``: a save in progress, or a killed one: removed.
- ``.old-step-000000123-<hex>``: a checkpoint moved aside while a save of the same step replaces
  it; it counts again if the writer died before the replacement was renamed into place.
- ``.del-step-000000123-<hex>``: renamed before deletion, so that a writer killed mid-delete
  leaves no half checkpoint in view: removed.
- ``.shared-<hex>/``: the directory by which the ranks of a job check that they share the directory
  (``group``): removed.

How a checkpoint is staged, committed and retired is the storage's (``Storage.stage``,
``commit``, ``retire``, ``is_committed``): on a store without rename (``FsspecStorage``), a
checkpoint is written in place, under ``step-000000123/``, and its manifest, written last,
commits it; a ``step-*`` prefix without one is a killed writer's (or a deletion's) leftover, not
in view, and removed.
"""

from __future__ import annotations

import os
import re
import secrets

from .files import basename, join
from .storage import Storage

_FINAL = re.compile(r"step-(\d+)")
_OLD = re.compile(r"\.old-step-(\d+)-[0-9a-f]+")
_TMP, _DOOMED = ".tmp-", ".del-"
SHARED = ".shared-"  # a token file of group.CheckpointGroup.check_shared


def final_name(step: int) -> str:
    return f"step-{step:09d}"


def temporary_name(step: int) -> str:
    return f"{_TMP}{final_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"


def aside_name(name: str) -> str:
    """Where a committed checkpoint goes while a save of the same step replaces it."""
    return f".old-{name}-{secrets.token_hex(4)}"


def doomed_name(name: str) -> str:
    return f"{_DOOMED}{name}-{secrets.token_hex(4)}"


def clean(storage: Storage, root: str) -> None:
    """Remove what killed writers left: temporary and half-deleted directories, and checkpoint
    directories never committed (on a store without rename: prefixes without a manifest); put
    back a checkpoint moved aside whose replacement never arrived; abort what a killed writer
    left of an upload, where the store keeps it (``Storage.abort_uploads``)."""
    storage.abort_uploads(root)
    entries = storage.list_directory(root)
    finals = [join(root, e.name) for e in entries if _FINAL.fullmatch(e.name)]
    whole = set(storage.committed_among(finals)) if finals else set()
    for entry in entries:
        path = join(root, entry.name)
        old = _OLD.fullmatch(entry.name)
        final = join(root, f"step-{old.group(1)}") if old else ""
        if old and not storage.exists(final):
            storage.rename(path, final)
        elif old or entry.name.startswith((_TMP, _DOOMED, SHARED)):
            storage.remove_tree(path)
        elif _FINAL.fullmatch(entry.name) and path not in whole:
            storage.remove_tree(path)


def committed(storage: Storage, root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every committed checkpoint directory, oldest step first; one listing
    and one ``Storage.committed_among``, whatever their number."""
    if not storage.is_directory(root):
        return []
    listed = [
        (int(m.group(1)), join(root, entry.name))
        for entry in storage.list_directory(root)
        if (m := _FINAL.fullmatch(entry.name)) and entry.is_directory
    ]
    whole = set(storage.committed_among([path for _, path in listed])) if listed else set()
    return sorted((step, path) for step, path in listed if path in whole)


def stage(storage: Storage, root: str, step: int) -> str:
    """Where checkpoint ``step`` is written (``Storage.stage``: by default a new temporary
    directory, renamed into place by ``Storage.commit``)."""
    return storage.stage(join(root, final_name(step)), join(root, temporary_name(step)))


def retire(storage: Storage, root: str, path: str) -> None:
    """Delete checkpoint ``path`` so that no reader ever sees a part of it (``Storage.retire``:
    by default renamed out of view first)."""
    storage.retire(path, join(root, doomed_name(basename(path))))


def candidates(storage: Storage, root: str) -> list[tuple[int, str]]:
    """What ``load_latest`` may read: the committed ones and any moved aside."""
    found = dict(committed(storage, root))
    if storage.is_directory(root):
        for entry in storage.list_directory(root):
            old = _OLD.fullmatch(entry.name)
            if old:  # the writer died between moving it aside and renaming its replacement
                found.setdefault(int(old.group(1)), join(root, entry.name))
    return sorted(found.items())
