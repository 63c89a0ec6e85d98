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
do not check out, and restores the newest good one in place. Files are read with
``torch.load(weights_only=True)``, which runs no code from the file, so ``save`` refuses, naming
its key path, any value that such a load could not rebuild: what saves, loads.

Costs: a blocking save writes each byte once, hashing it on the way (sha256 runs at about
1 GB/s on one core), plus one fsync per file and two per directory. ``blocking=False`` blocks
only while the state is copied to CPU memory (one extra copy of every tensor held until the
write ends) and writes in a background thread. ``load_latest`` reads each file twice (the hash,
then ``torch.load``; the second read comes from the page cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from ._restore import restore
from ._state import has_state
from ._weights_only import snapshot

FORMAT = "unbroken.Checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_FINAL = re.compile(r"step-(\d+)")
# A checkpoint moved aside while a save of the same step replaces it; it counts again if the
# writer died before the replacement was renamed into place.
_OLD = re.compile(r"\.old-step-(\d+)-[0-9a-f]+")
_TMP, _DOOMED = ".tmp-", ".del-"

class Restored(dict):
    """What ``load_latest`` did not restore: the checkpoint's entries that ``state`` lacks.

    A ``dict`` (empty when everything was restored) that also says which checkpoint was used:
    ``step`` (the int given to ``save``) and ``path`` (its directory).
    """

    def __init__(self, entries: dict, step: int, path: Path) -> None:
        super().__init__(entries)
        self.step, self.path = step, path

    def __repr__(self) -> str:
        return f"Restored(step={self.step}, path={str(self.path)!r}, {dict.__repr__(self)})"


class Checkpointer:
    """Saves and restores ``state`` dicts in ``directory``, keeping the newest ``keep`` saves.

    ``state`` maps str names to objects with ``state_dict``/``load_state_dict`` (modules,
    optimizers, schedulers, ``GradScaler``, ``unbroken.DataLoader``, yours) or to plain values
    (dicts, lists, tuples, str, int, float, bool, None, tensors; sets, bytearray and complex
    where the installed torch loads them).

    One process writes to a directory at a time: before each save, the writer removes what
    killed writers left behind. Processes that only ``load_latest`` change nothing on disk.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            raise ValueError(
                f"keep must be an int >= 2, got {keep!r}: with a single checkpoint, one that is "
                "corrupted (a disk error, a truncated copy) leaves nothing to resume from"
            )
        self.directory = Path(directory)
        self.keep = keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, state: dict[str, Any], blocking: bool = True) -> Path:
        """Write ``state`` as checkpoint ``step``; returns its final directory.

        Once the save is committed, ``load_latest`` restores it: a checkpoint of the same step
        is replaced, and ones with a larger step (from a run that went back to an earlier
        checkpoint) are removed, with a warning. Then only the newest ``keep`` remain.
        ``blocking=False`` returns once ``state`` is copied to CPU memory and writes in a
        background thread; the next ``save``, ``wait``, ``load_latest`` or ``close`` waits for
        it and re-raises what it raised. Raises ``ValueError`` naming the key path of a value
        that cannot be saved, before writing anything.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0 (the training step), got {step!r}")
        _check_names(state, "save")
        self.wait()
        entries, meta = {}, {}
        for name, obj in state.items():
            value = obj.state_dict() if has_state(obj) else obj
            # A background write needs its own copy: training goes on changing the tensors.
            entries[name] = snapshot(value, f"state[{name!r}]", clone=not blocking)
            if isinstance(obj, torch.optim.Optimizer):  # lets load name a parameter that changed
                meta[name] = {"param_shapes": [[list(p.shape) for p in group["params"]]
                                               for group in obj.param_groups]}
        newer = [path.name for number, path in self._committed() if number > step]
        if newer:
            warnings.warn(
                f"unbroken.Checkpointer: {newer} in {self.directory} have a larger step than "
                f"{step} and will be removed once step {step} is saved, so that load_latest "
                "resumes from this save", stacklevel=2)
        final = self.directory / f"step-{step:09d}"
        if blocking:
            self._write(step, final, entries, meta)
        else:
            self._thread = threading.Thread(
                target=self._write_in_background, args=(step, final, entries, meta),
                name=f"unbroken-checkpoint-{step}")
            self._thread.start()
        return final

    def wait(self) -> None:
        """Block until the background save, if any, is written; re-raise what it raised."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def load_latest(self, state: dict[str, Any]) -> Restored | None:
        """Restore ``state`` in place from the newest valid checkpoint.

        Objects with ``load_state_dict`` get their entry; other names are rebound
        (``state[name] = saved``). Returns a ``Restored`` dict of the checkpoint's entries that
        ``state`` did not name, with ``.step`` and ``.path``, or ``None`` if there is no valid
        checkpoint (each invalid one is skipped with a warning saying why). Raises
        ``ValueError`` if the newest valid checkpoint lacks a name of ``state`` or an object
        rejects its entry; shapes of modules and optimizers are compared before anything is
        restored.
        """
        _check_names(state, "load_latest")
        self.wait()
        for step, path in reversed(self._candidates()):
            try:
                manifest, saved = _read(path, step)
            except _Corrupt as why:
                warnings.warn(f"unbroken.Checkpointer: skipping checkpoint {path}: {why}",
                              stacklevel=2)
                continue
            restore(state, saved, manifest["entries"], path)
            return Restored({n: v for n, v in saved.items() if n not in state}, step, path)
        return None

    # -------------------------------------------------------------------------------- writing

    def _write_in_background(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as error:  # handed to the caller's thread by wait()
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"raised by the background save of {args[1]}")
            self._error = error

    def _write(self, step: int, final: Path, entries: dict, meta: dict) -> None:
        if not self.directory.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.directory.parent)
        self._clean()
        tmp = self.directory / f"{_TMP}step-{step:09d}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        old = None
        try:
            files, listed = {}, {}
            for index, (name, value) in enumerate(entries.items()):
                file = f"{index:03d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:60]}.pt"
                files[file] = _write_file(tmp / file, lambda out, v=value: torch.save(v, out))
                listed[name] = {"file": file, **meta.get(name, {})}
            manifest = {"format": FORMAT, "version": VERSION, "step": step,
                        "torch": torch.__version__, "entries": listed, "files": files}
            data = json.dumps({**manifest, "sha256": _digest(manifest)}, indent=1).encode()
            _write_file(tmp / MANIFEST, lambda out: out.write(data))  # last: it is the seal
            _fsync_dir(tmp)
            if final.exists():  # a directory cannot be renamed over a non-empty one
                old = self.directory / f".old-{final.name}-{secrets.token_hex(4)}"
                os.rename(final, old)
            os.rename(tmp, final)  # the commit
            _fsync_dir(self.directory)
        except BaseException:
            if old is not None and not final.exists():
                os.rename(old, final)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        committed = self._committed()
        doomed = [path for number, path in committed if number > step]
        doomed += [path for number, path in committed if number <= step][:-self.keep]
        for path in doomed:
            _remove(path)

    def _clean(self) -> None:
        """Remove what killed writers left: temporary and half-deleted directories."""
        for entry in os.scandir(self.directory):
            old = _OLD.fullmatch(entry.name)
            if old and not (self.directory / f"step-{old.group(1)}").exists():
                os.rename(entry.path, self.directory / f"step-{old.group(1)}")
            elif old or entry.name.startswith((_TMP, _DOOMED)):
                shutil.rmtree(entry.path, ignore_errors=True)

    def _committed(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every committed checkpoint directory, oldest step first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), Path(e.path)) for e in os.scandir(self.directory)
                 if (m := _FINAL.fullmatch(e.name)) and e.is_dir()]
        return sorted(found)

    def _candidates(self) -> list[tuple[int, Path]]:
        found = dict(self._committed())
        for entry in os.scandir(self.directory) if self.directory.is_dir() else ():
            old = _OLD.fullmatch(entry.name)
            if old:  # the writer died between moving it aside and renaming its replacement
                found.setdefault(int(old.group(1)), Path(entry.path))
        return sorted(found.items())


# ------------------------------------------------------------------------------------ helpers


class _Corrupt(Exception):
    """A checkpoint that is not whole: skipped by load_latest."""


def _check_names(state: Any, method: str) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"{method} expects a dict of name -> object, got a "
                         f"{type(state).__name__}; wrap it, e.g. {{'model': model}}")
    for name in state:
        if not isinstance(name, str):
            raise ValueError(f"state key {name!r} is a {type(name).__name__}; names must be str")


class _HashingWriter:
    """A write-only file that hashes what passes through, so each byte is handled once."""

    def __init__(self, file) -> None:
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _write_file(path: Path, write) -> dict:
    with open(path, "xb") as file:
        out = _HashingWriter(file)
        write(out)
        file.flush()
        os.fsync(file.fileno())
    return {"sha256": out.sha256.hexdigest(), "size": out.size}


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":  # elsewhere directories cannot be opened, and renames are journaled
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    # Renamed first, so that a writer killed mid-delete leaves no half checkpoint in view.
    doomed = path.with_name(f"{_DOOMED}{path.name}-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _read(path: Path, step: int) -> tuple[dict, dict]:
    """The manifest and the entries of checkpoint ``path``; ``_Corrupt`` if it is not whole."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise _Corrupt(f"{MANIFEST} is missing") from None
    except (OSError, ValueError) as error:
        raise _Corrupt(f"{MANIFEST} is unreadable: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _Corrupt(f"{MANIFEST} does not have format {FORMAT!r}")
    if manifest.pop("sha256", None) != _digest(manifest):
        raise _Corrupt(f"{MANIFEST} does not match its own sha256 (it was modified)")
    if manifest.get("version") != VERSION:  # whole, but not ours to read: never skip past it
        raise ValueError(
            f"checkpoint {path} has format version {manifest.get('version')!r}; this unbroken "
            f"reads version {VERSION}. Resume with the unbroken version that saved it.")
    if manifest.get("step") != step:
        raise _Corrupt(f"{MANIFEST} says step {manifest.get('step')!r}, its directory {step}")
    try:
        files, entries = manifest["files"], manifest["entries"]
        wanted = {name: entry["file"] for name, entry in entries.items()}
        expected = {file: (spec["size"], spec["sha256"]) for file, spec in files.items()}
    except (KeyError, TypeError, AttributeError) as error:
        raise _Corrupt(f"{MANIFEST} is malformed ({error!r})") from None
    for file, (size, sha256) in expected.items():
        if not isinstance(file, str) or "/" in file or file in ("", ".", "..", MANIFEST):
            raise _Corrupt(f"{MANIFEST} lists an invalid file name {file!r}")
        try:
            actual = (path / file).stat().st_size
            if actual != size:
                raise _Corrupt(f"{file} has {actual} bytes, the manifest says {size}")
            if _sha256(path / file) != sha256:
                raise _Corrupt(f"{file} does not match its sha256 in the manifest")
        except OSError as error:
            raise _Corrupt(f"{file} is unreadable: {error.strerror or error}") from None
    saved = {}
    for name, file in wanted.items():
        if file not in expected:
            raise _Corrupt(f"entry {name!r} names {file!r}, which has no sha256 in {MANIFEST}")
        try:
            saved[name] = torch.load(path / file, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any failure means: not this checkpoint
            lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
            reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0])
            reason = reason.split(". Please use")[0]  # torch's advice to allow-list it: not here
            raise _Corrupt(f"{file} does not load with torch.load(weights_only=True): "
                           f"{type(error).__name__}: {reason}") from None
    return manifest, saved


def _digest(manifest: dict) -> str:
    # The manifest seals itself too: a flipped digit in a size or a shape would otherwise pass.
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------- restoring
