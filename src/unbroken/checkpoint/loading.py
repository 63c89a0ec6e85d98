"""Reading the newest whole checkpoint, every rank together (``Checkpointer.load_latest``).

Rank 0 lists the candidates (``layout.candidates``); every rank tries them newest first: it reads
the manifest and its share of the entries (``entries``: one class per kind), checking each
file's sha256, and the ranks agree on a verdict, so that a checkpoint any rank finds corrupt is
skipped by all, with a warning saying why (``Writing.damaged``: the next save moves it aside,
``quarantine``). The first that every rank read whole is restored in place (``restore``), DCP's
entries last and collectively. Costs: each file read twice (the hash, then ``torch.load`` from the page cache or,
from a store, the one download).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

from .._state import has_state
from ..distributed.reduction import is_exact, warn_inexact
from ..errors import CorruptCheckpoint
from . import layout
from .entries import ABSENT, Reading, check_loadable, kind_in
from .group import CheckpointGroup, attempt
from .layout import Manifest, read_manifest
from .per_rank import SKIP, unwrap
from .restore import Restored, restore
from .sharded import Sharded
from .storage import CopiedDirectory, Storage
from .writing import Writing


class Loading:
    """The read path of a ``Checkpointer`` (``manager``) over its storage and ranks;
    ``check_directory`` raises if the directory is a file."""

    def __init__(
        self,
        storage: Storage,
        root: str,
        group: CheckpointGroup,
        writing: Writing,
        check_directory: Callable[[], None],
    ) -> None:
        self.storage, self.root, self.group, self.writing = storage, root, group, writing
        self.check_directory = check_directory

    def latest(self, state: dict[str, Any]) -> Restored | None:
        """``Checkpointer.load_latest`` (see there), every rank together."""
        ranks = self.group
        started = time.perf_counter()
        listed = attempt(self._candidates if ranks.world.first else self.check_directory)
        found: list[tuple[int, str]] = ranks.settle(listed, "listing the checkpoints")[0]
        self.writing.seen([step for step, _ in found])
        scanned = time.perf_counter()
        for step, where in reversed(found):
            path = where
            read = attempt(self._read, where, step, state)
            # Only the verdict travels (None: fine), never the state read.
            verdict = read if isinstance(read, BaseException) else None
            verdicts = ranks.settle(verdict, f"reading checkpoint {path}", CorruptCheckpoint)
            corrupt = [(r, v) for r, v in enumerate(verdicts) if isinstance(v, CorruptCheckpoint)]
            if corrupt:
                why = "; ".join(
                    f"rank {r}: {v}" if ranks.world.size > 1 else str(v) for r, v in corrupt
                )
                warnings.warn(
                    f"unbroken.Checkpointer: skipping checkpoint {path}: {why}", stacklevel=3
                )
                # Read, and proven damaged: the next save moves it aside, never deletes it.
                self.writing.damaged[path] = [
                    f"rank {r}: {v}" if ranks.world.size > 1 else str(v) for r, v in corrupt
                ]
                if not isinstance(read, BaseException):  # this rank's downloads of it go
                    for value in read[1].values():
                        if isinstance(value, CopiedDirectory):
                            value.remove()
                continue
            assert not isinstance(read, BaseException)
            manifest, saved, skipped = read
            was_read = time.perf_counter()
            # DCP's entries last, and only once all the others are in: it loads collectively.
            sharded = {n: o for n, o in state.items() if isinstance(o, Sharded) and n in saved}
            objects = {
                name: unwrap(obj)
                for name, obj in state.items()
                if name not in skipped and name not in sharded
            }
            restored = attempt(restore, objects, saved, manifest["entries"], path)
            ranks.settle(restored, f"restoring checkpoint {path}")
            for name, obj in sharded.items():
                loaded = attempt(obj.load, saved[name], ranks.process_group)
                if isinstance(saved[name], CopiedDirectory):  # downloaded from object storage
                    saved[name].remove()
                ranks.settle(loaded, f"loading state[{name!r}] of checkpoint {path} with DCP")
            for obj in objects.values():  # a DDP model on 3+ ranks: exact only with a fix
                if not is_exact(obj):
                    warn_inexact("unbroken.Checkpointer", obj)
            return Restored(
                step=step,
                path=path,
                values={name: saved[name] for name, obj in objects.items() if not has_state(obj)},
                unrequested={name: value for name, value in saved.items() if name not in state},
                world_size=manifest["world_size"],
                seconds={
                    "scan": scanned - started,
                    "read": was_read - scanned,
                    "restore": time.perf_counter() - was_read,
                },
            )
        return None

    def _candidates(self) -> list[tuple[int, str]]:
        self.check_directory()
        return layout.candidates(self.storage, self.root)

    def _read(
        self, where: str, step: int, state: dict[str, Any]
    ) -> tuple[Manifest, dict[str, Any], list[str]]:
        """Checkpoint ``where``'s manifest, entries, and the ``PerRank`` names left as they are."""
        ranks = self.group
        manifest = read_manifest(self.storage, where, step)
        at = Reading(self.storage, where, manifest, ranks.world.rank, ranks.world.size)
        saved: dict[str, Any] = {}
        skipped: list[str] = []
        for index, (name, spec) in enumerate(manifest["entries"].items()):
            wanted = state.get(name, ABSENT)
            check_loadable(where, name, spec, wanted)
            value = kind_in(spec).read(at, index, name, spec, wanted)
            if value is SKIP:
                skipped.append(name)
            elif value is not ABSENT:
                saved[name] = value
        return manifest, saved, skipped
