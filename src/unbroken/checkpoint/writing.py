"""Writing a checkpoint, every rank together: rank 0 opens the temporary directory, each rank
writes its entries' files into it (``entries``: one class per kind), rank 0 seals the manifest
once all are durable, commits it through the storage and drops what is no longer kept. A
survivor's save for a rank that died writes every rank's files alone (``write_alone``), after
one holder of each shard of a sharded entry wrote it into the staged directory (``stage``,
``write_shards``).

A checkpoint that ``load_latest`` read and found damaged (``Writing.damaged``) is never deleted:
the next save moves it into ``damaged/`` beside the checkpoints (``quarantine``), the evidence
of what damaged it. A checkpoint of a larger step than the one saved that was not found damaged
(one that could not be read, a store that did not answer, or one never read, a new
Checkpointer's save into a directory of a later run) may be good, so the save is refused before
anything is written, naming it. The check lists the directory only when a larger step may be
there: before the first save that follows no listing, and when saving below the largest step
seen.

A save asks which checkpoints are committed with one listing (``Storage.committed_among``; an
object store lists every object under the directory at once, 1,000 a request), never once per
checkpoint kept, so its requests do not grow with ``keep``."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from . import layout
from .entries import EACH_RANK, KINDS, REPLICATED, THROUGH_DCP, Kind, Part
from .group import CheckpointGroup, attempt
from .layout import MANIFEST, EntrySpec, ParamShapes, param_shapes, seal
from .sharded import Sharded
from .space import FULL, disk_full
from .storage import Digest, Storage, basename, join
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
        moves them aside (``quarantine``)."""
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
