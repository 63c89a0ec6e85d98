"""``unbroken.Checkpointer``: atomic, verified, rotating checkpoints of a dict of stateful things.

Layout of ``save(123, {"model": ..., "optimizer": ...})``::

    <directory>/step-000000123/000-model.pt       one torch.save file per entry, in state order
                              /001-optimizer.pt
                              /manifest.json      format, version, step, entry -> file, the
                                                  sha256 and size of every file, its own sha256
    <directory>/.tmp-step-000000123-<pid>-<hex>/  a save in progress, or a killed one: ignored

Everything is written and fsynced inside the hidden ``.tmp-*`` directory, the manifest last, and
the directory is renamed into place (then its parent fsynced), so a SIGKILL at any instant leaves
either the previous checkpoints or the new complete one. ``load_latest(state)`` tries
checkpoints newest step first, skips (with a warning) any whose manifest, sizes, hashes or files
do not check out, restores the newest good one in place and returns a ``Restored`` (``None`` if
there is none). Files are read with ``torch.load(weights_only=True)``, which runs no code from
the file, so ``save`` refuses, naming its key path, any value that such a load could not
rebuild: what saves, loads.

The parts: ``_weights_only`` (what save refuses), ``_disk`` (hashed, fsynced writes; disk-full
errors), ``_manifest`` (the seal and its schema; reading a checkpoint), ``_background`` (saves
with ``blocking=False`` and their report at exit), ``_restore`` (in place, and ``Restored``).

Costs: a blocking save writes each byte once, hashing it on the way (sha256 runs at about
1 GB/s on one core), plus one fsync per file and two per directory. ``blocking=False`` blocks
only while the state is copied to CPU memory (one extra copy of every tensor held until the
write ends) and writes in a background thread. ``load_latest`` reads each file twice (the hash,
then ``torch.load``; the second read comes from the page cache).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any

import torch

from .background import BackgroundSave
from .disk import FULL, disk_full, fsync_dir, make_directories, remove, write_file
from .manifest import FORMAT, MANIFEST, VERSION, Corrupt, file_name, read, seal
from .restore import Restored, restore
from .._state import has_state
from .weights_only import snapshot

__all__ = ["FORMAT", "MANIFEST", "VERSION", "Checkpointer", "Restored"]

_FINAL = re.compile(r"step-(\d+)")
# A checkpoint moved aside while a save of the same step replaces it; it counts again if the
# writer died before the replacement was renamed into place.
_OLD = re.compile(r"\.old-step-(\d+)-[0-9a-f]+")
_TMP, _DOOMED = ".tmp-", ".del-"


class Checkpointer:
    """Saves and restores ``state`` dicts in ``directory``, keeping the newest ``keep`` saves.

    ``state`` maps str names to objects with ``state_dict``/``load_state_dict`` (modules,
    optimizers, schedulers, ``GradScaler``, ``unbroken.DataLoader``, yours) or to plain values
    (dicts, lists, tuples, str, int, float, bool, None, tensors; sets, bytearray and complex
    where the installed torch loads them).

    One process writes to a directory at a time: before each save, the writer removes what
    killed writers left behind. Processes that only ``load_latest`` change nothing on disk.
    Raises ``NotADirectoryError`` if ``directory`` is a file (or lies under one).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            raise ValueError(
                f"keep must be an int >= 2, got {keep!r}: with a single checkpoint, one that is "
                "corrupted (a disk error, a truncated copy) leaves nothing to resume from"
            )
        self.directory = Path(directory)
        self.keep = keep
        self._pending: BackgroundSave | None = None
        self._check_directory()

    def save(self, step: int, state: dict[str, Any], blocking: bool = True) -> Path:
        """Write ``state`` as checkpoint ``step``; returns its final directory.

        Once the save is committed, ``load_latest`` restores it: a checkpoint of the same step
        is replaced, and ones with a larger step (from a run that went back to an earlier
        checkpoint) are removed, with a warning. Then only the newest ``keep`` remain.
        ``blocking=False`` returns once ``state`` is copied to CPU memory and writes in a
        background thread; the next ``save``, ``wait``, ``load_latest`` or ``close`` waits for
        it and re-raises what it raised (if none does, the failure is printed to stderr when
        the interpreter exits). Raises ``ValueError`` naming the key path of a value that
        ``torch.load(weights_only=True)`` could not rebuild (an int wider than 2039 bits, a
        meta tensor, ...), before writing anything; ``OSError`` with errno ENOSPC, saying how
        much is needed and free, if the disk is full, leaving the earlier checkpoints as they
        were.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0 (the training step), got {step!r}")
        _check_names(state, "save")
        self.wait()
        self._check_directory()
        entries, meta = {}, {}
        for name, obj in state.items():
            value = obj.state_dict() if has_state(obj) else obj
            # A background write needs its own copy: training goes on changing the tensors.
            entries[name] = snapshot(value, f"state[{name!r}]", clone=not blocking)
            if isinstance(obj, torch.optim.Optimizer):  # lets load name a parameter that changed
                meta[name] = {"param_shapes": [[list(p.shape) for p in group["params"]]
                                               for group in obj.param_groups]}
        newer = [path.name for number, path in self._committed() if number > step]
        if newer:
            warnings.warn(
                f"unbroken.Checkpointer: {newer} in {self.directory} have a larger step than "
                f"{step} and will be removed once step {step} is saved, so that load_latest "
                "resumes from this save", stacklevel=2)
        final = self.directory / f"step-{step:09d}"
        if blocking:
            self._write(step, final, entries, meta)
        else:
            self._pending = BackgroundSave(
                final, lambda: self._write(step, final, entries, meta))
        return final

    def wait(self) -> None:
        """Block until the background save, if any, is written; re-raise what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def load_latest(self, state: dict[str, Any]) -> Restored | None:
        """Restore ``state`` from the newest valid checkpoint; ``None`` if there is none.

        Objects with ``load_state_dict`` get their entry, in place. The caller's dict itself is
        not changed: the saved values of its other names (plain values; what is given for them
        is not used) are in the returned ``Restored``'s ``values``, the entries that ``state``
        did not name in its ``unrequested``, with the checkpoint's ``step`` and ``path``. A
        ``Restored`` is always true, so ``if restored:`` means "resumed". Each invalid
        checkpoint (truncated, a flipped byte, a malformed manifest, ...) is skipped with a
        warning saying why. Raises ``ValueError`` if the newest valid checkpoint lacks a name of
        ``state`` or an object rejects its entry (shapes of modules and optimizers are compared
        before anything is restored), or if it has another format version;
        ``NotADirectoryError`` if the directory is a file.
        """
        _check_names(state, "load_latest")
        self.wait()
        self._check_directory()
        for step, path in reversed(self._candidates()):
            try:
                manifest, saved = read(path, step)
            except Corrupt as why:
                warnings.warn(f"unbroken.Checkpointer: skipping checkpoint {path}: {why}",
                              stacklevel=2)
                continue
            restore(state, saved, manifest["entries"], path)
            return Restored(
                step=step, path=path,
                values={name: saved[name] for name, obj in state.items() if not has_state(obj)},
                unrequested={name: value for name, value in saved.items() if name not in state})
        return None

    def _check_directory(self) -> None:
        """Refuse a file where the directory should be: no checkpoint would ever be found in it,
        and a Trainer would start over from step 0 and rewrite its log."""
        try:
            is_directory = stat.S_ISDIR(os.stat(self.directory).st_mode)
        except FileNotFoundError:
            return  # the first save creates it
        except NotADirectoryError:
            is_directory = False
        if not is_directory:
            blocker = next((p for p in reversed(self.directory.parents)
                            if p.exists() and not p.is_dir()), None)
            what = f"{blocker} is a file" if blocker else "it exists and is not a directory"
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"the Checkpointer directory {self.directory} is not a directory: {what}, so no "
                "checkpoint could be found or saved there. Pass the path of the directory that "
                "holds the step-* checkpoints (it is created if it does not exist)")

    # -------------------------------------------------------------------------------- writing

    def _write(self, step: int, final: Path, entries: dict, meta: dict) -> None:
        try:
            self._commit(step, final, entries, meta)
        except OSError as error:
            if error.errno not in FULL:
                raise
            raise disk_full(error, self.directory, step, entries, self.keep,
                            [path for _, path in self._committed()]) from error
        committed = self._committed()
        doomed = [path for number, path in committed if number > step]
        doomed += [path for number, path in committed if number <= step][:-self.keep]
        for path in doomed:
            remove(path, _DOOMED)

    def _commit(self, step: int, final: Path, entries: dict, meta: dict) -> None:
        """Write the checkpoint in a temporary directory and rename it to ``final``."""
        make_directories(self.directory)
        self._clean()
        tmp = self.directory / f"{_TMP}step-{step:09d}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        old = None
        try:
            files, listed = {}, {}
            for index, (name, value) in enumerate(entries.items()):
                file = file_name(index, name)
                try:
                    files[file] = write_file(tmp / file, lambda out, v=value: torch.save(v, out))
                except Exception as error:
                    if not isinstance(error, OSError) and hasattr(error, "add_note"):
                        error.add_note(f"raised by torch.save of state[{name!r}]")
                    raise
                listed[name] = {"file": file, **meta.get(name, {})}
            data = seal(step, listed, files)
            write_file(tmp / MANIFEST, lambda out: out.write(data))  # last: it is the seal
            fsync_dir(tmp)
            if final.exists():  # a directory cannot be renamed over a non-empty one
                old = self.directory / f".old-{final.name}-{secrets.token_hex(4)}"
                os.rename(final, old)
            os.rename(tmp, final)  # the commit
            fsync_dir(self.directory)
        except BaseException:
            if old is not None and not final.exists():
                os.rename(old, final)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _clean(self) -> None:
        """Remove what killed writers left: temporary and half-deleted directories."""
        for entry in os.scandir(self.directory):
            old = _OLD.fullmatch(entry.name)
            if old and not (self.directory / f"step-{old.group(1)}").exists():
                os.rename(entry.path, self.directory / f"step-{old.group(1)}")
            elif old or entry.name.startswith((_TMP, _DOOMED)):
                shutil.rmtree(entry.path, ignore_errors=True)

    def _committed(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every committed checkpoint directory, oldest step first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), Path(e.path)) for e in os.scandir(self.directory)
                 if (m := _FINAL.fullmatch(e.name)) and e.is_dir()]
        return sorted(found)

    def _candidates(self) -> list[tuple[int, Path]]:
        found = dict(self._committed())
        for entry in os.scandir(self.directory) if self.directory.is_dir() else ():
            old = _OLD.fullmatch(entry.name)
            if old:  # the writer died between moving it aside and renaming its replacement
                found.setdefault(int(old.group(1)), Path(entry.path))
        return sorted(found.items())


def _check_names(state: Any, method: str) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"{method} expects a dict of name -> object, got a "
                         f"{type(state).__name__}; wrap it, e.g. {{'model': model}}")
    for name in state:
        if not isinstance(name, str):
            raise ValueError(f"state key {name!r} is a {type(name).__name__}; names must be str")
