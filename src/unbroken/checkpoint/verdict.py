"""Judging a checkpoint: the one verdict behind ``load_latest`` and ``unbroken inspect/verify``.

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
(``quarantine``), never deleted.

The checks themselves are ``manifest.read_manifest`` (the seal, the schema, every file's size),
``manifest.verify_file`` (a file's sha256) and ``manifest.load_entry_file`` (weights-only load and
the entry's own checks). ``load_latest`` splits them over the ranks (each hashes its share of the
replicated files and loads what it restores; the ranks then agree, and one rank's verdict is every
rank's); ``classify`` makes all of them in one process, every rank's parts included, so what it
says of a checkpoint is what a resume by any number of ranks would do. DCP's shard files are
hashed, not loaded: DCP reads them, collectively.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import CorruptCheckpoint, RemoteUnavailable, StateMismatch
from .layout import MANIFEST, Manifest, load_entry_file, read_manifest, validate, verify_file
from .storage import Storage, join

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
