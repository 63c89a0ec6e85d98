"""A remote store is any fsspec URL, through the one ``FsspecStorage``: fsspec's in-memory
filesystem (``memory://``, this process's own) runs everything that a run directory in S3 runs,
with nothing outside this file knowing of it: a ``Checkpointer`` (retention, a damaged newest
checkpoint skipped), a ``Trainer`` interrupted and resumed in one process, the lease (a second
holder refused, a live holder's renewals seen by the store's clock) and ``unbroken verify``."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import warnings

import fsspec
import pytest
import torch
from torch import nn

import unbroken
from unbroken.checkpoint import Checkpointer, FsspecStorage, storage_for
from unbroken.cli import main
from unbroken.errors import DirectoryInUse
from unbroken.train.lease import Lease

MEMORY = fsspec.filesystem("memory")  # one per process: each test takes a root of its own


@pytest.fixture
def url(tmp_path, monkeypatch):
    """A fresh ``memory://`` root, and local copies (the storage's cache) in ``tmp_path``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "machine-1"))
    root = f"memory://ub-{secrets.token_hex(6)}"
    yield root
    if MEMORY.exists(root):
        MEMORY.rm(root, recursive=True)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _flip_a_byte(path: str) -> None:
    """One byte of a file changed in place, its size kept: only its sha256 tells."""
    data = bytearray(MEMORY.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    MEMORY.pipe_file(path, bytes(data))


def test_any_url_is_served_by_the_one_fsspec_storage(url):
    storage, where = storage_for(f"{url}/ckpt")
    assert type(storage) is FsspecStorage and where == f"{url}/ckpt"
    storage.create(f"{url}/object", b"first")
    with pytest.raises(FileExistsError):
        storage.create(f"{url}/object", b"second")  # exclusive: the lease's only way in
    assert storage.read_bytes(f"{url}/object") == b"first"
    before = storage.stat(f"{url}/object")
    storage.overwrite(f"{url}/object", b"second")
    after = storage.stat(f"{url}/object")
    assert after.version != before.version and after.modified >= before.modified
    assert after.modified.tzinfo is not None  # the store's clock, in UTC
    storage.delete(f"{url}/object")
    assert not storage.exists(f"{url}/object")


def test_a_checkpointer_keeps_two_and_skips_a_damaged_newest_in_memory(url, tmp_path, monkeypatch):
    directory = f"{url}/ckpt"
    checkpointer = Checkpointer(directory, keep=2)
    for step in (1, 2, 3):
        checkpointer.save(step, {"model": _model(step), "step": step})
    assert sorted(p.rpartition("/")[2] for p in MEMORY.ls(directory, detail=False)) == [
        "step-000000002",
        "step-000000003",
    ]
    model = _model(9)
    assert Checkpointer(directory).load_latest({"model": model}).step == 3
    assert torch.equal(model[0].weight, _model(3)[0].weight)

    _flip_a_byte(f"{directory}/step-000000003/000-model.pt")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "machine-2"))  # no local copies there
    model = _model(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = Checkpointer(directory).load_latest({"model": model})
    assert restored.step == 2 and torch.equal(model[0].weight, _model(2)[0].weight)
    assert any("step-000000003" in str(w.message) and "sha256" in str(w.message) for w in caught)


class _Interrupt:
    """A callback that stops the run (an exception out of ``fit``) after batch ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, logs) -> None:
        if trainer.progress.batches == self.at:
            raise KeyboardInterrupt(f"interrupted after batch {self.at}")


def _fit(directory: str, callbacks=()) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randint(0, 3, (40,)))
    loader = unbroken.DataLoader(data, batch_size=4, shuffle=True, seed=0)
    trainer = unbroken.Trainer(
        directory,
        max_epochs=2,
        checkpoint_every_seconds=None,
        checkpoint_every_steps=3,
        progress_bar=False,
        tensorboard=False,
        signals=(),
        lease_seconds=2.0,
        callbacks=callbacks,
    )
    trainer.fit(
        model,
        optimizer,
        loader,
        training_step=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
    )
    return model


def test_a_trainer_run_directory_in_memory_is_interrupted_and_resumed_exactly(url, caplog):
    uninterrupted = _fit(f"{url}/reference")
    run = f"{url}/run"
    with pytest.raises(KeyboardInterrupt):
        _fit(run, callbacks=[_Interrupt(at=7)])  # between two checkpoints (steps 6 and 9)
    assert MEMORY.exists(f"{run}/checkpoints/step-000000006/manifest.json")
    with caplog.at_level(logging.INFO, logger="unbroken"):
        resumed = _fit(run)
    assert f"resumed from checkpoint {run}/checkpoints/step-000000006" in caplog.text
    for (name, want), got in zip(uninterrupted.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(got, want), name
    log = MEMORY.cat_file(f"{run}/metrics.csv")
    assert log == MEMORY.cat_file(f"{url}/reference/metrics.csv")  # cut back, then continued


def test_the_lease_refuses_a_second_holder_until_the_first_releases_it(url):
    run = f"{url}/run"
    first = Lease(storage_for(run)[0], run, seconds=1.0)
    first.acquire()
    try:
        with pytest.raises(DirectoryInUse):
            Lease(storage_for(run)[0], run, seconds=1.0).acquire()
    finally:
        first.release()
    second = Lease(storage_for(run)[0], run, seconds=1.0)
    second.acquire()  # released: taken at once
    assert second.generation == first.generation + 1
    second.release()


def test_a_holder_elsewhere_that_renews_is_refused_and_one_that_stopped_is_replaced(url):
    run = f"{url}/run"
    generation = f"{run}/.lock.{1:012d}"  # the lease's documented names: .lock.<n>
    holder = {"token": "theirs", "host": "another-machine", "machine": "m", "pid": 7}
    stop, renewals = threading.Event(), [0]

    def renew() -> None:  # the other machine's heartbeat
        while not stop.is_set():
            renewals[0] += 1
            MEMORY.pipe_file(generation, json.dumps({**holder, "renewal": renewals[0]}).encode())
            stop.wait(0.1)

    heartbeat = threading.Thread(target=renew, daemon=True)
    heartbeat.start()
    try:
        with pytest.raises(DirectoryInUse, match="renewed or taken while this job waited"):
            Lease(storage_for(run)[0], run, seconds=1.0).acquire()
    finally:
        stop.set()
        heartbeat.join()
    lease = Lease(storage_for(run)[0], run, seconds=1.0)
    lease.acquire()  # not renewed for `seconds`: its holder is gone
    assert lease.generation == 2 and lease.waited >= 1.0
    lease.release()


def test_unbroken_verify_and_inspect_read_a_store_in_memory(url, capsys):
    directory = f"{url}/ckpt"
    checkpointer = Checkpointer(directory)
    for step in (1, 2):
        checkpointer.save(step, {"model": _model(step)})
    assert main(["verify", directory]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", directory]) == 0
    listed = json.loads(capsys.readouterr().out)
    written = [c["written"] for c in listed["checkpoints"]]
    assert all(w and w.endswith("Z") for w in written), written  # the store's clock
    assert all(c["bytes"] > 0 for c in listed["checkpoints"])

    _flip_a_byte(f"{directory}/step-000000002/000-model.pt")
    assert main(["verify", directory]) == 1
    out = capsys.readouterr().out
    assert "step-000000002" in out and "sha256" in out, out
