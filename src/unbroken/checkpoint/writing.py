"""Writing a checkpoint, every rank together: rank 0 opens the temporary directory, each rank
writes its entries' files into it (``entries``: one class per kind), rank 0 seals the manifest
once all are durable, commits it through the storage and drops what is no longer kept."""

from __future__ import annotations

import warnings
from typing import Any

from . import layout
from .entries import KINDS, THROUGH_DCP, Kind, Part
from .group import Ranks, attempt
from .manifest import MANIFEST, EntrySpec, ParamShapes, seal
from .space import FULL, disk_full
from .storage import Digest, Storage, basename, join

Written = dict[str, Part]  # one rank's files, by entry name


class Writing:
    """The write path of a ``Checkpointer`` (``manager``) over its storage and ranks."""

    def __init__(self, storage: Storage, root: str, ranks: Ranks, keep: int) -> None:
        self.storage, self.root, self.ranks, self.keep = storage, root, ranks, keep

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
        ranks, storage, first = self.ranks, self.storage, self.ranks.first_rank
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
            if first and tmp is not None and not _committed(storage, tmp):
                storage.remove_tree(tmp)
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

    def _open(self, step: int) -> str:
        """Rank 0: the new checkpoint's temporary directory, after cleaning up."""
        storage, root = self.storage, self.root
        storage.make_directories(root)
        layout.clean(storage, root)
        return layout.stage(storage, root, step, join(root, layout.final_name(step)))

    def _write_files(
        self, tmp: str, mine: dict[str, tuple[Kind, Any]], order: dict[str, int]
    ) -> Written:
        """This rank's files, written and fsynced in ``tmp``, numbered by their ``order`` in the
        state (so an entry every rank writes has the same number on every rank). DCP's entries
        first: its collectives must not wait for a rank that failed on another file."""
        rank, storage, group = self.ranks.rank, self.storage, self.ranks.group
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
        """Rank 0, once every rank heard that checkpoint ``step`` is committed: the checkpoints
        of a larger step (a run that went back) and those beyond the newest ``keep``."""
        storage, root = self.storage, self.root
        committed = layout.committed(self.storage, self.root)
        doomed = [path for number, path in committed if number > step]
        if doomed:
            warnings.warn(
                f"unbroken.Checkpointer: {[basename(path) for path in doomed]} in {root} have a "
                f"larger step than {step} and are removed now that step {step} is saved, so that "
                "load_latest resumes from this save",
                stacklevel=2,
            )
        doomed += [path for number, path in committed if number <= step][: -self.keep]
        for path in doomed:
            layout.retire(storage, root, path)
        prune_cache = getattr(storage, "prune_cache", None)  # ObjectStorage's local copies
        if prune_cache is not None:
            prune_cache([path for _, path in committed if path not in doomed])


def _committed(storage: Storage, staged: str) -> bool:
    """Whether the checkpoint written in ``staged`` was committed before the save failed (on a
    store without rename it is written in place: its manifest says so); if that cannot be told,
    it is left for ``layout.clean``."""
    if storage.renames:
        return False  # renamed away if committed: what is left at ``staged`` is not
    try:
        return storage.exists(join(staged, MANIFEST))
    except Exception:
        return True
