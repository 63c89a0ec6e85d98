"""Another storage backend is one class: the Checkpointer's core cases on a ``Storage`` written
here, in memory, which touches no disk (save, ``load_latest``, a damaged newest checkpoint
skipped, retention, the same step saved again, a lower step after higher ones, ``PerRank``
entries, a killed writer's leftovers). Nothing outside this file knows of it."""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from collections.abc import Callable
from typing import BinaryIO

import pytest
import torch
from torch import nn

from unbroken import PerRank
from unbroken.checkpoint import Checkpointer, Storage
from unbroken.checkpoint.storage import Digest, Entry
from unbroken.checkpoint.verdict import classify

ROOT = "mem://bucket/runs/ckpt"


class MemoryStorage(Storage):
    """Files as bytes in a dict and directories as a set, keyed by their whole path; the commit
    protocol is ``Storage``'s default (a temporary directory renamed into place)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.directories: set[str] = set()
        self.calls: list[str] = []

    def _parent(self, path: str) -> str:
        return path.rstrip("/").rpartition("/")[0]

    def exists(self, path: str) -> bool:
        return path in self.files or path in self.directories

    def is_directory(self, path: str) -> bool:
        return path in self.directories

    def list_directory(self, path: str) -> list[Entry]:
        if path not in self.directories:
            raise FileNotFoundError(path)
        children = {p for p in (*self.files, *self.directories) if self._parent(p) == path}
        return [Entry(p.rpartition("/")[2], p in self.directories) for p in children]

    def make_directory(self, path: str) -> None:
        if self.exists(path) or self._parent(path) not in self.directories:
            raise FileExistsError(path) if self.exists(path) else FileNotFoundError(path)
        self.directories.add(path)

    def make_directories(self, path: str) -> None:
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if prefix and prefix not in self.files:
                self.directories.add(prefix)

    def write(self, path: str, fill: Callable[[BinaryIO], object]) -> Digest:
        if self.exists(path):
            raise FileExistsError(path)
        buffer = io.BytesIO()
        fill(buffer)
        self.files[path] = data = buffer.getvalue()
        return Digest(hashlib.sha256(data).hexdigest(), len(data))

    def open_read(self, path: str) -> BinaryIO:
        if path not in self.files:
            raise FileNotFoundError(path)
        return io.BytesIO(self.files[path])

    def size(self, path: str) -> int:
        return len(self.files[path])

    def is_link(self, path: str) -> bool:
        return False

    def rename(self, source: str, target: str) -> None:
        self.calls.append(f"rename {source.rpartition('/')[2]} {target.rpartition('/')[2]}")
        moved = lambda p: target + p[len(source) :]
        under = lambda p: p == source or p.startswith(source + "/")
        self.files = {moved(p) if under(p) else p: d for p, d in self.files.items()}
        self.directories = {moved(p) if under(p) else p for p in self.directories}

    def remove_tree(self, path: str) -> None:
        under = lambda p: p == path or p.startswith(path + "/")
        self.files = {p: d for p, d in self.files.items() if not under(p)}
        self.directories = {p for p in self.directories if not under(p)}

    def sync_directory(self, path: str) -> None:
        pass

    def free_space(self, path: str) -> int:
        return 1 << 40


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _steps(storage: MemoryStorage) -> list[str]:
    return sorted(e.name for e in storage.list_directory(ROOT) if not e.name.startswith("."))


@pytest.fixture
def storage(tmp_path, monkeypatch) -> MemoryStorage:
    monkeypatch.chdir(tmp_path)  # a relative path written by mistake would land here
    yield MemoryStorage()
    assert os.listdir(tmp_path) == []  # nothing reached the disk


def test_a_storage_written_in_a_test_satisfies_the_protocol(storage):
    protocol = {name for name in vars(Storage) if not name.startswith("_")}
    assert protocol <= set(dir(storage)), protocol - set(dir(storage))


def test_save_and_load_latest_round_trip_in_memory(storage):
    model, counter = _model(1), Counter(7)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    checkpointer = Checkpointer(ROOT, storage=storage)
    state = {"model": model, "optimizer": optimizer, "counter": PerRank(counter), "epoch": 3}
    assert checkpointer.save(5, state) == f"{ROOT}/step-000000005"
    other, other_counter = _model(2), Counter()
    other_optimizer = torch.optim.Adam(other.parameters())
    restored = Checkpointer(ROOT, storage=storage).load_latest(
        {"model": other, "optimizer": other_optimizer, "counter": PerRank(other_counter)}
    )
    assert restored and restored.step == 5 and restored.path == f"{ROOT}/step-000000005"
    assert restored.unrequested == {"epoch": 3}
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    assert other_optimizer.state_dict()["state"][0]["step"] == 1 and other_counter.value == 7
    assert any(call.startswith("rename .tmp-step-000000005") for call in storage.calls)


def test_a_damaged_newest_checkpoint_is_skipped_in_memory(storage):
    checkpointer = Checkpointer(ROOT, storage=storage)
    for step in (1, 2):
        checkpointer.save(step, {"model": _model(step)})
    data = next(p for p in storage.files if "step-000000002/000-model" in p)
    damaged = bytearray(storage.files[data])
    damaged[len(damaged) // 2] ^= 1
    storage.files[data] = bytes(damaged)
    model = _model(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = Checkpointer(ROOT, storage=storage).load_latest({"model": model})
    assert restored.step == 1
    assert any("step-000000002" in str(w.message) and "sha256" in str(w.message) for w in caught)
    assert torch.equal(model[0].weight, _model(1)[0].weight)
    # The scan behind `unbroken verify` says the same of the same storage.
    newest, older = (classify(storage, f"{ROOT}/step-00000000{s}", s) for s in (2, 1))
    assert (newest.status, older.status) == ("corrupt", "ok")
    assert "000-model.pt does not match its sha256" in newest.problems[0]


def test_retention_replacement_and_a_lower_step_in_memory(storage):
    checkpointer = Checkpointer(ROOT, keep=2, storage=storage)
    for step in (1, 2, 3, 4):
        checkpointer.save(step, {"value": step})
    assert _steps(storage) == ["step-000000003", "step-000000004"]
    checkpointer.save(4, {"value": 40})  # the same step again: replaced
    assert Checkpointer(ROOT, storage=storage).load_latest({"value": None}).values == {"value": 40}
    with pytest.raises(ValueError, match="larger step, which load_latest did not find damaged"):
        checkpointer.save(2, {"value": 20})  # newer ones, not found damaged, stay
    assert _steps(storage) == ["step-000000003", "step-000000004"]


def test_a_killed_writers_leftovers_are_ignored_then_cleaned_in_memory(storage):
    checkpointer = Checkpointer(ROOT, storage=storage)
    checkpointer.save(1, {"value": 1})
    leftover = f"{ROOT}/.tmp-step-000000002-123-abcd"
    storage.make_directory(leftover)
    storage.write(f"{leftover}/000-value.pt", lambda out: out.write(b"half a checkpoint"))
    assert Checkpointer(ROOT, storage=storage).load_latest({"value": None}).step == 1
    checkpointer.save(3, {"value": 3})
    assert not any(".tmp-" in p for p in (*storage.files, *storage.directories))
