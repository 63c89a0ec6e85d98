"""Writing a checkpoint, every rank together: rank 0 opens the temporary directory, each rank writes
its entries' files into it (``entries``: one class per kind), rank 0 seals the manifest
(``layout.seal``) once all are durable, commits it through the storage (``Storage.commit``) and
drops what is no longer kept. A survivor's save for a rank that died writes every rank's files
alone (``write_alone``), after one holder of each shard of a sharded entry wrote it into the staged
directory (``stage``, ``write_shards``).

A checkpoint that ``load_latest`` read and found damaged (``Writing.damaged``) is never deleted:
the next save moves it into ``damaged/`` beside the checkpoints (``verdict.move_aside``), the
evidence of what damaged it. A checkpoint of a larger step than the one saved that was not found
damaged (one that could not be read, a store that did not answer, or one never read, a new
Checkpointer's save into a directory of a later run) may be good, so the save is refused before
anything is written, naming it. The check lists the directory only when a larger step may be there:
before the first save that follows no listing, and when saving below the largest step seen.

A save asks which checkpoints are committed with one listing (``Storage.committed_among``; an
object store lists every object under the directory at once, 1,000 a request), never once per
checkpoint kept, so its requests do not grow with ``keep``.

**Background saves** (``BackgroundSave``): a thread per save, whose error reaches the caller or,
failing that, stderr. A ``save(blocking=False)`` that fails is raised by the Checkpointer's next
``save``, ``wait``, ``load_latest`` or ``close``. A script that calls none of these before it ends
would lose the failure silently, so every background save stays in a registry until its outcome was
handed over (or it was forgotten: a rank it needs died, ``Checkpointer.forget_background``), and an
``atexit`` hook (registered by the first background save, not at import) prints each failure nobody
saw to stderr: the checkpoint, the error with its traceback, and how to have it raised instead.
Python joins the writer threads (they are not daemons) before it runs atexit hooks, so a pending
save is finished by then, never cut off.

The exit status stays what the script made it. An atexit hook can change it only with
``os._exit``, which would skip the rest of the interpreter's shutdown (other libraries' exit
hooks, flushing files the script left open) and overwrite a status the script chose, such as a
requeue code after a preemption. Nothing is lost on disk: the directory still holds the earlier
checkpoints, and ``load_latest`` resumes from the newest of them.

**Room for a checkpoint**: how much one needs, and an error that says so when the disk is full.
``disk_full`` turns ENOSPC (and EDQUOT) into an ``OSError`` of the same errno that says the disk is
full, how much the checkpoint needs, how much is free and how much the kept checkpoints take.
``estimate_size`` walks the state once (no copy, no serialization); it runs only after a save
failed for want of space.
"""

from __future__ import annotations

import atexit
import errno
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._units import human
from . import layout
from .entries import EACH_RANK, KINDS, REPLICATED, THROUGH_DCP, Kind, Part
from .group import CheckpointGroup, attempt
from .layout import MANIFEST, EntrySpec, ParamShapes, param_shapes, seal
from .sharded import Sharded
from .storage import Digest, Storage, basename, join, parent
from .verdict import move_aside

Written = dict[str, Part]  # one rank's files, by entry name


class Staged(NamedTuple):
    """A checkpoint's temporary directory (``Writing.stage``) with its ``Sharded`` entries
    written, for ``write_alone`` to add the rest and seal."""

    tmp: str
    shards: dict[str, Part]  # each Sharded entry's files, from all the ranks that wrote them
    order: dict[str, int]  # every entry's number in the file names, as the shards' folder has


class Writing:
    """The write path of a ``Checkpointer`` (``manager``) over its storage and ranks."""

    def __init__(self, storage: Storage, root: str, group: CheckpointGroup, keep: int) -> None:
        self.storage, self.root, self.group, self.keep = storage, root, group, keep
        self.damaged: dict[str, list[str]] = {}
        """Checkpoints that ``load_latest`` read and skipped as corrupt, with why: the next save
        moves them aside (``verdict.move_aside``)."""
        self.newest: int | None = None  # the largest committed step seen (None: not listed)

    def seen(self, steps: list[int]) -> None:
        """The steps of the committed checkpoints, as ``load_latest`` listed them."""
        self.newest = max(steps, default=-1)

    def write(
        self,
        step: int,
        final: str,
        mine: dict[str, tuple[Kind, Any]],
        shapes: dict[str, ParamShapes],
        order: dict[str, int],
    ) -> None:
        """Every rank: rank 0 opens the temporary directory, each writes its files into it,
        rank 0 seals and commits it once all are durable, then, once all know, drops the
        oldest."""
        ranks, storage, first = self.group, self.storage, self.group.world.first
        phase = f"writing checkpoint step {step}"
        tmp = None
        try:
            tmp = ranks.settle(attempt(self._open, step) if first else None, phase)[0]
            assert tmp is not None
            written = ranks.settle(attempt(self._write_files, tmp, mine, order), phase)
            sealed = attempt(self._seal, step, tmp, final, written, shapes) if first else None
            ranks.settle(sealed, phase)
            # Only once every rank knows the new checkpoint is committed: the old ones go.
            ranks.settle(attempt(self._drop_old, step) if first else None, phase)
        except BaseException as error:
            if first and tmp is not None:
                storage.abandon(tmp)
            if isinstance(error, OSError) and error.errno in FULL:  # this rank's own
                raise disk_full(
                    error,
                    storage,
                    self.root,
                    step,
                    {name: value for name, (_, value) in mine.items()},
                    self.keep,
                    [path for _, path in layout.committed(self.storage, self.root)],
                ) from error
            raise

    def write_alone(
        self,
        step: int,
        final: str,
        state: dict[str, Any],
        parts: dict[str, list[Any]],
        staged: Staged | None = None,
    ) -> None:
        """One process writes every rank's files (``Checkpointer.save_alone``): the replicated
        entries as rank 0, each ``parts`` entry's value for rank r as rank r's file; then the
        seal and the commit, as ``write`` does, with no collective. ``staged``: the temporary
        directory already holds the ``Sharded`` entries' files (``write_shards``)."""
        sizes = {len(values) for values in parts.values()}
        world_size = min(sizes, default=0)
        if len(sizes) != 1 or world_size < 1:
            lengths = {name: len(values) for name, values in parts.items()}
            raise ValueError(f"save_alone needs one value per rank for every entry, got {lengths}")
        if sharded := [name for name, entry in state.items() if isinstance(entry, Sharded)]:
            raise ValueError(
                f"save_alone cannot write {sharded}: a Sharded entry's shards live on every rank, "
                "and those of a rank that died are gone; save it with save() from every rank"
            )
        mine: dict[str, tuple[Kind, Any]] = {
            name: (REPLICATED, REPLICATED.prepare(entry, name, True))
            for name, entry in state.items()
        }
        shapes = {
            name: param_shapes(entry)
            for name, entry in state.items()
            if isinstance(entry, torch.optim.Optimizer)
        }
        order = {name: index for index, name in enumerate({**state, **parts})}
        tmp = None if staged is None else staged.tmp
        if staged is not None:  # numbered as in the Trainer's state, the shards' folder too
            order = {name: staged.order[name] for name in order}
        try:
            tmp = self._open(step) if tmp is None else tmp
            written = []
            for rank in range(world_size):
                theirs: dict[str, tuple[Kind, Any]] = {
                    name: (EACH_RANK, EACH_RANK.prepare(values[rank], name, True))
                    for name, values in parts.items()
                }
                written.append(
                    self._write_files(tmp, {**theirs, **mine} if rank == 0 else theirs, order, rank)
                )
            if staged is not None:
                written[0].update(staged.shards)
            self._seal(step, tmp, final, written, shapes)
            self._drop_old(step)
        except BaseException:
            if tmp is not None:
                self.storage.abandon(tmp)
            raise

    def stage(self, step: int) -> str:
        """The temporary directory of a checkpoint that ``write_alone`` will seal, for the
        ``Sharded`` entries' files written into it first (``write_shards``)."""
        return self._open(step)

    def write_shards(
        self, tmp: str, index: int, name: str, entry: Sharded, group: Any, rank: int
    ) -> Part:
        """This rank's shards of ``entry``, written through DCP into ``tmp`` (collective over
        ``group``, in which this rank is ``rank``): the same folder and files a ``write`` of
        every rank makes, from one holder of each shard."""
        value = THROUGH_DCP.prepare(entry, name, True)
        return THROUGH_DCP.write(self.storage, tmp, index, name, value, rank, group)

    def abandon(self, tmp: str) -> None:
        """Remove a temporary directory that ``stage`` made and will never be sealed."""
        self.storage.abandon(tmp)

    def _open(self, step: int) -> str:
        """Rank 0: the new checkpoint's temporary directory, after cleaning up."""
        storage, root = self.storage, self.root
        storage.make_directories(root)
        self._move_damaged()  # first: ``clean`` would put a damaged ``.old-*`` back in view
        layout.clean(storage, root)
        if self.newest is None or step < self.newest:  # a larger step may be there
            self._refuse_newer(step)
        return layout.stage(storage, root, step)

    def _move_damaged(self) -> None:
        """Rank 0: move each checkpoint found damaged into ``damaged/``; never deleted."""
        for path, problems in list(self.damaged.items()):
            if self.storage.exists(path):
                move_aside(self.storage, self.root, path, problems)
            del self.damaged[path]

    def _refuse_newer(self, step: int) -> None:
        """Raise if a checkpoint of a larger step than ``step`` is committed and was not found
        damaged: saving would leave it to be resumed from, or delete it (see the module)."""
        committed = layout.committed(self.storage, self.root)
        self.newest = max((number for number, _ in committed), default=-1)
        newer = [path for number, path in committed if number > step and path not in self.damaged]
        if newer:
            raise ValueError(
                f"unbroken.Checkpointer: cannot save step {step} in {self.root}: it holds "
                f"{[basename(path) for path in newer]}, of a larger step, which load_latest did "
                "not find damaged. Saving would leave them to be resumed from instead of this "
                "save, or delete checkpoints that may be good. Call load_latest to resume from "
                "them, delete them yourself if this run means to go back to an earlier step, "
                "or save in another directory."
            )

    def _write_files(
        self,
        tmp: str,
        mine: dict[str, tuple[Kind, Any]],
        order: dict[str, int],
        rank: int | None = None,
    ) -> Written:
        """This rank's files (or ``rank``'s, written by another), written and fsynced in ``tmp``,
        numbered by their ``order`` in the state (so an entry every rank writes has the same
        number on every rank). DCP's entries first: its collectives must not wait for a rank
        that failed on another file."""
        storage, group = self.storage, self.group.process_group
        rank = self.group.world.rank if rank is None else rank
        by_order = sorted(mine.items(), key=lambda item: order[item[0]])
        by_order.sort(key=lambda item: item[1][0] is not THROUGH_DCP)  # stable: order kept
        return {
            name: kind.write(storage, tmp, order[name], name, value, rank, group)
            for name, (kind, value) in by_order
        }

    def _seal(
        self,
        step: int,
        tmp: str,
        final: str,
        written: list[Written],
        shapes: dict[str, ParamShapes],
    ) -> None:
        """Rank 0, once every rank's files are durable: the manifest and the commit."""
        storage, root, target = self.storage, self.root, final
        entries: dict[str, EntrySpec] = {}
        files: dict[str, Digest] = {}
        folders = []
        for mine in written:  # in rank order: rank 0's names first, in its state's order
            for name, part in mine.items():
                files.update(part.files)
                entries[name] = KINDS[part.kind].describe(entries.get(name), part)
                if part.folder:
                    folders.append(join(tmp, part.folder))
        data = seal(step, entries, files, shapes, len(written))
        for folder in dict.fromkeys(folders):  # DCP fsyncs its files, not their directory
            storage.sync_directory(folder)
        storage.write(join(tmp, MANIFEST), lambda out: out.write(data))  # last: the seal
        storage.sync_directory(tmp)
        storage.commit(tmp, target, join(root, layout.aside_name(basename(final))))

    def _drop_old(self, step: int) -> None:
        """Rank 0, once every rank heard that checkpoint ``step`` is committed: those beyond the
        newest ``keep``. A larger step stays (a damaged one was moved aside by ``_open``)."""
        storage, root = self.storage, self.root
        committed = layout.committed(storage, root)
        stay = [path for number, path in committed if number > step]
        if stay:  # written since the save began: by another job?
            warnings.warn(
                f"unbroken.Checkpointer: {[basename(path) for path in stay]} in {root} have a "
                f"larger step than {step}, which was just saved, and are kept: another job may "
                "be writing this directory",
                stacklevel=2,
            )
        self.newest = max([step, *(number for number, path in committed if path in stay)])
        doomed = [path for number, path in committed if number <= step][: -self.keep]
        for path in doomed:
            layout.retire(storage, root, path)
        storage.prune_cache([path for _, path in committed if path not in doomed])


_unseen: set[BackgroundSave] = set()  # saves whose outcome no caller has been handed yet
_lock = threading.Lock()
_hooked = False


class BackgroundSave:
    """Runs ``write()`` in a thread; ``result()`` waits for it and raises what it raised."""

    def __init__(self, final: str, write: Callable[[], None]) -> None:
        global _hooked
        self.final = final
        self._write: Callable[[], None] | None = write
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"unbroken-save-{basename(final)}")
        with _lock:
            if not _hooked:
                atexit.register(_report_unseen)
                _hooked = True
            _unseen.add(self)
        self._thread.start()

    def _run(self) -> None:
        write, self._write = self._write, None
        assert write is not None  # each thread runs once
        try:
            write()
        except BaseException as error:  # handed to the caller's thread by result()
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"raised by the background save of {self.final}")
            # The frames hold the CPU copy of the state, possibly gigabytes, for as long as
            # the error lives: until result() or the end of the process.
            traceback.clear_frames(error.__traceback__)
            self._error = error
        else:
            _unseen.discard(self)
        finally:
            del write

    def done(self) -> bool:
        return not self._thread.is_alive()

    def forget(self) -> None:
        """No one will wait for it (``Checkpointer.forget_background``): its failure, expected,
        is not reported at exit."""
        with _lock:
            _unseen.discard(self)

    def result(self) -> None:
        self._thread.join()
        _unseen.discard(self)
        error, self._error = self._error, None
        if error is not None:
            raise error


def _report_unseen() -> None:
    stream = sys.stderr or sys.__stderr__
    for save in sorted(_unseen, key=lambda save: str(save.final)):
        save._thread.join()
        error = save._error
        if error is None or stream is None:
            continue
        stream.write(
            f"\nunbroken.Checkpointer: the background save of checkpoint {save.final} FAILED, "
            "and the script ended without calling wait() or close() (or another save or "
            "load_latest) on its Checkpointer, which would have raised it:\n"
            + "".join(traceback.format_exception(type(error), error, error.__traceback__))
            + f"The checkpoint was not written: load_latest resumes from the newest earlier "
            f"one in {parent(save.final)}. Call checkpointer.close() before the script ends, "
            "or use `with Checkpointer(...) as checkpointer:`, to have such a failure raised.\n"
        )
        stream.flush()
    _unseen.clear()


FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(
    error: OSError,
    storage: Storage,
    directory: str,
    step: int,
    entries: dict,
    keep: int,
    kept: list[str],
) -> OSError:
    """``error`` (ENOSPC or EDQUOT) as an ``OSError`` that says what to do; call it after the
    temporary directory is removed, so that what is free is what a new save would have."""
    assert error.errno is not None  # FULL holds it
    # Each file adds its zip directory (about 1 kB); the manifest adds about as much.
    needed = sum(estimate_size(value) + 1024 for value in entries.values()) + 1024
    free: int | None
    try:
        free = storage.free_space(directory)
    except OSError:
        free = None
    used = sum(_du(storage, path) for path in kept)
    where = (
        f"the disk holding {directory} is full"
        if error.errno == errno.ENOSPC
        else f"the disk quota that holds {directory} is used up"
    )
    message = (
        f"{os.strerror(error.errno)}: checkpoint step {step} was not saved, as {where}. It "
        f"needs about {human(needed)} ({needed} bytes, an estimate from the sizes of its "
        "tensors and values)"
        + (f" and {human(free)} ({free} bytes) are free there" if free is not None else "")
        + (
            f"; the {len(kept)} checkpoint{'s' * (len(kept) > 1)} kept there take"
            f"{'s' * (len(kept) == 1)} {human(used)}"
            if kept
            else ""
        )
        + f". Free space on that disk or give the Checkpointer a directory on a larger one (it "
        f"needs room for keep={keep} checkpoints plus the one being written). Nothing was "
        "changed: the earlier checkpoints are as they were."
    )
    return OSError(error.errno, message)


def estimate_size(value: Any, seen: set | None = None) -> int:
    """About how many bytes ``torch.save`` writes for ``value``: tensors' storages (each once,
    as torch.save writes them) plus its plain values, and a little for each container."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        try:
            storage = value.untyped_storage()
            key = (storage.device, storage.data_ptr(), storage.nbytes())
            if key in seen:
                return 0
            seen.add(key)
            return storage.nbytes() + 400
        except (NotImplementedError, RuntimeError):  # sparse and others: an upper bound
            return value.numel() * value.element_size() + 400
    if isinstance(value, dict):
        return 16 + sum(estimate_size(k, seen) + estimate_size(v, seen) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return 16 + sum(estimate_size(item, seen) for item in value)
    if isinstance(value, (str, bytes, bytearray)):
        return 8 + len(value)
    return 16 if not isinstance(value, int) else 8 + value.bit_length() // 8


def _du(storage: Storage, directory: str) -> int:
    """The bytes of the files directly in ``directory`` (a checkpoint has no subdirectories)."""
    try:
        return sum(
            storage.size(join(directory, entry.name))
            for entry in storage.list_directory(directory)
            if not entry.is_directory
        )
    except OSError:
        return 0
