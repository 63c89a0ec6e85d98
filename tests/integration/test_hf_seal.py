"""``unbroken.hf.seal``: a checkpoint folder is whole and verified (sealed), or it is ignored.

The folders are built by hand as transformers' Trainer writes them (no transformers needed),
then damaged as a kill, a disk or a person would: a file truncated, changed or lost, the seal
edited, a seal's temporary file left by a kill, a symbolic link. ``last_sealed`` must pick the
newest sealed folder by its step number and name each newer one it skips.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import warnings
from pathlib import Path

import pytest

from unbroken.hf.seal import SEAL, UnsealedCheckpointWarning, check, checkpoints, last_sealed, seal

# The module, not the function that ``unbroken.hf`` exports under the same name.
sealing = importlib.import_module("unbroken.hf.seal")

FILES = {
    "model.safetensors": 3000,
    "optimizer.pt": 1500,
    "scheduler.pt": 40,
    "rng_state.pth": 200,
    "training_args.bin": 60,
    "global_step40/shard-0.bin": 100,  # a subfolder, as DeepSpeed writes
}


def _folder(directory: Path, step: int, sealed: bool = True) -> Path:
    """A ``checkpoint-<step>`` folder with HF's files (bytes that depend on the step)."""
    folder = directory / f"checkpoint-{step}"
    for name, size in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(hashlib.sha256(f"{step}{name}".encode()).digest() * size)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if sealed:
        seal(str(folder))
    return folder


def _edit(folder: Path, change, digest: bool = True) -> None:
    """Change the seal's content; with ``digest``, recompute its own sha256 as a forger would."""
    content = json.loads((folder / SEAL).read_text())
    change(content)
    if digest:
        content["sha256"] = sealing._digest(content)
    (folder / SEAL).write_text(json.dumps(content))


def test_a_sealed_folder_checks_and_its_seal_lists_every_file(tmp_path):
    folder = _folder(tmp_path, 40, sealed=False)
    content = seal(str(folder))
    written = json.loads((folder / SEAL).read_text())
    assert written == content
    assert (written["format"], written["version"]) == ("unbroken.hf.Seal", 1)
    assert sorted(written["files"]) == sorted([*FILES, "trainer_state.json"])
    model = (folder / "model.safetensors").read_bytes()
    assert written["files"]["model.safetensors"] == {
        "size": len(model),
        "sha256": hashlib.sha256(model).hexdigest(),
    }
    assert sorted(os.listdir(folder)) == sorted(
        ["global_step40", SEAL, "model.safetensors", "optimizer.pt", "rng_state.pth"]
        + ["scheduler.pt", "trainer_state.json", "training_args.bin"]
    )  # no temporary file left
    for hashes in (True, False):
        verdict = check(str(folder), hashes=hashes)
        assert (verdict.status, verdict.problems, verdict.sealed) == ("sealed", [], True)
        assert verdict.folder == str(folder) and verdict.reason() == ""
    (folder / "extra.txt").write_text("written after the seal")  # not part of the checkpoint
    assert check(str(folder)).sealed
    seal(str(folder))  # sealed again: the seal replaced, now with the new file
    assert "extra.txt" in json.loads((folder / SEAL).read_text())["files"]


def test_a_folder_without_a_seal_is_unsealed(tmp_path):
    folder = _folder(tmp_path, 40, sealed=False)
    verdict = check(str(folder))
    assert (verdict.status, verdict.problems, verdict.sealed) == ("unsealed", [], False)
    assert verdict.reason() == f"it has no {SEAL}, so its save did not finish"
    with pytest.raises(FileNotFoundError, match="no such folder"):
        seal(str(tmp_path / "checkpoint-50"))


def test_a_seal_temporary_file_left_by_a_kill_is_no_seal_and_is_not_sealed_later(tmp_path):
    folder = _folder(tmp_path, 40, sealed=False)
    (folder / sealing._TEMPORARY).write_text('{"format": "unbroken.hf.Seal", "files": {}')
    assert check(str(folder)).status == "unsealed"
    content = seal(str(folder))  # the next seal replaces the leftover, and does not list it
    assert sealing._TEMPORARY not in content["files"]
    assert not (folder / sealing._TEMPORARY).exists()
    assert check(str(folder)).sealed


def _truncate(folder: Path) -> None:
    data = (folder / "optimizer.pt").read_bytes()
    (folder / "optimizer.pt").write_bytes(data[:1000])


def _change(folder: Path) -> None:
    with open(folder / "global_step40" / "shard-0.bin", "r+b") as file:
        file.seek(1234)
        byte = file.read(1)
        file.seek(1234)
        file.write(bytes([byte[0] ^ 1]))


def _remove(folder: Path) -> None:
    (folder / "trainer_state.json").unlink()


def _link_file(folder: Path) -> None:  # the same bytes, but through a link the seal never read
    outside = folder.parent / "elsewhere.pt"
    os.replace(folder / "optimizer.pt", outside)
    os.symlink(outside, folder / "optimizer.pt")


def _link_subfolder(folder: Path) -> None:
    outside = folder.parent / "elsewhere"
    os.replace(folder / "global_step40", outside)
    os.symlink(outside, folder / "global_step40")


DAMAGE = {
    "truncated": (_truncate, "optimizer.pt has 1000 bytes, the seal says 48000", True),
    "changed": (_change, "global_step40/shard-0.bin does not match its sha256 in the seal", False),
    "missing": (_remove, "trainer_state.json is missing", True),
    "a file replaced by a link": (_link_file, "optimizer.pt is missing", True),
    "a subfolder replaced by a link": (
        _link_subfolder,
        "global_step40/shard-0.bin is missing",
        True,
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_folder_changed_after_its_seal_is_damaged(tmp_path, damage):
    make, problem, by_size = DAMAGE[damage]
    folder = _folder(tmp_path, 40)
    make(folder)
    verdict = check(str(folder))
    assert (verdict.status, verdict.problems) == ("damaged", [problem])
    assert verdict.reason() == f"its seal does not hold: {problem}"
    # Sizes only: what a change of size or a lost file shows, not a changed byte.
    assert check(str(folder), hashes=False).status == ("damaged" if by_size else "sealed")


def _outside(content) -> None:
    content["files"]["../checkpoint-50/optimizer.pt"] = content["files"].pop("optimizer.pt")


EDITS = {
    "a size, not resealed": (
        lambda c: c["files"]["model.safetensors"].update(size=1),
        False,
        "the seal does not match its own sha256",
    ),
    "a file dropped, not resealed": (
        lambda c: c["files"].pop("optimizer.pt"),
        False,
        "the seal does not match its own sha256",
    ),
    "its own sha256": (lambda c: c.update(sha256="0" * 64), False, "its own sha256"),
    "another version": (
        lambda c: c.update(version=2),
        True,
        "seal version 2; this unbroken reads 1",
    ),
    "another format": (
        lambda c: c.update(format="unbroken.Manifest"),
        True,
        "not a seal (format is not 'unbroken.hf.Seal')",
    ),
    "a path with ..": (_outside, True, "names a file outside the folder: '../checkpoint-50/"),
    "an absolute path": (
        lambda c: c["files"].update({"/etc/hostname": c["files"]["scheduler.pt"]}),
        True,
        "names a file outside the folder: '/etc/hostname'",
    ),
    "a negative size": (
        lambda c: c["files"]["scheduler.pt"].update(size=-1),
        True,
        "the seal's entry for 'scheduler.pt' is malformed",
    ),
    "a size as text": (
        lambda c: c["files"]["scheduler.pt"].update(size="1280"),
        True,
        "the seal's entry for 'scheduler.pt' is malformed",
    ),
    "a short sha256": (
        lambda c: c["files"]["scheduler.pt"].update(sha256="ab"),
        True,
        "the seal's entry for 'scheduler.pt' is malformed",
    ),
    "files not an object": (
        lambda c: c.update(files=[]),
        True,
        "the seal's 'files' is not an object",
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_seal_is_damaged_and_names_what_is_wrong(tmp_path, edit):
    change, digest, problem = EDITS[edit]
    _folder(tmp_path, 50)  # what "../checkpoint-50/optimizer.pt" reaches: a real, sealed file
    folder = _folder(tmp_path, 40)
    (tmp_path / "checkpoint-50" / "optimizer.pt").write_bytes(
        (folder / "optimizer.pt").read_bytes()
    )
    _edit(folder, change, digest)
    verdict = check(str(folder))
    assert verdict.status == "damaged"
    assert len(verdict.problems) == 1 and problem in verdict.problems[0], verdict.problems
    assert verdict.problems[0].startswith(f"{SEAL} cannot be read (")


@pytest.mark.parametrize("text", ["", '{"format": "unbroken.hf.Seal", "files": {', "[" * 100000])
def test_a_seal_that_is_not_json_is_damaged(tmp_path, text):
    folder = _folder(tmp_path, 40)
    (folder / SEAL).write_text(text)
    verdict = check(str(folder))
    assert verdict.status == "damaged"
    assert verdict.problems[0].startswith(f"{SEAL} cannot be read (")


@pytest.mark.parametrize("link", ["file", "folder"])
def test_a_folder_with_a_symbolic_link_is_not_sealed(tmp_path, link):
    folder = _folder(tmp_path, 40, sealed=False)
    target = tmp_path / "outside"
    if link == "file":
        target.write_bytes(b"weights")
    else:
        target.mkdir()
        (target / "weights.bin").write_bytes(b"weights")
    os.symlink(target, folder / "global_step40" / "linked")
    with pytest.raises(ValueError, match="global_step40/linked is a symbolic link"):
        seal(str(folder))
    assert not (folder / SEAL).exists() and check(str(folder)).status == "unsealed"


def _unsealed_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UnsealedCheckpointWarning)]


def test_last_sealed_takes_the_newest_sealed_by_step_and_names_each_one_it_skips(tmp_path):
    _folder(tmp_path, 9)
    _folder(tmp_path, 99)
    older = _folder(tmp_path, 100)  # newer than 99 (not by name: "checkpoint-99" > "...-100")
    damaged = _folder(tmp_path, 120)
    _change(damaged)
    unsealed = _folder(tmp_path, 130, sealed=False)
    (tmp_path / "checkpoint-140").write_text("a file, not a folder")
    (tmp_path / "checkpoint-final").mkdir()
    (tmp_path / "runs").mkdir()
    assert [step for step, _ in checkpoints(str(tmp_path))] == [130, 120, 100, 99, 9]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, skipped = last_sealed(str(tmp_path))
    assert path == str(older)
    assert [(v.folder, v.status) for v in skipped] == [
        (str(unsealed), "unsealed"),
        (str(damaged), "damaged"),
    ]
    assert _unsealed_warnings(caught) == [
        f"skipping checkpoint {unsealed}: it has no {SEAL}, so its save did not finish",
        f"skipping checkpoint {damaged}: its seal does not hold: "
        "global_step40/shard-0.bin does not match its sha256 in the seal",
    ]
    # Sizes only: the changed byte goes unseen, and the damaged folder is taken.
    with pytest.warns(UnsealedCheckpointWarning, match="checkpoint-130"):
        assert last_sealed(str(tmp_path), hashes=False)[0] == str(damaged)


def test_last_sealed_finds_none_when_no_folder_is_sealed(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert last_sealed(str(tmp_path)) == (None, [])
        assert last_sealed(str(tmp_path / "absent")) == (None, [])
    assert _unsealed_warnings(caught) == []
    _folder(tmp_path, 10, sealed=False)
    _truncate(_folder(tmp_path, 20))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, skipped = last_sealed(str(tmp_path))
    assert path is None and [v.status for v in skipped] == ["damaged", "unsealed"]
    assert [m.split(":")[0] for m in _unsealed_warnings(caught)] == [
        f"skipping checkpoint {tmp_path / 'checkpoint-20'}",
        f"skipping checkpoint {tmp_path / 'checkpoint-10'}",
    ]


def test_another_prefix(tmp_path):
    folder = tmp_path / "step-7"
    folder.mkdir()
    (folder / "state.pt").write_bytes(b"x")
    seal(str(folder))
    _folder(tmp_path, 8)
    assert last_sealed(str(tmp_path), prefix="step") == (str(folder), [])


def _durability_log(monkeypatch) -> list[tuple]:
    """Each ``os.fsync`` (as the inode it synced) and ``os.replace``, in the order called."""
    said: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def synced(fd):
        said.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def replaced(source, target):
        replace(source, target)
        said.append(("replace", os.path.basename(target)))

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", replaced)
    return said


def test_a_seal_makes_each_file_it_vouches_for_durable_before_it_lands_and_its_name_after(
    tmp_path, monkeypatch
):
    # A seal that lands before the bytes it vouches for would outlive them on a power loss: a
    # "sealed" folder of zeros or truncated files. Its name in the folder must be durable too.
    folder = _folder(tmp_path, 40, sealed=False)
    said = _durability_log(monkeypatch)
    content = seal(str(folder))
    landed = said.index(("replace", SEAL))  # the seal's one rename: the commit
    before = {ino for how, ino in said[:landed] if how == "fsync"}
    after = {ino for how, ino in said[landed + 1 :] if how == "fsync"}
    for relative in content["files"]:
        assert os.stat(folder / relative).st_ino in before, f"{relative} not fsynced before"
    assert os.stat(folder / "global_step40").st_ino in before  # a subfolder's names
    assert os.stat(folder / SEAL).st_ino in before  # the seal's own bytes
    assert os.stat(folder).st_ino in after, "the folder not fsynced after the seal's rename"
