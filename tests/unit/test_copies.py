"""The local copies ``FsspecStorage`` keeps of checkpoint files (``checkpoint.transfer``), against
fsspec's in-memory store (``memory://``: no server, so these run in every tier).

A copy is best effort: a cache disk that fills up (a real 1 MiB tmpfs when this runs as root,
and a file whose every write and close fails with ENOSPC) drops the copy, says why once, and
the save commits in the store. A copy is trusted only if all of it hashes to the manifest's
sha256, and a ``Sharded`` entry's shard files downloaded from a store reach DCP only once each
matched its sha256: each test below fails if that check is dropped or shortened.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import warnings

import fsspec
import pytest
import torch
from conftest import tmpfs
from torch import nn

import unbroken
from unbroken.checkpoint import Checkpointer, FsspecStorage
from unbroken.checkpoint.transfer import Copies

MEMORY = fsspec.filesystem("memory")  # one per process: each test takes a root of its own


@pytest.fixture
def url():
    root = f"memory://copies-{secrets.token_hex(6)}/run/checkpoints"
    yield root
    top = root.split("/run/")[0]
    if MEMORY.exists(top):
        MEMORY.rm(top, recursive=True)


def _copies(directory) -> list[str]:
    """The names in the copies' folder (one folder per store URL under ``directory``)."""
    folders = [os.path.join(directory, name) for name in os.listdir(directory)]
    return sorted(name for folder in folders for name in os.listdir(folder))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ----------------------------------------------------------------------- a full cache disk


@pytest.mark.parametrize("blocking", [True, False])
def test_a_full_cache_disk_drops_the_copy_and_the_save_commits_on_a_real_tmpfs(
    tmp_path, url, caplog, blocking
):
    with tmpfs(tmp_path / "disk") as disk:
        cache = disk / "cache"
        checkpointer = Checkpointer(url, storage=FsspecStorage(url, cache=str(cache)), keep=3)
        checkpointer.save(1, {"x": torch.ones(10)})
        assert len(_copies(cache)) == 1  # its file's copy
        filler = _fill(disk)
        big = torch.arange(150_000, dtype=torch.float32)  # 600 kB: more than is left
        caplog.set_level(logging.WARNING, logger="unbroken")
        checkpointer.save(2, {"x": big}, blocking=blocking)  # the copy fails, the upload not
        checkpointer.save(3, {"x": big + 1}, blocking=blocking)
        checkpointer.wait()
        said = _warnings(caplog)
        assert len(said) == 1, said  # once, not at every save
        assert "No space left on device" in said[0] and str(cache) in said[0], said
        assert "the disk holding it is full" in said[0] and "are free there" in said[0], said
        assert "The save and the read go on" in said[0], said
        assert not [name for name in _copies(cache) if name.startswith(".part-")]  # none left
        # Every checkpoint committed, whole, in the store: another machine reads them.
        reader = Checkpointer(url, storage=FsspecStorage(url, cache=False))
        restored = reader.load_latest({"x": None})
        assert restored is not None and restored.step == 3
        assert torch.equal(restored.values["x"], big + 1)
        assert sorted(MEMORY.ls(url, detail=False))[0].endswith("step-000000001")
        # Room again: the next save keeps its copy, and the copies serve a read on this machine.
        filler.unlink()
        caplog.clear()
        checkpointer.save(4, {"x": big + 2}, blocking=blocking)
        checkpointer.wait()
        assert _warnings(caplog) == []
        here = FsspecStorage(url, cache=str(cache))
        restored = Checkpointer(url, storage=here).load_latest({"x": None})
        assert restored.step == 4 and torch.equal(restored.values["x"], big + 2)
        assert here.received < 2000  # the manifest only: the 600 kB file came from its copy


def _fill(disk):
    """A file that takes every free byte of ``disk``: it is full."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(65536))
    except OSError as error:
        assert error.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert shutil.disk_usage(disk).free < 4096
    return filler


class _FullDisk:
    """A file on a full disk: its close fails with ENOSPC (a buffered file's flush cannot reach
    the disk), and so do its writes if ``writes_fail`` (one larger than its buffer)."""

    def __init__(self, writes_fail: bool) -> None:
        self.writes_fail, self.closed = writes_fail, False

    def write(self, data: bytes) -> int:
        if self.writes_fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return len(data)

    def close(self) -> None:
        self.closed = True
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("fails_at", ["write", "keep"])
def test_a_copy_whose_writes_and_close_fail_with_enospc_is_dropped_quietly(
    tmp_path, caplog, fails_at
):
    copies = Copies("memory://any", str(tmp_path / "cache"))
    caplog.set_level(logging.WARNING, logger="unbroken")
    copy = copies.new()
    copy.file.close()
    copy.file = _FullDisk(writes_fail=fails_at == "write")
    # Each raised before the fix: drop() closed the file, whose close failed again.
    copy.write(b"y" * 100)
    copy.write(b"z")
    copy.keep("0" * 64)
    copy.drop()
    assert os.listdir(copies.directory) == []  # the partial copy deleted, nothing kept
    (said,) = _warnings(caplog)
    assert "No space left on device" in said and copies.directory in said
    assert f"the copy needed at least {100 if fails_at == 'write' else 101} B" in said
    second = copies.new()
    second.file.close()
    second.file = _FullDisk(writes_fail=True)
    second.write(b"y" * 200)
    assert len(_warnings(caplog)) == 1  # said once, until a copy that large is kept again
    copies.keep(b"k" * 200)
    third = copies.new()
    third.file.close()
    third.file = _FullDisk(writes_fail=True)
    third.write(b"y")
    assert len(_warnings(caplog)) == 2


# ------------------------------------------------------------------- what a copy is trusted


def test_a_local_copy_serves_a_read_only_if_all_of_it_hashes_to_the_manifest(url, tmp_path):
    """A copy larger than one 4 MiB chunk of the hash: an intact one is read from the disk (a
    hash of the first chunk only would never match the manifest's, so it would be downloaded),
    and one damaged past its first 4 MiB is not read (it is downloaded again)."""
    cache = tmp_path / "cache"
    big = torch.arange(5 << 18, dtype=torch.float32)  # 5 MiB
    Checkpointer(url, storage=FsspecStorage(url, cache=str(cache))).save(1, {"big": big})
    reader = FsspecStorage(url, cache=str(cache))
    restored = Checkpointer(url, storage=reader).load_latest({"big": None})
    assert torch.equal(restored.values["big"], big)
    assert reader.received < 2000  # the manifest only
    folder = next(cache.iterdir())
    (copy,) = [p for p in folder.iterdir() if p.stat().st_size > 4 << 20]
    good = copy.read_bytes()
    damaged = bytearray(good)
    damaged[-64] ^= 0xFF  # past the first 4 MiB, in the tensor's bytes
    copy.write_bytes(bytes(damaged))
    reader = FsspecStorage(url, cache=str(cache))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copy is not trusted, and the checkpoint not blamed
        restored = Checkpointer(url, storage=reader).load_latest({"big": None})
    assert restored.step == 1 and torch.equal(restored.values["big"], big)
    assert reader.received >= len(good)  # downloaded, not read from the damaged copy
    assert copy.read_bytes() == good  # and the copy replaced by the download's


def _net(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    adam = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.ones(3, 64)).sum().backward()
    adam.step()
    return net, adam


@pytest.mark.parametrize("cache", ["none", "empty"])
def test_a_dcp_shard_damaged_in_the_store_is_refused_not_loaded(url, tmp_path, cache):
    """One shard file of the newest ``Sharded`` checkpoint changed in the store after its
    commit, its size kept: another machine skips that checkpoint naming the file, and loads
    the one before, bit for bit. DCP itself would load the changed bytes without a word."""
    writer = Checkpointer(url, storage=FsspecStorage(url, cache=False))
    for step in (1, 2):
        net, adam = _net(step)
        writer.save(step, {"net": unbroken.Sharded(net, adam)})
    shard = f"{url}/step-000000002/000-net.dcp/__0_0.distcp"
    data = bytearray(MEMORY.cat_file(shard))
    data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes
    MEMORY.pipe_file(shard, bytes(data))
    copies = False if cache == "none" else str(tmp_path / "empty-cache")
    reader = Checkpointer(url, storage=FsspecStorage(url, cache=copies))
    fresh, fresh_adam = _net(0)
    with pytest.warns(UserWarning, match=r"step-000000002: .*__0_0\.distcp does not match its sha"):
        restored = reader.load_latest({"net": unbroken.Sharded(fresh, fresh_adam)})
    assert restored is not None and restored.step == 1
    for key, value in _net(1)[0].state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
