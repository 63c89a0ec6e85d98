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

The parts: ``layout`` (the names above, and cleaning up after killed writers),
``weights_only`` (what save refuses), ``storage`` (the filesystem operations, as the
protocol ``Storage``: hashed, fsynced writes, renames, listing), ``space`` (disk-full errors),
``manifest`` (the seal and its schema; reading a checkpoint), ``background`` (saves with
``blocking=False`` and their report at exit), ``restore`` (in place, and ``Restored``). The
Checkpointer touches files only through its ``Storage`` (a ``LocalStorage``), so another
filesystem is one new ``Storage`` class, not a change here.

Costs: a blocking save writes each byte once, hashing it on the way (sha256 runs at about
1 GB/s on one core), plus one fsync per file and two per directory. ``blocking=False`` blocks
only while the state is copied to CPU memory (one extra copy of every tensor held until the
write ends) and writes in a background thread. ``load_latest`` reads each file twice (the hash,
then ``torch.load``; the second read comes from the page cache).
"""

from __future__ import annotations

import errno
import os
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .._state import has_state
from ..errors import CorruptCheckpoint
from . import layout
from .background import BackgroundSave
from .manifest import FORMAT, MANIFEST, VERSION, ParamShapes, file_name, read, seal
from .restore import Restored, restore
from .space import FULL, disk_full
from .storage import Digest, LocalStorage, Storage, join
from .weights_only import checked_copy

__all__ = ["FORMAT", "MANIFEST", "VERSION", "Checkpointer", "Restored"]


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
        self._storage: Storage = LocalStorage()
        self._root = str(self.directory)  # what the storage is given: paths as strings
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
        entries: dict[str, Any] = {}
        shapes: dict[str, ParamShapes] = {}
        for name, obj in state.items():
            value = obj.state_dict() if has_state(obj) else obj
            # A background write needs its own copy: training goes on changing the tensors.
            entries[name] = checked_copy(value, f"state[{name!r}]", clone=not blocking)
            if isinstance(obj, torch.optim.Optimizer):  # lets load name a parameter that changed
                shapes[name] = [
                    [list(p.shape) for p in group["params"]] for group in obj.param_groups
                ]
        newer = [Path(path).name for number, path in self._committed() if number > step]
        if newer:
            warnings.warn(
                f"unbroken.Checkpointer: {newer} in {self.directory} have a larger step than "
                f"{step} and will be removed once step {step} is saved, so that load_latest "
                "resumes from this save",
                stacklevel=2,
            )
        final = self.directory / layout.final_name(step)
        if blocking:
            self._write(step, final, entries, shapes)
        else:
            self._pending = BackgroundSave(final, lambda: self._write(step, final, entries, shapes))
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

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def load_latest(self, state: dict[str, Any]) -> Restored | None:
        """Restore ``state`` from the newest valid checkpoint; ``None`` if there is none.

        Objects with ``load_state_dict`` get their entry, in place. The caller's dict itself is
        not changed: the saved values of its other names (plain values; what is given for them
        is not used) are in the returned ``Restored``'s ``values``, the entries that ``state``
        did not name in its ``unrequested``, with the checkpoint's ``step`` and ``path``. A
        ``Restored`` is always true, so ``if restored:`` means "resumed". Each invalid
        checkpoint (truncated, a flipped byte, a malformed manifest, ...) is skipped with a
        warning saying why (the ``CorruptCheckpoint`` it is). Raises ``StateMismatch`` if the
        newest valid checkpoint lacks a name of ``state``, does not fit its modules or optimizers
        (shapes are compared before anything is restored) or has another format version;
        ``ValueError`` (of the kind the object raised, if unbroken defines it) if an object
        rejects its entry; ``NotADirectoryError`` if the directory is a file.
        """
        _check_names(state, "load_latest")
        self.wait()
        self._check_directory()
        for step, where in reversed(layout.candidates(self._storage, self._root)):
            path = Path(where)
            try:
                manifest, saved = read(self._storage, where, step)
            except CorruptCheckpoint as why:
                warnings.warn(
                    f"unbroken.Checkpointer: skipping checkpoint {path}: {why}", stacklevel=2
                )
                continue
            restore(state, saved, manifest["entries"], path)
            return Restored(
                step=step,
                path=path,
                values={name: saved[name] for name, obj in state.items() if not has_state(obj)},
                unrequested={name: value for name, value in saved.items() if name not in state},
            )
        return None

    def _check_directory(self) -> None:
        """Refuse a file where the directory should be: no checkpoint would ever be found in it,
        and a Trainer would start over from step 0 and rewrite its log."""
        storage = self._storage
        if storage.is_directory(self._root):
            return
        # Nothing there (the first save creates it), unless a file blocks the way to it.
        blocker = next(
            (
                p
                for p in reversed(self.directory.parents)
                if storage.exists(str(p)) and not storage.is_directory(str(p))
            ),
            None,
        )
        if blocker is not None or storage.exists(self._root):
            what = f"{blocker} is a file" if blocker else "it exists and is not a directory"
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"the Checkpointer directory {self.directory} is not a directory: {what}, so no "
                "checkpoint could be found or saved there. Pass the path of the directory that "
                "holds the step-* checkpoints (it is created if it does not exist)",
            )

    # -------------------------------------------------------------------------------- writing

    def _write(
        self, step: int, final: Path, entries: dict[str, Any], shapes: dict[str, ParamShapes]
    ) -> None:
        try:
            self._commit(step, final, entries, shapes)
        except OSError as error:
            if error.errno not in FULL:
                raise
            raise disk_full(
                error,
                self._storage,
                self._root,
                step,
                entries,
                self.keep,
                [path for _, path in self._committed()],
            ) from error
        committed = self._committed()
        doomed = [path for number, path in committed if number > step]
        doomed += [path for number, path in committed if number <= step][: -self.keep]
        for path in doomed:
            # Renamed first, so that a writer killed mid-delete leaves no half checkpoint in view.
            aside = join(self._root, layout.doomed_name(Path(path).name))
            self._storage.rename(path, aside)
            self._storage.remove_tree(aside)

    def _commit(
        self, step: int, final: Path, entries: dict[str, Any], shapes: dict[str, ParamShapes]
    ) -> None:
        """Write the checkpoint in a temporary directory and rename it to ``final``."""
        storage, root, target = self._storage, self._root, join(self._root, final.name)
        storage.make_directories(root)
        layout.clean(storage, root)
        tmp = join(root, layout.temporary_name(step))
        storage.make_directory(tmp)
        old = None
        try:
            files: dict[str, Digest] = {}
            listed: dict[str, str] = {}  # name -> file
            for index, (name, value) in enumerate(entries.items()):
                file = file_name(index, name)
                try:
                    files[file] = storage.write(join(tmp, file), partial(torch.save, value))
                except Exception as error:
                    if not isinstance(error, OSError) and hasattr(error, "add_note"):
                        error.add_note(f"raised by torch.save of state[{name!r}]")
                    raise
                listed[name] = file
            data = seal(step, listed, files, shapes)
            storage.write(join(tmp, MANIFEST), lambda out: out.write(data))  # last: the seal
            storage.sync_directory(tmp)
            if storage.exists(target):  # a directory cannot be renamed over a non-empty one
                old = join(root, layout.aside_name(final.name))
                storage.rename(target, old)
            storage.rename(tmp, target)  # the commit
            storage.sync_directory(root)
        except BaseException:
            if old is not None and not storage.exists(target):
                storage.rename(old, target)
            storage.remove_tree(tmp)
            raise
        if old is not None:
            storage.remove_tree(old)

    def _committed(self) -> list[tuple[int, str]]:
        return layout.committed(self._storage, self._root)


def _check_names(state: Any, method: str) -> None:
    if not isinstance(state, dict):
        raise ValueError(
            f"{method} expects a dict of name -> object, got a "
            f"{type(state).__name__}; wrap it, e.g. {{'model': model}}"
        )
    for name in state:
        if not isinstance(name, str):
            raise ValueError(f"state key {name!r} is a {type(name).__name__}; names must be str")
