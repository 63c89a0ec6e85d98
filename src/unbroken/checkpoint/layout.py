"""A checkpoint on disk: the names inside a checkpoint directory and what they say after a writer
was killed, its manifest (the seal written last), the manifest's schema, and the checks of one
read back.

The names:

- ``step-000000123``: a committed checkpoint (renamed into place whole).
- ``.tmp-step-000000123-<pid>-<hex>``: a save in progress, or a killed one: removed.
- ``.old-step-000000123-<hex>``: a checkpoint moved aside while a save of the same step replaces
  it; it counts again if the writer died before the replacement was renamed into place.
- ``.del-step-000000123-<hex>``: renamed before deletion, so that a writer killed mid-delete
  leaves no half checkpoint in view: removed.
- ``.shared-<hex>/``: the directory by which the ranks of a job check that they share the directory
  (``group``): removed.

How a checkpoint is staged, committed and retired is the storage's (``Storage.stage``,
``commit``, ``retire``, ``is_committed``): on a store without rename (``FsspecStorage``), a
checkpoint is written in place, under ``step-000000123/``, and its manifest, written last,
commits it; a ``step-*`` prefix without one is a killed writer's (or a deletion's) leftover, not
in view, and removed.

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
and range before it is used, in one place (``validate``, against the ``TypedDict`` ``Manifest``):
``read_manifest`` raises ``unbroken.errors.CorruptCheckpoint`` naming the first bad field, and
``load_latest`` skips that checkpoint with a warning, never a ``TypeError`` from deep inside. A
whole manifest of another format version is a ``StateMismatch``, never skipped. Unknown keys
are ignored. ``read_manifest`` checks the size of every listed file (so a checkpoint missing a
rank's part is skipped by every rank); ``load_file`` hashes a file (sha256, ~1 GB/s) before
``torch.load`` reads it again, from the page cache. Files are read through a ``Storage``.

Costs: a manifest read back is one JSON parse and one sha256 of the canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from typing import Any, TypedDict

import torch

from ..errors import CorruptCheckpoint, RemoteUnavailable, StateMismatch
from .storage import Digest, Storage, basename, join, sha256

_FINAL = re.compile(r"step-(\d+)")
_OLD = re.compile(r"\.old-step-(\d+)-[0-9a-f]+")
_TMP, _DOOMED = ".tmp-", ".del-"
SHARED = ".shared-"  # a token file of group.CheckpointGroup.check_shared


def final_name(step: int) -> str:
    return f"step-{step:09d}"


def temporary_name(step: int) -> str:
    return f"{_TMP}{final_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"


def aside_name(name: str) -> str:
    """Where a committed checkpoint goes while a save of the same step replaces it."""
    return f".old-{name}-{secrets.token_hex(4)}"


def doomed_name(name: str) -> str:
    return f"{_DOOMED}{name}-{secrets.token_hex(4)}"


def clean(storage: Storage, root: str) -> None:
    """Remove what killed writers left: temporary and half-deleted directories, and checkpoint
    directories never committed (on a store without rename: prefixes without a manifest); put
    back a checkpoint moved aside whose replacement never arrived; abort what a killed writer
    left of an upload, where the store keeps it (``Storage.abort_uploads``)."""
    storage.abort_uploads(root)
    entries = storage.list_directory(root)
    finals = [join(root, e.name) for e in entries if _FINAL.fullmatch(e.name)]
    whole = set(storage.committed_among(finals)) if finals else set()
    for entry in entries:
        path = join(root, entry.name)
        old = _OLD.fullmatch(entry.name)
        final = join(root, f"step-{old.group(1)}") if old else ""
        if old and not storage.exists(final):
            storage.rename(path, final)
        elif old or entry.name.startswith((_TMP, _DOOMED, SHARED)):
            storage.remove_tree(path)
        elif _FINAL.fullmatch(entry.name) and path not in whole:
            storage.remove_tree(path)


def committed(storage: Storage, root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every committed checkpoint directory, oldest step first; one listing
    and one ``Storage.committed_among``, whatever their number."""
    if not storage.is_directory(root):
        return []
    listed = [
        (int(m.group(1)), join(root, entry.name))
        for entry in storage.list_directory(root)
        if (m := _FINAL.fullmatch(entry.name)) and entry.is_directory
    ]
    whole = set(storage.committed_among([path for _, path in listed])) if listed else set()
    return sorted((step, path) for step, path in listed if path in whole)


def stage(storage: Storage, root: str, step: int) -> str:
    """Where checkpoint ``step`` is written (``Storage.stage``: by default a new temporary
    directory, renamed into place by ``Storage.commit``)."""
    return storage.stage(join(root, final_name(step)), join(root, temporary_name(step)))


def retire(storage: Storage, root: str, path: str) -> None:
    """Delete checkpoint ``path`` so that no reader ever sees a part of it (``Storage.retire``:
    by default renamed out of view first)."""
    storage.retire(path, join(root, doomed_name(basename(path))))


def candidates(storage: Storage, root: str) -> list[tuple[int, str]]:
    """What ``load_latest`` may read: the committed ones and any moved aside."""
    found = dict(committed(storage, root))
    if storage.is_directory(root):
        for entry in storage.list_directory(root):
            old = _OLD.fullmatch(entry.name)
            if old:  # the writer died between moving it aside and renaming its replacement
                found.setdefault(int(old.group(1)), join(root, entry.name))
    return sorted(found.items())


FORMAT = "unbroken.Checkpoint"
VERSION = 2
READABLE = (1, 2)  # version 1: one rank, no world_size
MANIFEST = "manifest.json"
SEAL = "sha256"  # the manifest's own hash: the one key on disk that ``Manifest`` does not list
# What the writer names files: never "..", a "/" or a NUL, whatever a manifest says.
_FILE = re.compile(r"\d{3,}-[A-Za-z0-9_.-]{0,80}\.pt")
_SHARD = re.compile(r"(\d{3,}-[A-Za-z0-9_.-]{0,60}\.dcp)/(\.metadata|__\d+_\d+\.distcp)")
_SHA256 = re.compile(r"[0-9a-f]{64}")

ParamShapes = list[list[list[int]]]  # [parameter group][parameter] -> shape


class FileSpec(TypedDict):
    sha256: str
    size: int


class EntrySpec(TypedDict, total=False):
    """Exactly one of ``file``, ``ranks`` and ``dcp``."""

    file: str
    """The entry's one file, written by rank 0."""
    ranks: list[str]
    """A ``PerRank`` entry's files, one per rank, in rank order."""
    dcp: str
    """A ``Sharded`` entry's DCP directory; ``shards`` lists its files (every rank's)."""
    shards: list[str]
    param_shapes: ParamShapes
    """An optimizer's: lets ``load_latest`` name a parameter whose shape changed."""


class Manifest(TypedDict):
    """``manifest.json`` as ``validate`` returns it (without its seal)."""

    format: str
    version: int
    step: int
    torch: str
    world_size: int  # the ranks that saved it (1 for a version 1 manifest)
    entries: dict[str, EntrySpec]
    files: dict[str, FileSpec]


def seal_of(manifest: Manifest | dict) -> str:
    # The manifest seals itself too: a flipped digit in a size or a shape would otherwise pass.
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def validate(data: bytes, step: int, path: str) -> Manifest:
    """``data`` as a ``Manifest``, every field checked for its type and range: the one place a
    manifest read from disk is checked. ``CorruptCheckpoint`` names the first bad field."""
    try:
        manifest = json.loads(data)
        ours = isinstance(manifest, dict) and manifest.get("format") == FORMAT
        intact = ours and manifest.pop(SEAL, None) == seal_of(manifest)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deeply
        raise CorruptCheckpoint(f"{MANIFEST} is unreadable: {error}") from None
    if not ours:
        raise CorruptCheckpoint(f"{MANIFEST} does not have format {FORMAT!r}")
    if not intact:
        raise CorruptCheckpoint(f"{MANIFEST} does not match its own sha256 (it was modified)")
    version = _get(manifest, "version", int, "an int")
    if version not in READABLE:  # whole, but not ours to read: never skip past it
        raise StateMismatch(
            f"checkpoint {path}",
            "version",
            version,
            VERSION,
            message=(
                f"checkpoint {path} has format version {version!r}; this unbroken reads versions "
                f"{list(READABLE)}. Resume with the unbroken version that saved it."
            ),
        )
    if _count(manifest, "step") != step:
        raise CorruptCheckpoint(f"{MANIFEST} says step {manifest['step']!r}, its directory {step}")
    _get(manifest, "torch", str, "a str")
    if version == 1:
        manifest["world_size"] = 1
    if _count(manifest, "world_size") < 1:
        raise _malformed(f"manifest['world_size'] is {manifest['world_size']}, expected >= 1")
    files = _get(manifest, "files", dict, "a dict")
    for file in files:
        if not _FILE.fullmatch(file) and not _SHARD.fullmatch(file):
            raise _malformed(
                f"manifest['files'] has an invalid file name {file!r}, expected "
                "one like '000-model.pt'"
            )
        spec = _get(files, file, dict, "a dict", "manifest['files']")
        where = f"manifest['files'][{file!r}]"
        _count(spec, "size", where)
        if not _SHA256.fullmatch(_get(spec, "sha256", str, "64 lowercase hex digits", where)):
            raise _malformed(
                f"{where}['sha256'] is {spec['sha256']!r}, expected 64 lowercase hex digits"
            )
    entries = _get(manifest, "entries", dict, "a dict")
    for name in entries:
        entry = _get(entries, name, dict, "a dict", "manifest['entries']")
        where = f"manifest['entries'][{name!r}]"
        kinds = [kind for kind in ("file", "ranks", "dcp") if kind in entry]
        if len(kinds) != 1 or (version == 1 and kinds != ["file"]):
            raise _malformed(f"{where} must have one of 'file', 'ranks' and 'dcp'")
        if "file" in entry:
            listed = [(f"{where}['file']", _get(entry, "file", str, "a str", where))]
        elif "dcp" in entry:
            folder = _get(entry, "dcp", str, "a str", where)
            shards = _get(entry, "shards", list, "a list of files", where)
            listed = [
                (f"{where}['shards'][{i}]", _get(shards, i, str, "a str", f"{where}['shards']"))
                for i in range(len(shards))
            ]
            for field, file in listed:
                match = _SHARD.fullmatch(file)
                if match is None or match.group(1) != folder:
                    raise _malformed(f"{field} is {file!r}, which is not a file of {folder!r}")
            if f"{folder}/.metadata" not in shards:
                raise _malformed(f"{where}['shards'] lacks {folder}/.metadata")
        else:
            ranks = _get(entry, "ranks", list, "a list of files, one per rank", where)
            if len(ranks) != manifest["world_size"]:
                raise _malformed(
                    f"{where}['ranks'] lists {len(ranks)} files, expected one per rank "
                    f"(world_size {manifest['world_size']})"
                )
            listed = [
                (f"{where}['ranks'][{r}]", _get(ranks, r, str, "a str", f"{where}['ranks']"))
                for r in range(len(ranks))
            ]
        for field, file in listed:
            if file not in files:
                raise _malformed(f"{field} is {file!r}, which is not in manifest['files']")
        if "param_shapes" in entry and "file" not in entry:
            raise _malformed(
                f"{where} has 'param_shapes' but no 'file' (only a replicated entry has)"
            )
        if "param_shapes" in entry:  # [group][parameter] -> shape
            groups = _get(entry, "param_shapes", list, "a list of parameter groups", where)
            where += "['param_shapes']"
            for g in range(len(groups)):
                group = _get(groups, g, list, "a list of shapes", where)
                for i in range(len(group)):
                    shape = _get(group, i, list, "a shape (a list of ints)", f"{where}[{g}]")
                    for d in range(len(shape)):
                        _count(shape, d, f"{where}[{g}][{i}]")
    return manifest


def check_param_shapes(name: str, shapes: ParamShapes, saved: Any, file: str) -> None:
    """The shapes must match the optimizer state_dict they describe (restore indexes them)."""
    try:
        sizes = [len(group["params"]) for group in saved["param_groups"]]
    except (KeyError, TypeError):
        raise _malformed(
            f"manifest['entries'][{name!r}] has 'param_shapes', but {file} holds "
            "no optimizer state_dict (no 'param_groups' with 'params')"
        ) from None
    listed = [len(group) for group in shapes]
    if listed != sizes:
        raise _malformed(
            f"manifest['entries'][{name!r}]['param_shapes'] lists {len(listed)} parameter groups "
            f"of sizes {listed}, the optimizer state_dict in {file} has {len(sizes)} of sizes "
            f"{sizes}"
        )


def _malformed(problem: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{MANIFEST} is malformed: {problem}")


def _get(parent: dict | list, key: Any, kind: type, expected: str, where: str = "manifest") -> Any:
    """``parent[key]`` if it is exactly a ``kind`` (a bool is not an int), else
    ``CorruptCheckpoint``."""
    if isinstance(parent, dict) and key not in parent:
        raise _malformed(f"{where} has no {key!r}")
    value = parent[key]
    if type(value) is not kind:
        raise _malformed(f"{where}[{key!r}] is {_a(value)}, expected {expected}")
    return value


def _count(parent: dict | list, key: Any, where: str = "manifest") -> int:
    value = _get(parent, key, int, "an int >= 0", where)
    if value < 0:
        raise _malformed(f"{where}[{key!r}] is {value}, expected an int >= 0")
    return value


def _a(value: Any) -> str:
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


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
