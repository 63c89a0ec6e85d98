"""The kinds of checkpoint entry, one class each: what a rank prepares of an entry, how it writes
it, how the manifest describes it, and how a rank reads it back (fitted to another number of
ranks where the kind allows).

- ``Replicated``: an object or value that is the same on every rank. Rank 0 writes one file;
  every rank loads it, one of them checking its sha256 (spread over the ranks).
- ``EachRank`` (``PerRank`` entries): every rank writes its own part; a rank loads its own,
  or, on another number of ranks, what the entry's ``resize`` makes of all the parts.
- ``ThroughDCP`` (``Sharded`` entries): every rank writes its shards through
  ``torch.distributed.checkpoint`` into one folder; each rank checks its share of the files,
  and DCP reads them (collectively, after the other entries are in).

The manager dispatches once per entry (``kind_of`` an object to save, ``kind_in`` a manifest
entry), so a new kind is one class here.

**``PerRank``**: a checkpoint entry that every rank of a data-parallel job saves for itself. A
``Checkpointer`` under ``torch.distributed`` writes each entry of ``state`` once, from rank 0,
since in data parallelism the model, the optimizer, the scheduler and unbroken's sharded loaders
are the same on every rank. What differs between ranks is wrapped in ``PerRank``: every rank writes
its own part (``003-rng.rank-00001.pt``), the manifest lists them all, and on a resume on the same
number of ranks each rank loads its own.

A job restarted on another number of ranks cannot simply load "its own" part: ``resize`` says
what a rank loads then.

- ``"refuse"`` (the default): a ``StateMismatch`` on ``world_size`` naming the entry.
- ``"rank0"``: every rank loads rank 0's part: for a state that is the same on every rank (a
  loader's global cursor), or that checks itself (a per-rank loader refuses another world).
- ``"skip"``: the object is left as it is; the caller re-derives it (the Trainer re-seeds the
  process RNGs from the seed, the step and the rank).
- a function ``resize(parts, rank, world_size)``, given the saved parts in rank order,
  returning the state this rank loads, or ``None`` to leave the object as it is (the Trainer
  merges torchmetrics states onto rank 0 this way).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from .._state import has_state
from ..errors import StateMismatch
from .layout import EntrySpec, Manifest, dcp_folder, file_name, load_entry_file, verify_file
from .sharded import Sharded, save_state, written_by
from .storage import Digest, Storage, join
from .weights_only import checked_copy


class Part(NamedTuple):
    """What one rank wrote of one entry: its files (and a DCP entry's folder)."""

    kind: str  # the kind's tag
    files: list[tuple[str, Digest]]
    folder: str = ""


class Reading(NamedTuple):
    """What a rank needs to read a checkpoint's entries."""

    storage: Storage
    where: str
    manifest: Manifest
    rank: int
    world_size: int


ABSENT = object()  # what read gives for an entry this rank has nothing of


class Kind:
    """One kind of entry. ``tag`` is its key in the manifest; ``every_rank``: every rank
    writes a part of it (else rank 0 alone)."""

    tag = ""
    every_rank = False

    def prepare(self, entry: Any, name: str, blocking: bool) -> Any:
        """This rank's copy of what it writes (a background write needs its own: training goes
        on changing the tensors)."""
        obj = unwrap(entry)
        value = obj.state_dict() if has_state(obj) else obj
        return checked_copy(value, f"state[{name!r}]", clone=not blocking)

    def write(
        self, storage: Storage, tmp: str, index: int, name: str, value: Any, rank: int, group: Any
    ) -> Part:
        """This rank's files of the entry, written and fsynced in ``tmp``."""
        file = file_name(index, name, rank if self.every_rank else None)
        try:
            digest = storage.write(join(tmp, file), partial(torch.save, value))
        except Exception as error:
            if not isinstance(error, OSError) and hasattr(error, "add_note"):
                error.add_note(f"raised by torch.save of state[{name!r}]")
            raise
        return Part(self.tag, [(file, digest)])

    def describe(self, spec: EntrySpec | None, part: Part) -> EntrySpec:
        """The manifest's entry, with one more rank's ``part`` (in rank order)."""
        raise NotImplementedError

    def read(self, at: Reading, index: int, name: str, spec: EntrySpec, wanted: Any) -> Any:
        """The entry's value for this rank, ``SKIP`` (leave the object as it is) or
        ``ABSENT``; ``wanted`` is what ``load_latest`` was given for it (``ABSENT`` if
        nothing)."""
        raise NotImplementedError


class Replicated(Kind):
    tag = "file"

    def describe(self, spec: EntrySpec | None, part: Part) -> EntrySpec:
        return EntrySpec(file=part.files[0][0])

    def read(self, at: Reading, index: int, name: str, spec: EntrySpec, wanted: Any) -> Any:
        # Every rank loads a replicated file, one checks its sha256: a rank that finds it
        # changed makes every rank skip the checkpoint (load_latest's agreement).
        mine = index % at.world_size == at.rank
        file = spec["file"]
        value = load_entry_file(at.storage, at.where, at.manifest, name, spec, file, verify=mine)
        if isinstance(wanted, PerRank) and at.manifest["world_size"] != at.world_size:
            # Version 1 wrote per-rank state as one file (one rank): resized as its parts.
            return resized(wanted, name, [value], at.rank, at.world_size, at.where)
        return value


class EachRank(Kind):
    tag = "ranks"
    every_rank = True

    def describe(self, spec: EntrySpec | None, part: Part) -> EntrySpec:
        spec = spec or EntrySpec(ranks=[])
        spec["ranks"] += [file for file, _ in part.files]
        return spec

    def read(self, at: Reading, index: int, name: str, spec: EntrySpec, wanted: Any) -> Any:
        storage, where, manifest = at.storage, at.where, at.manifest
        if manifest["world_size"] == at.world_size:
            return load_entry_file(storage, where, manifest, name, spec, spec["ranks"][at.rank])
        if wanted is ABSENT:
            return ABSENT  # another rank's part of an entry nobody asked for means nothing
        parts = [load_entry_file(storage, where, manifest, name, spec, f) for f in spec["ranks"]]
        return resized(wanted, name, parts, at.rank, at.world_size, where)


class ThroughDCP(Kind):
    tag = "dcp"
    every_rank = True

    def prepare(self, entry: Any, name: str, blocking: bool) -> Any:
        return _Shards(entry.state_dict(), clone=not blocking)

    def write(
        self, storage: Storage, tmp: str, index: int, name: str, value: Any, rank: int, group: Any
    ) -> Part:
        folder = dcp_folder(index, name)

        def fill(local: str) -> list[str]:  # DCP writes local files (its file system writer)
            save_state(value.state, local, group)
            return written_by(os.listdir(local), rank)

        written = storage.write_directory(join(tmp, folder), fill)
        return Part(self.tag, [(f"{folder}/{file}", digest) for file, digest in written], folder)

    def describe(self, spec: EntrySpec | None, part: Part) -> EntrySpec:
        spec = spec or EntrySpec(dcp=part.folder, shards=[])
        spec["shards"] = sorted(spec["shards"] + [file for file, _ in part.files])
        return spec

    def read(self, at: Reading, index: int, name: str, spec: EntrySpec, wanted: Any) -> Any:
        if wanted is ABSENT:
            return ABSENT
        folder = spec["dcp"]
        names = [file.rpartition("/")[2] for file in spec["shards"]]
        mine = [n for i, n in enumerate(names) if i % at.world_size == at.rank]  # a share each
        return at.storage.readable_directory(
            join(at.where, folder),
            names,
            mine,
            lambda file: verify_file(at.storage, at.where, at.manifest, f"{folder}/{file}"),
        )


REPLICATED, EACH_RANK, THROUGH_DCP = Replicated(), EachRank(), ThroughDCP()
KINDS = {kind.tag: kind for kind in (REPLICATED, EACH_RANK, THROUGH_DCP)}


def kind_of(entry: Any) -> Kind:
    """The kind of an object given to ``save``."""
    if isinstance(entry, Sharded):
        return THROUGH_DCP
    return EACH_RANK if isinstance(entry, PerRank) else REPLICATED


def kind_in(spec: EntrySpec) -> Kind:
    """The kind of a manifest entry (the schema allows exactly one of its keys)."""
    return next(kind for tag, kind in KINDS.items() if tag in spec)


def check_loadable(where: str, name: str, spec: EntrySpec, wanted: Any) -> None:
    """Refuse to load a DCP entry into something other than a ``Sharded``, and the reverse."""
    if wanted is ABSENT or isinstance(wanted, Sharded) == ("dcp" in spec):
        return
    raise StateMismatch(
        f"checkpoint {where}",
        f"entries[{name!r}]",
        "a DCP directory" if "dcp" in spec else "a file",
        type(wanted).__name__,
        message=(
            f"checkpoint {where}: state[{name!r}] was saved "
            + (
                "through DCP by a Sharded(model, optimizers): load it with one"
                if "dcp" in spec
                else "as one object, not by a Sharded: load it as it was saved"
            )
        ),
    )


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


Resize = Callable[[list[Any], int, int], Any]
_NAMED = ("refuse", "rank0", "skip")


class PerRank:
    """An entry of a ``Checkpointer``'s state that every rank saves and loads for itself.

    Args:
        obj: A stateful object or a plain value.
        resize: What a rank loads when the job resumes on another number of ranks:
            ``"refuse"``, ``"rank0"``, ``"skip"`` or a function ``resize(parts, rank,
            world_size)`` (see the module).

    Raises:
        ValueError: ``obj`` is already a ``PerRank``, or ``resize`` is none of these.
    """

    def __init__(self, obj: Any, resize: str | Resize = "refuse") -> None:
        if isinstance(obj, PerRank):
            raise ValueError("PerRank(PerRank(...)): wrap the object once")
        if not callable(resize) and resize not in _NAMED:
            raise ValueError(
                f"resize must be one of {_NAMED} or a function (parts, rank, world_size) -> "
                f"state, got {resize!r}"
            )
        self.obj, self.resize = obj, resize

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r}, resize={self.resize!r})"


def unwrap(obj: Any) -> Any:
    return obj.obj if isinstance(obj, PerRank) else obj


SKIP = object()  # what resize gives for an object to leave as it is


def resized(
    wanted: Any, name: str, parts: list[Any], rank: int, world_size: int, where: str
) -> Any:
    """What rank ``rank`` of ``world_size`` loads of ``state[name]`` (``wanted``), saved per rank
    by ``len(parts)`` ranks in checkpoint ``where``: ``SKIP`` to leave the object as it is;
    ``StateMismatch`` unless ``wanted`` is a ``PerRank`` whose ``resize`` allows it."""
    if not isinstance(wanted, PerRank) or wanted.resize == "refuse":
        raise StateMismatch(
            f"checkpoint {where}",
            "world_size",
            len(parts),
            world_size,
            message=(
                f"checkpoint {where}: state[{name!r}] was saved per rank by {len(parts)} "
                f"ranks and cannot be split over {world_size}; resume on {len(parts)} ranks, "
                "or give it as PerRank(obj, resize=...) saying what a rank loads then"
            ),
        )
    if wanted.resize == "rank0":
        return parts[0]
    if wanted.resize == "skip":
        return SKIP
    assert callable(wanted.resize)
    value = wanted.resize(parts, rank, world_size)
    return SKIP if value is None else value
