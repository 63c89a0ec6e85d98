"""Seals for checkpoint folders that another library writes: whole and verified, or ignored.

transformers and Accelerate write a checkpoint as a folder of files (``checkpoint-40/``), file
by file, with no mark that the folder is complete. A process killed in the middle leaves a
folder that looks like a checkpoint and crashes the resume that picks it. A *seal* fixes that:
once every file is written, ``seal(folder)`` makes them durable (fsync) and writes
``unbroken-seal.json`` last, atomically (a temporary name, fsync, rename)::

    {"format": "unbroken.hf.Seal", "version": 1,
     "files": {"model.safetensors": {"size": 1234, "sha256": "<64 hex digits>"}, ...},
     "sha256": "<of the canonical JSON of the other fields>"}

``resume_point`` applies it as a resume does (none sealed is an error, no folder a first run),
and ``prune`` keeps the newest sealed ones. ``check(folder)`` says whether a folder is ``sealed`` (every listed file there, with its size
and, unless ``hashes=False``, its sha256), ``unsealed`` (no seal: a save that never finished)
or ``damaged`` (a seal whose files changed or went missing). ``last_sealed(directory)`` is the
newest ``checkpoint-<step>`` folder that is sealed, with a warning naming each newer one it
skipped. Files added after the seal are not checked: they were not part of the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from .._files import atomic_write, sync_directory
from ..errors import CorruptCheckpoint

FORMAT = "unbroken.hf.Seal"
VERSION = 1
SEAL = "unbroken-seal.json"
_TEMPORARY = ".unbroken-seal.json.tmp"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 22

Status = Literal["sealed", "unsealed", "damaged"]


class UnsealedCheckpointWarning(UserWarning):
    """A checkpoint folder was skipped because it is not sealed, or its seal does not hold."""


@dataclass
class Verdict:
    """What ``check`` found about a checkpoint folder.

    Args:
        folder: The folder checked.
        status: ``"sealed"``, ``"unsealed"`` (no seal: a save that never finished) or
            ``"damaged"`` (a seal whose files changed or went missing).
        problems: For a damaged folder, what is wrong, one line each.
    """

    folder: str
    status: Status
    problems: list[str] = field(default_factory=list)

    @property
    def sealed(self) -> bool:
        """Whether the folder is sealed, so a resume may use it."""
        return self.status == "sealed"

    def reason(self) -> str:
        """Why the folder cannot be resumed from.

        Returns:
            One line, or an empty string when it can be.
        """
        if self.status == "unsealed":
            return f"it has no {SEAL}, so its save did not finish"
        if self.status == "damaged":
            return "its seal does not hold: " + "; ".join(self.problems)
        return ""


def seal(folder: str) -> dict[str, Any]:
    """Make every file under ``folder`` durable and record it in ``unbroken-seal.json``.

    Call it once the folder is complete (on every rank's files: after a barrier). A seal
    already there is replaced.

    Args:
        folder: The checkpoint folder.

    Returns:
        The seal's content: each file's size and sha256.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ValueError: ``folder`` holds a symbolic link (a seal could not vouch for its target).
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot seal {folder}: no such folder")
    files: dict[str, dict[str, Any]] = {}
    for relative in _files(folder):
        path = os.path.join(folder, relative)
        files[relative] = {"size": os.path.getsize(path), "sha256": _sha256(path, sync=True)}
    content: dict[str, Any] = {"format": FORMAT, "version": VERSION, "files": files}
    content["sha256"] = _digest(content)
    text = json.dumps(content, indent=1, sort_keys=True)
    atomic_write(os.path.join(folder, SEAL), text.encode(), temporary=_TEMPORARY)
    return content


def check(folder: str, hashes: bool = True) -> Verdict:
    """Whether ``folder`` is a checkpoint that ``seal`` completed and that has not changed since.

    Files added after the seal are not checked: they were not part of the checkpoint.

    Args:
        folder: The checkpoint folder.
        hashes: Check each file's sha256; ``False`` checks the seal and the sizes only (fast:
            no file is read).

    Returns:
        The verdict: sealed, unsealed or damaged, with what is wrong.
    """
    path = os.path.join(folder, SEAL)
    if not os.path.isfile(path):
        return Verdict(folder, "unsealed")
    try:
        with open(path, encoding="utf-8") as file:
            content = json.load(file)
        files = _validate(content)
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested too deep
        return Verdict(folder, "damaged", [f"{SEAL} cannot be read ({error})"])
    problems = []
    for relative, spec in sorted(files.items()):
        target = os.path.join(folder, relative)
        try:
            if _through_link(folder, relative) or not os.path.isfile(target):
                problems.append(f"{relative} is missing")
            elif os.path.getsize(target) != spec["size"]:
                problems.append(
                    f"{relative} has {os.path.getsize(target)} bytes, the seal says {spec['size']}"
                )
            elif hashes and _sha256(target) != spec["sha256"]:
                problems.append(f"{relative} does not match its sha256 in the seal")
        except OSError as error:  # unreadable, or removed while checked: not a sealed file
            problems.append(f"{relative} cannot be read ({error.strerror or error})")
    return Verdict(folder, "damaged" if problems else "sealed", problems)


def checkpoints(directory: str, prefix: str = "checkpoint") -> list[tuple[int, str]]:
    """The ``<prefix>-<step>`` folders in ``directory``, newest step first."""
    pattern = re.compile(re.escape(prefix) + r"-(\d+)")
    found = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = pattern.fullmatch(name)
            path = os.path.join(directory, name)
            if match and os.path.isdir(path):
                found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def last_sealed(
    directory: str, prefix: str = "checkpoint", hashes: bool = True
) -> tuple[str | None, list[Verdict]]:
    """The newest sealed checkpoint folder, skipping newer ones with a warning.

    Each skipped folder is also given as an ``UnsealedCheckpointWarning`` naming it and why.

    Args:
        directory: Where the checkpoint folders are.
        prefix: The folders' names are ``<prefix>-<step>``.
        hashes: Check each file's sha256, not only its size.

    Returns:
        The newest sealed folder (``None`` if there is none), and the verdicts on the newer
        folders it skipped.
    """
    skipped: list[Verdict] = []
    for _, path in checkpoints(directory, prefix):
        verdict = check(path, hashes=hashes)
        if verdict.sealed:
            return path, skipped
        warnings.warn(
            f"skipping checkpoint {path}: {verdict.reason()}",
            UnsealedCheckpointWarning,
            stacklevel=2,
        )
        skipped.append(verdict)
    return None, skipped


def resume_point(directory: str, prefix: str = "checkpoint") -> tuple[str | None, list[Verdict]]:
    """``last_sealed``, as a resume uses it: None with nothing skipped means ``directory`` holds
    no checkpoint folder (a job's first run, which starts from the beginning).

    Raises:
        CorruptCheckpoint: checkpoint folders exist and none is sealed: training from the start
            would silently throw them away.
    """
    path, skipped = last_sealed(directory, prefix)
    if path is None and skipped:
        said = "".join(f"; skipped {verdict.folder}: {verdict.reason()}" for verdict in skipped)
        raise CorruptCheckpoint(
            f"no sealed checkpoint in {directory}{said}. Remove the folders to train from the "
            "start."
        )
    return path, skipped


def prune(
    directory: str, keep: int, step: int, prefix: str = "checkpoint", spare: str | None = None
) -> list[str]:
    """Keep the newest ``keep`` sealed checkpoints up to ``step``: remove the older folders and
    any unsealed one among them (a save that never finished), but never ``spare`` (transformers'
    best checkpoint). Sealed folders are judged by their sizes: each was hashed when sealed. One
    judged damaged among them (a file missing or of another size) is evidence: it is moved into
    ``directory/damaged/`` (``unbroken.checkpoint.verdict``), never deleted.
    Returns the folders removed."""
    spared = os.path.realpath(spare) if spare else None
    kept, removed = 0, []
    for saved, folder in checkpoints(directory, prefix):
        if saved > step:
            continue
        verdict = check(folder, hashes=False) if kept < keep else None  # the rest: old saves
        if verdict is not None and verdict.sealed:
            kept += 1
        elif os.path.realpath(folder) == spared:
            continue
        elif verdict is not None and verdict.status == "damaged":
            from ..checkpoint.local import LocalStorage  # torch's import, only for this
            from ..checkpoint.verdict import move_aside

            move_aside(LocalStorage(), directory, folder, verdict.problems)
        else:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _files(folder: str) -> list[str]:
    """Every file under ``folder`` but the seal's own, in a fixed order; the subfolders are
    made durable too (a file's name lives in its folder's entries)."""
    found = []
    for root, directories, names in os.walk(folder):
        directories.sort()
        linked = [d for d in directories if os.path.islink(os.path.join(root, d))]
        if root != folder:
            sync_directory(root)
        for name in sorted(names) + linked:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative in (SEAL, _TEMPORARY):
                continue
            if os.path.islink(path):
                raise ValueError(f"cannot seal {folder}: {relative} is a symbolic link")
            found.append(relative)
    return found


def _validate(content: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(f"not a seal (format is not {FORMAT!r})")
    if content.get("version") != VERSION:
        raise ValueError(f"seal version {content.get('version')!r}; this unbroken reads {VERSION}")
    if content.get("sha256") != _digest(content):
        raise ValueError("the seal does not match its own sha256")
    files = content.get("files")
    if not isinstance(files, dict):
        raise ValueError("the seal's 'files' is not an object")
    for relative, spec in files.items():
        parts = relative.replace("\\", "/").split("/")
        if os.path.isabs(relative) or ".." in parts or "\x00" in relative:
            raise ValueError(f"the seal names a file outside the folder: {relative!r}")
        if (
            not isinstance(spec, dict)
            or type(spec.get("size")) is not int
            or spec["size"] < 0
            or not isinstance(spec.get("sha256"), str)
            or not _SHA256.fullmatch(spec["sha256"])
        ):
            raise ValueError(f"the seal's entry for {relative!r} is malformed")
    return files


def _through_link(folder: str, relative: str) -> bool:
    """Whether ``relative`` or a folder on its way is a symbolic link (bytes the seal did not
    read: ``seal`` refuses links)."""
    path = folder
    for part in relative.replace("\\", "/").split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            return True
    return False


def _digest(content: dict[str, Any]) -> str:
    fields = {key: value for key, value in content.items() if key != "sha256"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _sha256(path: str, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
        if sync:  # the library that wrote it may not have: a seal vouches for durable bytes
            os.fsync(file.fileno())
    return digest.hexdigest()
