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

Under ``torch.distributed`` (an initialized process group of more than one rank) every call
is collective, and one checkpoint holds the whole job: each entry of ``state`` is written once,
by rank 0, except ``PerRank`` entries, of which every rank writes its own part. Rank 0 opens the
temporary directory, every rank writes and fsyncs its files into it, and only when all report
their files durable does rank 0 write the manifest (listing every rank's files with their
sha256) and rename the directory into place; a rank's failure raises on every rank (the others
get a ``RankFailure``) and commits nothing. ``load_latest`` tries the checkpoints that rank 0
lists, newest first; one that any rank finds incomplete or corrupt is skipped by all, so ranks
never load different steps. The ranks must see one directory (checked when the Checkpointer
is made: ``DirectoryNotShared``); a rank that died or does not arrive becomes a
``RankFailure`` after ``timeout`` seconds (``group``).

The parts: ``layout`` (the names above, and cleaning up after killed writers),
``weights_only`` (what save refuses), ``storage`` (the filesystem operations, as the
protocol ``Storage``: hashed, fsynced writes, renames, listing), ``space`` (disk-full errors),
``manifest`` (the seal and its schema; reading a checkpoint), ``group`` (the ranks and how
they agree), ``per_rank`` (``PerRank`` entries, and what a job on another number of ranks loads), ``background`` (saves with
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
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, TypeVar

import torch

from .._checks import is_int, is_number
from .._state import has_state
from ..errors import CorruptCheckpoint, StateMismatch
from . import layout
from .background import BackgroundSave
from .group import Ranks
from .manifest import (
    FORMAT,
    MANIFEST,
    VERSION,
    EntrySpec,
    Manifest,
    ParamShapes,
    check_entry,
    dcp_folder,
    file_name,
    load_file,
    read_manifest,
    seal,
    verify_file,
)
from .per_rank import SKIP, PerRank, resized, unwrap
from .restore import Restored, restore
from .sharded import Sharded, save_state, written_by
from .space import FULL, disk_full
from .storage import Digest, LocalStorage, Storage, basename, join, parents, sha256
from .weights_only import checked_copy

__all__ = ["FORMAT", "MANIFEST", "VERSION", "Checkpointer", "PerRank", "Restored"]

T = TypeVar("T")


class Part(NamedTuple):
    """What one rank wrote of one entry: ``kind`` "file" (rank 0's replicated entry), "ranks"
    (its part of a ``PerRank`` one) or "dcp" (its shards of a ``Sharded`` one, under ``folder``)."""

    kind: str
    files: list[tuple[str, Digest]]
    folder: str = ""


Written = dict[str, Part]  # one rank's files, by entry name


class Checkpointer:
    """Saves and restores ``state`` dicts in ``directory``, keeping the newest ``keep`` saves.

    ``state`` maps str names to objects with ``state_dict``/``load_state_dict`` (modules,
    optimizers, schedulers, ``GradScaler``, ``unbroken.DataLoader``, yours) or to plain values
    (dicts, lists, tuples, str, int, float, bool, None, tensors; sets, bytearray and complex
    where the installed torch loads them), any of them wrapped in ``PerRank`` to be saved by
    every rank of a ``torch.distributed`` job (rank 0 writes the others).

    One job writes to a directory at a time: before each save, the writer removes what killed
    writers left behind. Processes that only ``load_latest`` change nothing on disk. Under
    ``torch.distributed``, every rank makes the Checkpointer (collectively, in the same order
    as its other collectives) and calls its ``save`` and ``load_latest`` together; ``timeout``
    (seconds) bounds how long one waits for the others. Raises ``NotADirectoryError`` if
    ``directory`` is a file (or lies under one), ``DirectoryNotShared`` if the ranks do not
    see one directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 2,
        *,
        timeout: float = 600.0,
        storage: Storage | None = None,
    ) -> None:
        if not is_int(keep) or keep < 2:
            raise ValueError(
                f"keep must be an int >= 2, got {keep!r}: with a single checkpoint, one that is "
                "corrupted (a disk error, a truncated copy) leaves nothing to resume from"
            )
        if not is_number(timeout) or not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.directory = os.fspath(directory)  # a path or a URI, as the storage takes it
        self.keep = keep
        self._storage: Storage = storage if storage is not None else LocalStorage()
        self._root = self.directory
        self._pending: BackgroundSave | None = None
        self._ranks = Ranks(float(timeout))
        self._ranks.settle(_attempt(self._check_directory), "checking the directory")
        self._ranks.check_shared(self._storage, self._root)

    @property
    def rank(self) -> int:
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        return self._ranks.world_size

    def save(self, step: int, state: dict[str, Any], blocking: bool = True) -> str:
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
        were. Under ``torch.distributed``, a failure on any rank raises on every rank (a
        ``RankFailure`` on the others) and nothing is committed; so do ranks that give
        different steps or different ``PerRank`` names.
        """
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0 (the training step), got {step!r}")
        _check_names(state, "save")
        self.wait()
        ranks = self._ranks
        prepared = _attempt(self._prepare, state, blocking)
        shown = prepared if isinstance(prepared, BaseException) else (step, sorted(prepared[1]))
        agreed = ranks.settle(shown, f"preparing checkpoint step {step}")
        if any(other != agreed[0] for other in agreed):
            raise ValueError(
                "the ranks called Checkpointer.save with different steps or PerRank entries "
                f"({dict(enumerate(agreed))}, as rank: (step, PerRank names)); every rank must "
                "save the same step with the same names"
            )
        assert not isinstance(prepared, BaseException)  # settle raised it
        replicated, own, shapes = prepared
        if ranks.first_rank:
            try:
                newer = [basename(path) for number, path in self._committed() if number > step]
            except OSError:  # the save itself will say what is wrong, on every rank
                newer = []
            if newer:
                warnings.warn(
                    f"unbroken.Checkpointer: {newer} in {self.directory} have a larger step than "
                    f"{step} and will be removed once step {step} is saved, so that load_latest "
                    "resumes from this save",
                    stacklevel=2,
                )
        final = join(self._root, layout.final_name(step))
        order = {name: index for index, name in enumerate(state)}
        if blocking:
            self._write(step, final, replicated, own, shapes, order)
        else:
            self._pending = BackgroundSave(
                final, lambda: self._write(step, final, replicated, own, shapes, order)
            )
        return final

    def _prepare(
        self, state: dict[str, Any], blocking: bool
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, ParamShapes]]:
        """This rank's copies of what it writes: the replicated entries (rank 0's), its own
        parts of the ``PerRank`` and ``Sharded`` ones (``Sharded``: DCP's state, local shards
        cloned for a background write), and the parameter shapes of each optimizer."""
        self._check_directory()
        replicated: dict[str, Any] = {}
        own: dict[str, Any] = {}
        shapes: dict[str, ParamShapes] = {}
        for name, entry in state.items():
            if isinstance(entry, Sharded):
                own[name] = _Shards(entry.state_dict(), clone=not blocking)
                continue
            per_rank = isinstance(entry, PerRank)
            if not per_rank and not self._ranks.first_rank:
                continue  # rank 0 writes it
            obj = unwrap(entry)
            value = obj.state_dict() if has_state(obj) else obj
            # A background write needs its own copy: training goes on changing the tensors.
            copy = checked_copy(value, f"state[{name!r}]", clone=not blocking)
            (own if per_rank else replicated)[name] = copy
            if isinstance(obj, torch.optim.Optimizer) and not per_rank:
                # lets load name a parameter that changed
                shapes[name] = [
                    [list(p.shape) for p in group["params"]] for group in obj.param_groups
                ]
        return replicated, own, shapes

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
        did not name in its ``unrequested``, with the checkpoint's ``step``, ``path`` and
        ``world_size``. A ``Restored`` is always true, so ``if restored:`` means "resumed".
        Each invalid checkpoint (truncated, a flipped byte, a malformed manifest, a rank's part
        missing, ...) is skipped with a warning saying why (the ``CorruptCheckpoint`` it is).
        Raises ``StateMismatch`` if the newest valid checkpoint lacks a name of ``state``, does
        not fit its modules or optimizers (shapes are compared before anything is restored),
        has another format version, or holds a ``PerRank`` entry saved by another number of
        ranks whose ``resize`` is ``"refuse"``; ``ValueError`` (of the kind the object raised,
        if unbroken defines it) if an object rejects its entry; ``NotADirectoryError`` if the
        directory is a file. Under ``torch.distributed`` every rank restores the same step, and
        an error on one rank raises on all.
        """
        _check_names(state, "load_latest")
        self.wait()
        ranks = self._ranks
        listed = _attempt(self._candidates if ranks.first_rank else self._check_directory)
        found: list[tuple[int, str]] = ranks.settle(listed, "listing the checkpoints")[0]
        for step, where in reversed(found):
            path = where
            read = _attempt(self._read, where, step, state)
            # Only the verdict travels (None: fine), never the state read.
            verdict = read if isinstance(read, BaseException) else None
            verdicts = ranks.settle(verdict, f"reading checkpoint {path}", CorruptCheckpoint)
            corrupt = [(r, v) for r, v in enumerate(verdicts) if isinstance(v, CorruptCheckpoint)]
            if corrupt:
                why = "; ".join(
                    f"rank {r}: {v}" if ranks.world_size > 1 else str(v) for r, v in corrupt
                )
                warnings.warn(
                    f"unbroken.Checkpointer: skipping checkpoint {path}: {why}", stacklevel=2
                )
                continue
            assert not isinstance(read, BaseException)
            manifest, saved, skipped = read
            # DCP's entries last, and only once all the others are in: it loads collectively.
            sharded = {n: o for n, o in state.items() if isinstance(o, Sharded) and n in saved}
            objects = {
                name: unwrap(obj)
                for name, obj in state.items()
                if name not in skipped and name not in sharded
            }
            restored = _attempt(restore, objects, saved, manifest["entries"], path)
            ranks.settle(restored, f"restoring checkpoint {path}")
            for name, obj in sharded.items():
                loaded = _attempt(obj.load, saved[name], ranks.group)
                ranks.settle(loaded, f"loading state[{name!r}] of checkpoint {path} with DCP")
            return Restored(
                step=step,
                path=path,
                values={name: saved[name] for name, obj in objects.items() if not has_state(obj)},
                unrequested={name: value for name, value in saved.items() if name not in state},
                world_size=manifest["world_size"],
            )
        return None

    def _candidates(self) -> list[tuple[int, str]]:
        self._check_directory()
        return layout.candidates(self._storage, self._root)

    def _read(
        self, where: str, step: int, state: dict[str, Any]
    ) -> tuple[Manifest, dict[str, Any], list[str]]:
        """What this rank restores from checkpoint ``where``: its manifest, the entries by
        name, and the ``PerRank`` names whose ``resize`` leaves the object as it is."""
        storage, ranks = self._storage, self._ranks
        manifest = read_manifest(storage, where, step)
        saved_world = manifest["world_size"]
        saved: dict[str, Any] = {}
        skipped: list[str] = []
        for index, (name, entry) in enumerate(manifest["entries"].items()):
            parts: list[Any] | None = None  # saved per rank, to resize for this world size
            if isinstance(state.get(name), Sharded) != ("dcp" in entry) and name in state:
                raise StateMismatch(
                    f"checkpoint {where}",
                    f"entries[{name!r}]",
                    "a DCP directory" if "dcp" in entry else "a file",
                    type(state[name]).__name__,
                    message=(
                        f"checkpoint {where}: state[{name!r}] was saved "
                        + (
                            "through DCP by a Sharded(model, optimizers): load it with one"
                            if "dcp" in entry
                            else "as one object, not by a Sharded: load it as it was saved"
                        )
                    ),
                )
            if "dcp" in entry:
                if name in state:  # each rank checks its share of the files; DCP reads them
                    for i, file in enumerate(entry["shards"]):
                        if i % ranks.world_size == ranks.rank:
                            verify_file(storage, where, manifest, file)
                    saved[name] = join(where, entry["dcp"])
            elif "file" in entry:
                # Every rank loads a replicated file, one checks its sha256: a rank that finds
                # it changed makes every rank skip the checkpoint (load_latest's agreement).
                mine = index % ranks.world_size == ranks.rank
                value = load_file(storage, where, manifest, entry["file"], verify=mine)
                check_entry(name, entry, value)
                if isinstance(state.get(name), PerRank) and saved_world != ranks.world_size:
                    parts = [value]  # version 1 wrote per-rank state as one file (one rank)
                else:
                    saved[name] = value
            elif saved_world == ranks.world_size:
                saved[name] = load_file(storage, where, manifest, entry["ranks"][ranks.rank])
            elif name in state:  # another number of ranks: resize, if it may
                parts = [load_file(storage, where, manifest, file) for file in entry["ranks"]]
            if parts is not None:
                value = resized(state[name], name, parts, ranks.rank, ranks.world_size, where)
                if value is SKIP:
                    skipped.append(name)
                else:
                    saved[name] = value
            # else: another rank's part of an entry nobody asked for means nothing here
        return manifest, saved, skipped

    def _check_directory(self) -> None:
        """Refuse a file where the directory should be: no checkpoint would ever be found in it,
        and a Trainer would start over from step 0 and rewrite its log."""
        storage = self._storage
        if storage.is_directory(self._root):
            return
        # Nothing there (the first save creates it), unless a file blocks the way to it.
        blocker = next(
            (p for p in parents(self._root) if storage.exists(p) and not storage.is_directory(p)),
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
        self,
        step: int,
        final: str,
        replicated: dict[str, Any],
        own: dict[str, Any],
        shapes: dict[str, ParamShapes],
        order: dict[str, int],
    ) -> None:
        """Every rank: rank 0 opens the temporary directory, each writes its files into it,
        rank 0 seals and renames it once all are durable, then drops the oldest."""
        ranks, storage, first = self._ranks, self._storage, self._ranks.first_rank
        phase = f"writing checkpoint step {step}"
        tmp = None
        try:
            tmp = ranks.settle(_attempt(self._open, step) if first else None, phase)[0]
            assert tmp is not None
            written = ranks.settle(_attempt(self._write_files, tmp, replicated, own, order), phase)
            sealed = _attempt(self._seal, step, tmp, final, written, shapes) if first else None
            ranks.settle(sealed, phase)
        except BaseException as error:
            if first and tmp is not None:
                storage.remove_tree(tmp)
            if isinstance(error, OSError) and error.errno in FULL:  # this rank's own
                raise disk_full(
                    error,
                    storage,
                    self._root,
                    step,
                    {**replicated, **own},
                    self.keep,
                    [path for _, path in self._committed()],
                ) from error
            raise

    def _open(self, step: int) -> str:
        """Rank 0: the new checkpoint's temporary directory, after cleaning up."""
        storage, root = self._storage, self._root
        storage.make_directories(root)
        layout.clean(storage, root)
        tmp = join(root, layout.temporary_name(step))
        storage.make_directory(tmp)
        return tmp

    def _write_files(
        self, tmp: str, replicated: dict[str, Any], own: dict[str, Any], order: dict[str, int]
    ) -> Written:
        """This rank's files, written and fsynced in ``tmp``, numbered by their ``order`` in the
        state (so a ``PerRank`` entry has the same number on every rank). ``Sharded`` entries
        first: DCP's collectives must not wait for a rank that failed on another file."""
        written: Written = {}
        rank, storage, group = self._ranks.rank, self._storage, self._ranks.group
        by_order = sorted({**replicated, **own}.items(), key=lambda item: order[item[0]])
        for name, value in sorted(by_order, key=lambda item: not isinstance(item[1], _Shards)):
            index = order[name]
            if isinstance(value, _Shards):
                folder = dcp_folder(index, name)
                save_state(value.state, join(tmp, folder), group)
                names = [entry.name for entry in storage.list_directory(join(tmp, folder))]
                files = [
                    (f"{folder}/{file}", _digest(storage, join(join(tmp, folder), file)))
                    for file in written_by(names, rank)
                ]
                written[name] = Part("dcp", files, folder)
                continue
            per_rank = name in own
            file = file_name(index, name, rank if per_rank else None)
            try:
                digest = storage.write(join(tmp, file), partial(torch.save, value))
            except Exception as error:
                if not isinstance(error, OSError) and hasattr(error, "add_note"):
                    error.add_note(f"raised by torch.save of state[{name!r}]")
                raise
            written[name] = Part("ranks" if per_rank else "file", [(file, digest)])
        return written

    def _seal(
        self,
        step: int,
        tmp: str,
        final: str,
        written: list[Written],
        shapes: dict[str, ParamShapes],
    ) -> None:
        """Rank 0, once every rank's files are durable: the manifest, the rename that commits
        the checkpoint, and the removal of what no longer is kept."""
        storage, root, target = self._storage, self._root, final
        entries: dict[str, EntrySpec] = {}
        files: dict[str, Digest] = {}
        folders = []
        for mine in written:  # in rank order: rank 0's names first, in its state's order
            for name, part in mine.items():
                files.update(part.files)
                listed = [file for file, _ in part.files]
                if part.kind == "file":
                    entries[name] = EntrySpec(file=listed[0])
                elif part.kind == "ranks":
                    entries.setdefault(name, EntrySpec(ranks=[]))["ranks"] += listed
                else:
                    spec = entries.setdefault(name, EntrySpec(dcp=part.folder, shards=[]))
                    spec["shards"] = sorted(spec["shards"] + listed)
                    folders.append(join(tmp, part.folder))
        data = seal(step, entries, files, shapes, len(written))
        for folder in dict.fromkeys(folders):  # DCP fsyncs its files, not their directory
            storage.sync_directory(folder)
        storage.write(join(tmp, MANIFEST), lambda out: out.write(data))  # last: the seal
        storage.sync_directory(tmp)
        storage.commit(tmp, target, join(root, layout.aside_name(basename(final))))
        committed = self._committed()
        doomed = [path for number, path in committed if number > step]
        doomed += [path for number, path in committed if number <= step][: -self.keep]
        for path in doomed:
            # Renamed first, so that a writer killed mid-delete leaves no half checkpoint in view.
            aside = join(root, layout.doomed_name(basename(path)))
            storage.rename(path, aside)
            storage.remove_tree(aside)

    def _committed(self) -> list[tuple[int, str]]:
        return layout.committed(self._storage, self._root)


class _Shards:
    """A ``Sharded`` entry's DCP state to write; cloned (its local shards, where they are) for a
    background write, as training goes on changing the tensors."""

    def __init__(self, state: Any, clone: bool) -> None:
        self.state = _cloned(state) if clone else state


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()  # a DTensor clones its local shard: no communication
    if isinstance(value, dict):
        return {key: _cloned(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cloned(item) for item in value)
    return value


def _digest(storage: Storage, path: str) -> Digest:
    return Digest(sha256(storage, path), storage.size(path))


def _attempt(function: Callable[..., T], *args: Any) -> T | BaseException:
    """``function(*args)``, or the exception it raised: what a rank hands to ``Ranks.settle``,
    so that a failure on one rank reaches the others instead of leaving them waiting."""
    try:
        return function(*args)
    except BaseException as error:
        return error


def _check_names(state: Any, method: str) -> None:
    if not isinstance(state, dict):
        raise ValueError(
            f"{method} expects a dict of name -> object, got a "
            f"{type(state).__name__}; wrap it, e.g. {{'model': model}}"
        )
    for name in state:
        if not isinstance(name, str):
            raise ValueError(f"state key {name!r} is a {type(name).__name__}; names must be str")
