"""The names inside a checkpoint directory, and what they say after a writer was killed.

- ``step-000000123``: a committed checkpoint (renamed into place whole).
- ``.tmp-step-000000123-<pid>-<hex>``: a save in progress, or a killed one: removed.
- ``.old-step-000000123-<hex>``: a checkpoint moved aside while a save of the same step replaces
  it; it counts again if the writer died before the replacement was renamed into place.
- ``.del-step-000000123-<hex>``: renamed before deletion, so that a writer killed mid-delete
  leaves no half checkpoint in view: removed.
- ``.shared-<hex>/``: the directory by which the ranks of a job check that they share the directory
  (``group``): removed.

On a store that cannot rename (``Storage.renames`` false: object storage), a checkpoint is
written in place, under ``step-000000123/``, and its manifest, written last, commits it: a
``step-*`` prefix without a manifest is a killed writer's (or a deletion's) leftover, not in
view, and removed. ``stage`` and ``retire`` are the two ways of writing and deleting.
"""

from __future__ import annotations

import os
import re
import secrets

from .manifest import MANIFEST
from .storage import Storage, basename, join

_FINAL = re.compile(r"step-(\d+)")
_OLD = re.compile(r"\.old-step-(\d+)-[0-9a-f]+")
_TMP, _DOOMED = ".tmp-", ".del-"
SHARED = ".shared-"  # a token file of group.Ranks.check_shared


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
    """Remove what killed writers left: temporary and half-deleted directories (on a store
    without rename: prefixes without a manifest); put back a checkpoint moved aside whose
    replacement never arrived; abort what a killed writer left of a multipart upload, where
    the storage can (``ObjectStorage.abort_uploads``)."""
    abort_uploads = getattr(storage, "abort_uploads", None)  # not part of the protocol
    if abort_uploads is not None:
        abort_uploads(root)
    for entry in storage.list_directory(root):
        old = _OLD.fullmatch(entry.name)
        final = join(root, f"step-{old.group(1)}") if old else ""
        if old and not storage.exists(final):
            storage.rename(join(root, entry.name), final)
        elif old or entry.name.startswith((_TMP, _DOOMED, SHARED)):
            storage.remove_tree(join(root, entry.name))
        elif (
            not storage.renames
            and _FINAL.fullmatch(entry.name)
            and not _sealed(storage, root, entry.name)
        ):
            storage.remove_tree(join(root, entry.name))


def committed(storage: Storage, root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every committed checkpoint directory, oldest step first."""
    if not storage.is_directory(root):
        return []
    found = [
        (int(m.group(1)), join(root, entry.name))
        for entry in storage.list_directory(root)
        if (m := _FINAL.fullmatch(entry.name))
        and entry.is_directory
        and (storage.renames or _sealed(storage, root, entry.name))
    ]
    return sorted(found)


def _sealed(storage: Storage, root: str, name: str) -> bool:
    return storage.exists(join(join(root, name), MANIFEST))


def stage(storage: Storage, root: str, step: int, target: str) -> str:
    """Where checkpoint ``step``, to be committed at ``target``, is written: a new temporary
    directory, renamed into place by ``Storage.commit``; on a store without rename, ``target``
    itself, once a checkpoint there (the same step saved again) is retired."""
    if not storage.renames:
        if storage.exists(target):  # the same step saved again
            retire(storage, root, target)
        return target
    tmp = join(root, temporary_name(step))
    storage.make_directory(tmp)
    return tmp


def retire(storage: Storage, root: str, path: str) -> None:
    """Delete checkpoint ``path`` so that no reader ever sees a part of it: renamed out of
    view first, or, on a store without rename, its manifest deleted first."""
    if storage.renames:
        aside = join(root, doomed_name(basename(path)))
        storage.rename(path, aside)
        storage.remove_tree(aside)
    else:
        storage.remove_tree(join(path, MANIFEST))
        storage.remove_tree(path)


def candidates(storage: Storage, root: str) -> list[tuple[int, str]]:
    """What ``load_latest`` may read: the committed ones and any moved aside."""
    found = dict(committed(storage, root))
    if storage.is_directory(root):
        for entry in storage.list_directory(root):
            old = _OLD.fullmatch(entry.name)
            if old:  # the writer died between moving it aside and renaming its replacement
                found.setdefault(int(old.group(1)), join(root, entry.name))
    return sorted(found.items())
