"""What a checkpoint read from object storage trusts, against a real S3 protocol server (moto's,
on 127.0.0.1): a local copy only if all of it hashes to the manifest's sha256, a listing only
until the next question about an object, and a ``Sharded`` entry's downloaded files only once
each matched its sha256. Each test fails if that check is dropped."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import warnings

import pytest
import torch
from torch import nn

import unbroken
from unbroken.checkpoint import Checkpointer, FsspecStorage


@pytest.fixture
def url(s3):
    return s3.make_bucket(f"reads-{secrets.token_hex(4)}") + "/run/checkpoints"


def test_a_local_copy_is_read_only_if_all_of_it_matches(s3, url, tmp_path):
    cache = tmp_path / "cache"
    big = torch.arange(2 << 20, dtype=torch.float32)  # 8 MiB: two 4 MiB chunks of the hash
    storage = FsspecStorage(url, s3.storage_options, cache=str(cache))
    Checkpointer(url, storage=storage).save(1, {"big": big})
    # A restart on this machine reads the whole copy from the disk: only the manifest comes.
    reader = FsspecStorage(url, s3.storage_options, cache=str(cache))
    restored = Checkpointer(url, storage=reader).load_latest({"big": None})
    assert restored is not None and torch.equal(restored.values["big"], big)
    assert reader.received < 1000
    # The copy damaged past its first 4 MiB: a hash of a prefix would not see it.
    (copy,) = [p for p in next(cache.iterdir()).iterdir() if p.stat().st_size > 4 << 20]
    good = copy.read_bytes()
    damaged = bytearray(good)
    damaged[-100] ^= 0xFF
    copy.write_bytes(bytes(damaged))
    name = f"{url}/step-000000001/000-big.pt"
    manifest = json.loads(reader.fs.cat_file(f"{url}/step-000000001/manifest.json"))
    spec = manifest["files"]["000-big.pt"]
    # What a rank that does not hash the file itself reads (another rank verified it).
    reader = FsspecStorage(url, s3.storage_options, cache=str(cache))
    reader.expect(name, spec["sha256"], spec["size"])
    with reader.open_read(name) as opened:
        assert opened.read() == good
    assert reader.received == len(good)  # downloaded, not read from the damaged copy
    assert copy.read_bytes() == good  # and the copy replaced by the download's
    copy.write_bytes(bytes(damaged))
    reader = FsspecStorage(url, s3.storage_options, cache=str(cache))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped: the copy is not trusted, not blamed
        restored = Checkpointer(url, storage=reader).load_latest({"big": None})
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.values["big"], big)


def test_an_object_deleted_since_a_listing_is_gone(s3, url):
    """Each question about an object asks the store, not fsspec's cache of the last listing:
    another process (a writer's retention, an operator) may have deleted it since."""
    storage = FsspecStorage(url, s3.storage_options, cache=False)
    other = FsspecStorage(url, s3.storage_options, cache=False).fs
    folder = f"{url}/step-000000001"
    names = ["000-model.pt", "001-optimizer.pt", "002-rng.pt", "manifest.json"]
    for name in names:
        storage.write(f"{folder}/{name}", lambda out: out.write(b"{}"))

    def listed() -> list[str]:
        return sorted(entry.name for entry in storage.list_directory(folder))

    assert listed() == names
    other.rm_file(f"{folder}/manifest.json")
    assert not storage.exists(f"{folder}/manifest.json")
    assert listed() == names[:3]
    other.rm_file(f"{folder}/001-optimizer.pt")
    assert listed() == ["000-model.pt", "002-rng.pt"]
    other.rm_file(f"{folder}/002-rng.pt")
    with pytest.raises(FileNotFoundError):
        storage.size(f"{folder}/002-rng.pt")
    assert listed() == ["000-model.pt"]
    other.rm_file(f"{folder}/000-model.pt")
    assert not storage.is_directory(folder)


def _net(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    adam = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.ones(3, 64)).sum().backward()
    adam.step()
    return net, adam


def test_a_damaged_shard_downloaded_from_object_storage_is_not_given_to_dcp(s3, url):
    writer = Checkpointer(url, storage_options=s3.storage_options)
    for step in (1, 2):
        net, adam = _net(step)
        writer.save(step, {"net": unbroken.Sharded(net, adam)})
    shard = f"{url}/step-000000002/000-net.dcp/__0_0.distcp"
    fs = FsspecStorage(url, s3.storage_options, cache=False).fs
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: DCP itself would not notice
    fs.pipe_file(shard, bytes(data))
    # Another machine: no local copies, every file downloaded.
    reader = Checkpointer(url, storage=FsspecStorage(url, s3.storage_options, cache=False))
    fresh, fresh_adam = _net(0)
    before = _dcp_copies()
    with pytest.warns(UserWarning, match=r"step-000000002: .*__0_0\.distcp does not match its sha"):
        restored = reader.load_latest({"net": unbroken.Sharded(fresh, fresh_adam)})
    assert restored is not None and restored.step == 1
    for key, value in _net(1)[0].state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert _dcp_copies() <= before  # the damaged step's download is not left on the disk


def _dcp_copies():
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("unbroken-dcp-")}
