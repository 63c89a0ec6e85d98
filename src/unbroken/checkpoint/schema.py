"""The manifest's schema: its format, the ``TypedDict``s a manifest is read as, its seal, and
``validate``, the one place a manifest read from a disk or a store is checked, field by field,
for its type and range (what a manifest holds and means: ``manifest``).

A manifest edited by hand or by a tool and sealed again gets past the seal, so ``validate``
raises ``unbroken.errors.CorruptCheckpoint`` naming the first bad field (``load_latest`` skips
that checkpoint with a warning, never a ``TypeError`` from deep inside), and a whole manifest of
another format version is a ``StateMismatch``, never skipped. Unknown keys are ignored. Costs:
one JSON parse and one sha256 of the canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, TypedDict

from ..errors import CorruptCheckpoint, StateMismatch

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
