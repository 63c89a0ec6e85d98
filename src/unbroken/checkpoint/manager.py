"""``unbroken.Checkpointer``: atomic, verified, rotating checkpoints of a dict of stateful things.

Layout of ``save(123, {"model": ..., "optimizer": ...})``::

    <directory>/step-000000123/000-model.pt       one torch.save file per entry, in state order
                              /001-optimizer.pt
                              /manifest.json      format, version, step, entry -> file, the
                                                  sha256 and size of every file, its own sha256
    <directory>/.tmp-step-000000123-<pid>-<hex>/  a save in progress, or a killed one: ignored
    <directory>/damaged/<time>-step-000000130/    one load_latest found damaged, moved aside by
                                                  the next save (``verdict``): never deleted

Everything is written and fsynced in the hidden ``.tmp-*`` directory, the manifest last; the
directory is then renamed into place, so a SIGKILL at any instant leaves the previous
checkpoints or the new complete one. ``load_latest`` tries checkpoints newest first, skips
(with a warning) any that do not check out, and restores the newest good one in place. Files
are read with ``torch.load(weights_only=True)``, which runs no code, so ``save`` refuses any
value such a load could not rebuild: what saves, loads.

Under ``torch.distributed`` every call is collective; one checkpoint holds the whole job. Rank 0
writes each entry once (every rank its ``PerRank`` entries), and the manifest once every rank's
files are durable. A rank's failure raises on every rank (``group``) and commits nothing; a
checkpoint any rank finds corrupt is skipped by all, so ranks never load different steps.

The parts: ``writing`` (the write path: stage, write, seal, commit; background saves; the
disk-full error) and ``loading`` (the read path: list, verify, load, restore), ``entries``
(replicated, per rank, DCP; ``PerRank``), ``layout`` (names, cleanup, the manifest and its
checks), ``verdict`` (the judgement of a checkpoint; damaged ones moved aside), ``storage`` (the
``Storage`` protocol, with the commit protocol: another backend is one new class; ``local``,
``fsspec_storage``), ``weights_only``, ``group`` (how ranks agree), ``sharded``.

Costs: a save writes each byte once, hashed on the way (sha256: ~1 GB/s a core), one fsync per
file, two per directory; ``blocking=False`` blocks while the state is copied to CPU memory.
``load_latest`` reads each file twice (the hash, then ``torch.load`` from the page cache).
"""

from __future__ import annotations

import errno
import os
from typing import Any, TypeVar

import torch

from .._checks import check_keep, is_int, is_number
from ..errors import RemoteUnavailable
from . import layout
from .entries import Kind, Part, PerRank, kind_of
from .fsspec_storage import REMOTE_TIMEOUT, storage_for
from .group import CheckpointGroup, attempt
from .layout import FORMAT, MANIFEST, VERSION, ParamShapes, param_shapes
from .loading import Loading, Restored
from .sharded import Sharded
from .storage import Storage, join
from .writing import BackgroundSave, Staged, Writing

__all__ = ["FORMAT", "MANIFEST", "VERSION", "Checkpointer", "PerRank", "Restored"]

T = TypeVar("T")


Written = dict[str, Part]  # one rank's files, by entry name


class Checkpointer:
    """Saves and restores ``state`` dicts in ``directory``, keeping the newest ``keep`` saves.

    ``state`` maps str names to objects with ``state_dict``/``load_state_dict`` or to plain
    values (dicts, lists, str, numbers, None, tensors). ``PerRank`` entries are saved by every
    rank. One job writes to a directory at a time; under ``torch.distributed`` every rank makes
    the Checkpointer and calls ``save`` and ``load_latest`` together.

    Args:
        directory: A local path, or a URL in object storage (``s3://bucket/run/ckpt``, any
            installed fsspec protocol), where the manifest, uploaded last, commits.
        keep: How many of the newest checkpoints to keep; at least 2.
        timeout: Seconds a rank waits for the others before a ``RankFailure``.
        storage: A ``Storage`` of your own, replacing the storage altogether.
        storage_options: The fsspec options of a URL's filesystem (endpoint, credentials).
        remote_timeout: Seconds an operation on the store may go without progress before it
            fails with ``RemoteUnavailable``.

    Raises:
        ValueError: ``keep`` or ``timeout`` is out of range, or a URL's protocol is unknown.
        NotADirectoryError: ``directory`` is a file or lies under one.
        DirectoryNotShared: the ranks do not see one directory.
        FileNotFoundError: a URL's bucket does not exist.
        RemoteUnavailable: a URL's endpoint does not answer.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 2,
        *,
        timeout: float = 600.0,
        storage: Storage | None = None,
        storage_options: dict[str, Any] | None = None,
        remote_timeout: float = REMOTE_TIMEOUT,
    ) -> None:
        check_keep("keep", keep)
        if not is_number(timeout) or not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.keep = keep
        if storage is None:
            storage, directory = storage_for(
                os.fspath(directory), storage_options, timeout=remote_timeout
            )
        self.directory = os.fspath(directory)  # a path or a URL, as the storage takes it
        self._storage: Storage = storage
        self._root = self.directory
        self._pending: BackgroundSave | None = None
        self._pending_step = 0  # the background save's step, while ``_pending`` is set
        self._group = CheckpointGroup(float(timeout))
        self._group.settle(attempt(self._check_directory), "checking the directory")
        self._group.check_shared(self._storage, self._root)
        self._writing = Writing(self._storage, self._root, self._group, keep)
        self._loading = Loading(
            self._storage, self._root, self._group, self._writing, self._check_directory
        )

    @property
    def rank(self) -> int:
        """This process's rank (0 without ``torch.distributed``)."""
        return self._group.world.rank

    @property
    def world_size(self) -> int:
        """The number of ranks (1 without ``torch.distributed``)."""
        return self._group.world.size

    def save(self, step: int, state: dict[str, Any], blocking: bool = True) -> str:
        """Write ``state`` as checkpoint ``step``.

        A checkpoint of the same step is replaced. Checkpoints that ``load_latest`` skipped as
        corrupt are moved into ``damaged/`` beside them, never deleted (the newest 3 stay
        there), with a warning saying where. Then only the newest ``keep`` remain.

        Args:
            step: The training step, an int >= 0.
            state: Names mapped to stateful objects or plain values (see the class).
            blocking: If False, return once ``state`` is copied to CPU memory and write in a
                background thread. The next ``save``, ``wait``, ``load_latest`` or ``close``
                waits for it and re-raises what it raised.

        Returns:
            The checkpoint's final directory.

        Raises:
            ValueError: before writing anything: a bad ``step``, a larger step not found
                damaged, ranks that disagree, or a value ``torch.load(weights_only=True)``
                could not rebuild (named by its key path).
            OSError: ENOSPC, saying how much is needed and free; earlier checkpoints stay.
        """
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0 (the training step), got {step!r}")
        _check_names(state, "save")
        self.wait()
        ranks = self._group
        prepared = attempt(self._prepare, state, blocking)
        shown = (
            prepared if isinstance(prepared, BaseException) else (step, _every_rank(prepared[0]))
        )
        agreed = ranks.settle(shown, f"preparing checkpoint step {step}")
        if any(other != agreed[0] for other in agreed):
            raise ValueError(
                "the ranks called Checkpointer.save with different steps or PerRank entries "
                f"({dict(enumerate(agreed))}, as rank: (step, PerRank names)); every rank must "
                "save the same step with the same names"
            )
        assert not isinstance(prepared, BaseException)  # settle raised it
        mine, shapes = prepared
        final = join(self._root, layout.final_name(step))
        order = {name: index for index, name in enumerate(state)}
        if blocking:
            self._writing.write(step, final, mine, shapes, order)
        else:
            self._pending = BackgroundSave(
                final, lambda: self._writing.write(step, final, mine, shapes, order)
            )
            self._pending_step = step
        return final

    def save_alone(
        self,
        step: int,
        state: dict[str, Any],
        parts: dict[str, list[Any]],
        staged: Staged | None = None,
    ) -> str:
        """Write checkpoint ``step`` of the whole job from this process alone, no collective.

        A survivor's save for a rank that died (``train.jit``). A ``Sharded`` entry is not in
        ``state``: its holders wrote it first (``stage_alone``, ``write_shards``).

        Args:
            step: The training step, an int >= 0.
            state: The replicated entries.
            parts: Each ``PerRank`` entry's value for every rank, in rank order.
            staged: The temporary directory ``stage_alone`` made, with the ``Sharded``
                entries' files written into it; sealed with the rest, or removed on a failure.

        Returns:
            The checkpoint's final directory.

        Raises:
            ValueError: a bad ``step`` or name, or a ``Sharded`` entry in ``state``.
        """
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0 (the training step), got {step!r}")
        _check_names({**state, **parts}, "save_alone")
        final = join(self._root, layout.final_name(step))
        self._writing.write_alone(step, final, state, parts, staged)
        return final

    def stage_alone(self, step: int) -> str:
        """The temporary directory of checkpoint ``step`` for ``write_shards``, which
        ``save_alone`` then seals (``abandon`` removes it instead). No collective.

        Args:
            step: The training step, an int >= 0.

        Returns:
            The temporary directory, for every writer of shards.

        Raises:
            ValueError: a bad ``step``, or a larger step not found damaged.
        """
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0 (the training step), got {step!r}")
        return self._writing.stage(step)

    def write_shards(
        self, tmp: str, index: int, name: str, entry: Sharded, group: Any, rank: int
    ) -> Part:
        """Write this rank's shards of ``entry`` into ``tmp`` through DCP, collective over
        ``group``: one holder of each shard of an HSDP model makes the same files a ``save``
        of every rank does (``sharded.replica_shard``).

        Args:
            tmp: What ``stage_alone`` returned (on any rank).
            index: The entry's place in the state, which numbers its folder.
            name: The entry's name.
            entry: The ``Sharded`` entry.
            group: A process group of one holder of each shard, made after a rank died.
            rank: This process's rank in ``group``.

        Returns:
            The files this rank wrote, for ``save_alone``'s ``staged``.
        """
        return self._writing.write_shards(tmp, index, name, entry, group, rank)

    def abandon(self, tmp: str) -> None:
        """Remove the temporary directory of a ``stage_alone`` that will not be sealed.

        Args:
            tmp: The directory ``stage_alone`` returned.
        """
        self._writing.abandon(tmp)

    def _prepare(
        self, state: dict[str, Any], blocking: bool
    ) -> tuple[dict[str, tuple[Kind, Any]], dict[str, ParamShapes]]:
        """This rank's copies of what it writes, with their kind, and optimizers' shapes."""
        self._check_directory()  # a file may have taken its place since
        mine: dict[str, tuple[Kind, Any]] = {}
        shapes: dict[str, ParamShapes] = {}
        for name, entry in state.items():
            kind = kind_of(entry)
            if kind.every_rank or self._group.world.first:  # rank 0 writes the replicated ones
                mine[name] = (kind, kind.prepare(entry, name, blocking))
            if isinstance(entry, torch.optim.Optimizer):
                shapes[name] = param_shapes(entry)
        return mine, shapes

    @property
    def in_flight(self) -> bool:
        """Whether a background save is being written now."""
        return self._pending is not None and not self._pending.done()

    @property
    def background_step(self) -> int | None:
        """The step of the background save not yet waited for, if any: committed only once
        ``wait`` returns (every rank then knows it is)."""
        return self._pending_step if self._pending is not None else None

    def wait(self) -> None:
        """Block until the background save, if any, is written; re-raise what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def forget_background(self) -> None:
        """Drop the background save in flight: a rank it needs died (``close`` then returns,
        and its failure is not reported at exit)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.forget()

    def close(self) -> None:
        """Wait for the background save, if any; re-raise what it raised."""
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def load_latest(self, state: dict[str, Any]) -> Restored | None:
        """Restore ``state`` from the newest valid checkpoint.

        Objects with ``load_state_dict`` get their entry, in place. Each invalid checkpoint
        (truncated, a flipped byte, a rank's part missing) is skipped with a warning saying why.

        Args:
            state: Names mapped to the objects to restore; plain values' names too (what is
                given for them is not used).

        Returns:
            A ``Restored`` (always true: the plain values, the entries ``state`` did not name,
            ``step``, ``path``, ``world_size``), or ``None`` if there is no valid checkpoint.

        Raises:
            RemoteUnavailable: the store did not answer (after the retries, or past
                ``remote_timeout``); nothing was skipped, restored or deleted.
            StateMismatch: the newest valid checkpoint lacks a name of ``state``, does not fit
                its modules or optimizers, has another format version, or holds a ``PerRank``
                entry saved by another number of ranks whose ``resize`` is ``"refuse"``.
            ValueError: an object rejects its entry (of that object's kind if unbroken's).
            NotADirectoryError: the directory is a file.
        """
        _check_names(state, "load_latest")
        self.wait()
        try:
            return self._loading.latest(state)
        except RemoteUnavailable as error:
            raise RemoteUnavailable(
                f"unbroken.Checkpointer: could not read the checkpoints in {self.directory}: "
                f"{error} No checkpoint was skipped, restored or deleted: start again once the "
                "store answers (or give a slow store a larger remote_timeout)."
            ) from error

    def _check_directory(self) -> None:
        """Refuse a file where the directory should be (a Trainer would restart from step 0)."""
        blocker = self._storage.blocker(self._root)  # nothing there: the first save makes it
        if blocker is not None:
            what = (
                f"{blocker} is a file"
                if blocker != self._root
                else "it exists and is not a directory"
            )
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"the Checkpointer directory {self.directory} is not a directory: {what}, so no "
                "checkpoint could be found or saved there. Pass the path of the directory that "
                "holds the step-* checkpoints (it is created if it does not exist)",
            )


def _check_names(state: Any, method: str) -> None:
    if not isinstance(state, dict):
        raise ValueError(
            f"{method} expects a dict of name -> object, got a "
            f"{type(state).__name__}; wrap it, e.g. {{'model': model}}"
        )
    for name in state:
        if not isinstance(name, str):
            raise ValueError(f"state key {name!r} is a {type(name).__name__}; names must be str")


def _every_rank(mine: dict[str, tuple[Kind, Any]]) -> list[str]:
    """The names of the entries every rank writes: the ranks must agree on them."""
    return sorted(name for name, (kind, _) in mine.items() if kind.every_rank)
