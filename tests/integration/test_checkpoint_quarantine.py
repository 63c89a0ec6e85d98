"""A checkpoint found damaged is never deleted: the next save moves it into ``damaged/`` with its
files as they were and a note of why (the newest 3 stay), and ``unbroken verify`` lists it. A
save's requests to the store do not grow with the checkpoints kept: each is judged once a
process. On a local disk and on fsspec's in-memory store (``memory://``, which moves by copy)."""

from __future__ import annotations

import json
import logging
import secrets
import warnings
from pathlib import Path

import fsspec
import pytest

from unbroken.checkpoint import Checkpointer, FsspecStorage
from unbroken.checkpoint.verdict import DIRECTORY, KEEP, REASON
from unbroken.cli import main

MEMORY = fsspec.filesystem("memory")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != REASON}


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _resume(checkpointer: Checkpointer) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "skipping checkpoint ...": tested elsewhere
        restored = checkpointer.load_latest({"value": None})
    assert restored is not None
    return restored.step


def test_a_damaged_newest_checkpoint_is_moved_aside_whole_by_the_next_save(tmp_path, caplog):
    checkpointer = Checkpointer(tmp_path, keep=3)
    for step in (1, 2, 3):
        checkpointer.save(step, {"value": list(range(step * 100))})
    damaged = tmp_path / "step-000000003"
    _flip_a_byte(damaged / "000-value.pt")
    evidence = _files(damaged)
    resumed = Checkpointer(tmp_path, keep=3)
    assert _resume(resumed) == 2
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        resumed.save(3, {"value": "redone"})  # the same step: its commit would replace it
    (moved,) = (tmp_path / DIRECTORY).iterdir()
    assert moved.name.endswith("-step-000000003")
    assert _files(moved) == evidence  # every file, byte for byte, the damage included
    note = json.loads((moved / REASON).read_text())
    assert note["checkpoint"] == str(damaged)
    assert "000-value.pt does not match its sha256" in note["problems"][0]
    assert str(moved) in caplog.text and "damaged" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        DIRECTORY,
        "step-000000001",
        "step-000000002",
        "step-000000003",
    ]
    assert Checkpointer(tmp_path).load_latest({"value": None}).values == {"value": "redone"}


def test_a_damaged_checkpoint_of_a_larger_step_is_moved_aside_not_deleted(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in (1, 2):
        checkpointer.save(step, {"value": step})
    _flip_a_byte(tmp_path / "step-000000002" / "000-value.pt")
    evidence = _files(tmp_path / "step-000000002")
    assert _resume(checkpointer) == 1
    checkpointer.save(1, {"value": "again"})  # a lower step: the run went back
    (moved,) = (tmp_path / DIRECTORY).iterdir()
    assert _files(moved) == evidence
    assert sorted(p.name for p in tmp_path.iterdir()) == [DIRECTORY, "step-000000001"]


def test_only_the_newest_damaged_checkpoints_stay_and_the_others_are_named(tmp_path, caplog):
    checkpointer = Checkpointer(tmp_path, keep=2)
    checkpointer.save(0, {"value": 0})
    for step in range(1, KEEP + 3):
        checkpointer.save(step, {"value": step})
        _flip_a_byte(tmp_path / f"step-{step:09d}" / "000-value.pt")
        assert _resume(checkpointer) == 0
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            checkpointer.save(0, {"value": 0})
    kept = sorted(p.name for p in (tmp_path / DIRECTORY).iterdir())
    assert [name.rpartition("-")[2] for name in kept] == [
        f"{step:09d}" for step in range(3, KEEP + 3)
    ]
    assert f"only the newest {KEEP} damaged checkpoints are kept" in caplog.text
    assert caplog.text.count("deleting ") == 2


def test_verify_lists_the_damaged_checkpoints_moved_aside_and_does_not_fail_on_them(
    tmp_path, capsys
):
    checkpointer = Checkpointer(tmp_path)
    for step in (1, 2):
        checkpointer.save(step, {"value": step})
    _flip_a_byte(tmp_path / "step-000000002" / "000-value.pt")
    assert _resume(checkpointer) == 1
    checkpointer.save(2, {"value": "again"})
    assert main(["verify", str(tmp_path), "--json"]) == 0  # the checkpoints verify
    (found,) = json.loads(capsys.readouterr().out)["damaged"]
    assert found["checkpoint"] == str(tmp_path / "step-000000002")
    assert found["path"] == str(next((tmp_path / DIRECTORY).iterdir()))
    assert "does not match its sha256" in found["problems"][0]
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "moved aside as damaged" in out and found["name"] in out


# ------------------------------------------------------------------------- an object store


@pytest.fixture
def url(tmp_path, monkeypatch):
    """A fresh ``memory://`` root, and local copies (the storage's cache) in ``tmp_path``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = f"memory://ub-{secrets.token_hex(6)}"
    yield root
    if MEMORY.exists(root):
        MEMORY.rm(root, recursive=True)


def _moved_aside_in_a_store(directory: str, options: dict, fs, new_machine) -> None:
    """A damaged newest checkpoint in ``directory`` (a URL, of filesystem ``fs``), resumed past
    on a ``new_machine()`` (no local copies) and saved again: moved into ``damaged/`` object by
    object, the damage included."""
    checkpointer = Checkpointer(directory, storage_options=options)
    for step in (1, 2):
        checkpointer.save(step, {"value": list(range(step * 100))})
    data = f"{directory}/step-000000002/000-value.pt"
    damaged = bytearray(fs.cat_file(data))
    damaged[len(damaged) // 2] ^= 0xFF
    fs.pipe_file(data, bytes(damaged))
    evidence = {
        path.rpartition("/")[2]: fs.cat_file(path)
        for path in fs.find(f"{directory}/step-000000002")
    }
    new_machine()
    resumed = Checkpointer(directory, storage_options=options)
    assert _resume(resumed) == 1
    resumed.save(2, {"value": "again"})
    fs.invalidate_cache()
    (moved,) = fs.ls(f"{directory}/{DIRECTORY}", detail=False)
    found = {path.rpartition("/")[2]: fs.cat_file(path) for path in fs.find(moved)}
    assert found.pop(REASON) and found == evidence
    again = Checkpointer(directory, storage_options=options).load_latest({"value": None})
    assert again.values == {"value": "again"}


def _machines(tmp_path, monkeypatch):
    """A callable that moves this process to a machine with no local copies yet."""
    return lambda: monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / secrets.token_hex(4)))


def test_a_damaged_checkpoint_in_a_store_is_moved_aside_whole(url, tmp_path, monkeypatch):
    new_machine = _machines(tmp_path, monkeypatch)
    _moved_aside_in_a_store(f"{url}/ckpt", {}, MEMORY, new_machine)


def test_a_damaged_checkpoint_in_s3_is_moved_aside_whole(s3, tmp_path, monkeypatch):
    new_machine = _machines(tmp_path, monkeypatch)
    new_machine()
    directory = f"{s3.make_bucket(f'quarantine-{secrets.token_hex(4)}')}/ckpt"
    fs = FsspecStorage(directory, s3.storage_options).fs
    _moved_aside_in_a_store(directory, s3.storage_options, fs, new_machine)


class Counting(FsspecStorage):
    """An ``FsspecStorage`` that counts its operations on the store (each a request or two)."""

    calls = 0

    def _call(self, what, path, call, missing=""):
        self.calls += 1
        return super()._call(what, path, call, missing)


def _requests_of_a_save(url: str, kept: int) -> int:
    directory = f"{url}/keep-{kept}"
    filler = Checkpointer(directory, keep=kept)
    for step in range(kept):
        filler.save(step, {"value": step})
    storage = Counting(directory)
    checkpointer = Checkpointer(directory, keep=kept, storage=storage)
    checkpointer.save(kept, {"value": kept})  # a new process: each kept one is judged once
    before = storage.calls
    checkpointer.save(kept + 1, {"value": kept + 1})
    return storage.calls - before


def test_a_saves_requests_do_not_grow_with_the_checkpoints_kept(url):
    few, many = _requests_of_a_save(url, 3), _requests_of_a_save(url, 30)
    assert few == many, f"a save with 3 kept made {few} requests, with 30 kept {many}"
