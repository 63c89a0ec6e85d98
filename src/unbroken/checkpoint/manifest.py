"""A checkpoint's manifest: written last as its seal, and checked against a schema on load.

``manifest.json``, format version 2::

    {"format": "unbroken.Checkpoint", "version": 2, "step": 123, "torch": "2.5.1",
     "world_size": 2,
     "entries": {"model": {"file": "000-model.pt"},
                 "optimizer": {"file": "001-optimizer.pt", "param_shapes": [[[8, 4], [8]]]},
                 "rng": {"ranks": ["002-rng.rank-00000.pt", "002-rng.rank-00001.pt"]}},
     "files": {"000-model.pt": {"sha256": "<64 hex digits>", "size": 1234}, ...},
     "sha256": "<of the canonical JSON of all the other fields>"}

An entry is one ``file`` (written once, by rank 0), for a ``PerRank`` entry one file per rank
of the ``world_size`` ranks that saved it (``ranks``), or for a ``Sharded`` entry a DCP
directory (``dcp``: ``"003-model.dcp"``) and its files (``shards``: every rank's
``__<rank>_0.distcp`` and the ``.metadata``). Version 1 (before ranks: no
``world_size``, only ``file`` entries) is read as a checkpoint of one rank.

The seal catches what changed by accident (a flipped digit, a truncated copy). A manifest edited
by hand or by a tool and sealed again gets past it, so every field is also checked for its type
and range before it is used, in one place (``schema.validate``, against ``Manifest``):
``read_manifest`` raises ``unbroken.errors.CorruptCheckpoint`` naming the field, and
``load_latest`` skips that checkpoint with a warning, never a ``TypeError`` from deep inside. A
whole manifest of another format version is a ``StateMismatch``, never skipped. Unknown keys
are ignored. ``read_manifest`` checks the size of every listed file (so a checkpoint missing a
rank's part is skipped by every rank); ``load_file`` hashes a file (sha256, ~1 GB/s) before
``torch.load`` reads it again, from the page cache. Files are read through a ``Storage``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from ..errors import CorruptCheckpoint, RemoteUnavailable
from .files import Digest, join, sha256
from .schema import (
    FORMAT,
    MANIFEST,
    SEAL,
    VERSION,
    EntrySpec,
    FileSpec,
    Manifest,
    ParamShapes,
    check_param_shapes,
    seal_of,
    validate,
)
from .storage import Storage


def param_shapes(optimizer: torch.optim.Optimizer) -> ParamShapes:
    """The shapes of an optimizer's parameters, by group: a load names a changed one."""
    return [[list(p.shape) for p in group["params"]] for group in optimizer.param_groups]


def file_name(index: int, name: str, rank: int | None = None) -> str:
    """Entry ``index``'s file; a ``PerRank`` entry's part of ``rank``."""
    part = "" if rank is None else f".rank-{rank:05d}"
    return f"{index:03d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:60]}{part}.pt"


def dcp_folder(index: int, name: str) -> str:
    """The directory of a ``Sharded`` entry's DCP files."""
    return f"{index:03d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:60]}.dcp"


def seal(
    step: int,
    specs: dict[str, EntrySpec],
    files: dict[str, Digest],
    param_shapes: dict[str, ParamShapes],
    world_size: int,
) -> bytes:
    """The manifest of checkpoint ``step`` saved by ``world_size`` ranks, whose entries
    (``specs``, without their ``param_shapes``) were written as ``files`` (file -> digest);
    ``param_shapes`` has an item for each optimizer."""
    for name, shapes in param_shapes.items():
        specs[name]["param_shapes"] = shapes
    manifest = Manifest(
        format=FORMAT,
        version=VERSION,
        step=step,
        torch=torch.__version__,
        world_size=world_size,
        entries=specs,
        files={
            file: FileSpec(sha256=digest.sha256, size=digest.size) for file, digest in files.items()
        },
    )
    return json.dumps({**manifest, SEAL: seal_of(manifest)}, indent=1).encode()


def read_manifest(storage: Storage, path: str, step: int) -> Manifest:
    """The manifest of checkpoint ``path``, each listed file there with its size;
    ``CorruptCheckpoint`` if not, ``StateMismatch`` if another format version wrote it."""
    try:
        with storage.open_read(join(path, MANIFEST)) as opened:
            data = opened.read()
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{MANIFEST} is missing") from None
    except RemoteUnavailable:  # not read at all: no proof of damage (a resume fails instead)
        raise
    except OSError as error:
        raise CorruptCheckpoint(f"{MANIFEST} is unreadable: {error}") from None
    manifest = validate(data, step, path)
    for file, spec in manifest["files"].items():
        _refuse_links(storage, path, file)
        try:
            actual = storage.size(join(path, file))
        except RemoteUnavailable:
            raise
        except OSError as error:
            raise CorruptCheckpoint(f"{file} is unreadable: {error.strerror or error}") from None
        if actual != spec["size"]:
            raise CorruptCheckpoint(f"{file} has {actual} bytes, the manifest says {spec['size']}")
    return manifest


def _refuse_links(storage: Storage, path: str, file: str) -> None:
    """A checkpoint's files are its own: a symbolic link in one's path (the file, or the
    directory of a sharded entry's files) could make a resealed manifest load a file from
    anywhere on the machine."""
    parts = file.split("/")
    for depth in range(1, len(parts) + 1):
        name = "/".join(parts[:depth])
        if storage.is_link(join(path, name)):
            raise CorruptCheckpoint(
                f"{name} is a symbolic link: a checkpoint's files must be in it, not linked "
                "from elsewhere"
            )


def _expect(storage: Storage, path: str, manifest: Manifest, file: str) -> None:
    """Tell the storage what ``file`` holds, so that one keeping local copies reads a copy that
    hashes to it from the disk (``Storage.expect``)."""
    spec = manifest["files"][file]
    storage.expect(join(path, file), spec["sha256"], spec["size"])


def verify_file(storage: Storage, path: str, manifest: Manifest, file: str) -> None:
    """``CorruptCheckpoint`` unless ``file`` of checkpoint ``path`` matches its sha256."""
    _expect(storage, path, manifest, file)
    try:
        if sha256(storage, join(path, file)) != manifest["files"][file]["sha256"]:
            raise CorruptCheckpoint(f"{file} does not match its sha256 in the manifest")
    except RemoteUnavailable:
        raise
    except OSError as error:
        raise CorruptCheckpoint(f"{file} is unreadable: {error.strerror or error}") from None


def load_file(
    storage: Storage, path: str, manifest: Manifest, file: str, verify: bool = True
) -> Any:
    """``file`` of checkpoint ``path`` checked against its sha256 (unless another rank checks
    it: ``verify=False``), then loaded."""
    if verify:
        verify_file(storage, path, manifest, file)
    else:
        _expect(storage, path, manifest, file)
    try:
        with storage.open_read(join(path, file)) as opened:
            return torch.load(opened, map_location="cpu", weights_only=True)
    except RemoteUnavailable:
        raise
    except Exception as error:  # any other failure means: not this checkpoint
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
        reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0])
        reason = reason.split(". Please use")[0]  # torch's advice to allow-list it: not here
        raise CorruptCheckpoint(
            f"{file} does not load with torch.load(weights_only=True): "
            f"{type(error).__name__}: {reason}"
        ) from None


def read(storage: Storage, path: str, step: int) -> tuple[Manifest, dict[str, Any]]:
    """The manifest and every entry of a checkpoint of one rank (``PerRank`` entries: rank 0's
    part), each file verified; ``CorruptCheckpoint`` if it is not whole."""
    manifest = read_manifest(storage, path, step)
    saved = {}
    for name, entry in manifest["entries"].items():
        if "dcp" in entry:
            continue  # read by DCP, through a Sharded
        file = entry["file"] if "file" in entry else entry["ranks"][0]
        saved[name] = load_entry_file(storage, path, manifest, name, entry, file)
    return manifest, saved


def load_entry_file(
    storage: Storage,
    path: str,
    manifest: Manifest,
    name: str,
    entry: EntrySpec,
    file: str,
    verify: bool = True,
) -> Any:
    """A file of entry ``name`` loaded (``load_file``) and checked against what the manifest
    says of the entry (an optimizer's parameter groups and shapes)."""
    value = load_file(storage, path, manifest, file, verify=verify)
    if "param_shapes" in entry:
        check_param_shapes(name, entry["param_shapes"], value, file)
    return value
