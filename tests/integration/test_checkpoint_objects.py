"""Checkpoints in object storage, against a real S3 protocol server (moto's, on 127.0.0.1).

An object store has no rename: the manifest, written last, is the commit. So a prefix without
one is no checkpoint (never loaded, never even warned about) and is cleaned up by the next save;
a checkpoint replaced or dropped loses its manifest before its parts; an upload that fails is
aborted and retried, and a save that still fails leaves nothing that loads.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import tempfile
import warnings

import pytest
import torch
from torch import nn

import unbroken
import unbroken.cli
from unbroken.checkpoint import Checkpointer, FsspecStorage, layout
from unbroken.checkpoint.verdict import classify
from unbroken.errors import RemoteUnavailable


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _state(seed: int) -> dict:
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "epoch": seed}


@pytest.fixture
def url(s3):
    return s3.make_bucket(f"ckpt-{secrets.token_hex(4)}") + "/runs/exp1/checkpoints"


def _objects(s3, url: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options)
    return sorted(p.split("/checkpoints/", 1)[1] for p in fs.find(url))


def _client(s3):
    """A plain boto3 client of the server, to see what fsspec does not show (uploads in flight)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def _fresh(url, s3, **kwargs) -> Checkpointer:
    return Checkpointer(url, storage_options=s3.storage_options, **kwargs)


def test_save_and_load_latest_through_s3_leave_nothing_on_the_local_disk(
    s3, url, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    saved = _state(1)
    path = _fresh(url, s3).save(7, saved)
    assert path == f"{url}/step-000000007"
    assert _objects(s3, url) == [
        "step-000000007/000-model.pt",
        "step-000000007/001-optimizer.pt",
        "step-000000007/002-epoch.pt",
        "step-000000007/manifest.json",
    ]
    loaded = _state(2)
    restored = _fresh(url, s3).load_latest(loaded)
    assert (restored.step, restored.path, restored.values) == (7, path, {"epoch": 1})
    for key, value in saved["model"].state_dict().items():
        assert torch.equal(loaded["model"].state_dict()[key], value), key
    assert loaded["optimizer"].state_dict()["state"][0]["step"] == 1
    assert os.listdir(tmp_path) == []


def test_a_prefix_without_its_manifest_is_no_checkpoint_and_the_next_save_removes_it(s3, url):
    checkpointer = _fresh(url, s3)
    checkpointer.save(1, {"value": 1})
    checkpointer.save(2, {"value": 2})
    storage = FsspecStorage(url, s3.storage_options)
    storage.fs.rm_file(f"{url}/step-000000002/manifest.json")  # a writer killed before its seal
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not corrupt: not there
        restored = _fresh(url, s3).load_latest({"value": None})
    assert (restored.step, restored.values) == (1, {"value": 1})
    checkpointer.save(3, {"value": 3})
    assert [name.split("/")[0] for name in _objects(s3, url)] == ["step-000000001"] * 2 + [
        "step-000000003"
    ] * 2


def test_retention_and_the_same_step_again_on_s3(s3, url):
    checkpointer = _fresh(url, s3, keep=2)
    for step in (1, 2, 3):
        checkpointer.save(step, {"value": step})
    checkpointer.save(3, {"value": 30})
    assert sorted({name.split("/")[0] for name in _objects(s3, url)}) == [
        "step-000000002",
        "step-000000003",
    ]
    assert _fresh(url, s3).load_latest({"value": None}).values == {"value": 30}


def test_a_damaged_object_in_the_newest_checkpoint_is_skipped_with_the_reason(s3, url):
    checkpointer = _fresh(url, s3)
    checkpointer.save(1, {"model": _model(1)})
    checkpointer.save(2, {"model": _model(2)})
    storage = FsspecStorage(url, s3.storage_options)
    target = f"{url}/step-000000002/000-model.pt"
    data = bytearray(storage.fs.cat_file(target))
    data[len(data) // 2] ^= 1
    storage.fs.pipe_file(target, bytes(data))
    model = _model(9)
    # On a new machine (no local copies: this one's copy of the file is whole, and would do).
    elsewhere = Checkpointer(url, storage=FsspecStorage(url, s3.storage_options, cache=False))
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000002: .*sha256"):
        assert elsewhere.load_latest({"model": model}).step == 1
    assert torch.equal(model[0].weight, _model(1)[0].weight)
    storage = FsspecStorage(url, s3.storage_options, cache=False)
    verdict = classify(storage, f"{url}/step-000000002", 2)
    assert verdict.status == "corrupt" and "sha256" in verdict.problems[0]


class _Failing(FsspecStorage):
    """Uploads that fail after ``after`` good ones, each attempt ``times`` times."""

    def __init__(self, *args, after: int, times: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.after, self.times, self.attempts = after, times, 0

    def _upload(self, path, fill):
        self.attempts += 1
        if self.after <= 0 and self.times > 0:
            self.times -= 1

            def half(out):
                fill(out)
                raise ConnectionError("the connection dropped mid-upload")

            return super()._upload(path, half)
        self.after -= 1
        return super()._upload(path, fill)


def test_a_dropped_upload_is_retried_and_the_checkpoint_loads(s3, url):
    storage = _Failing(url, s3.storage_options, after=1, times=2, backoff=0.01)
    Checkpointer(url, storage=storage).save(4, _state(4))
    assert storage.attempts == 3 + 2 + 1  # three files and the manifest, two of them again
    loaded = _state(0)
    assert _fresh(url, s3).load_latest(loaded).step == 4


def test_a_save_whose_uploads_keep_failing_raises_and_leaves_nothing_that_loads(s3, url):
    _fresh(url, s3).save(1, {"value": 1})
    storage = _Failing(url, s3.storage_options, after=1, times=99, retries=1, backoff=0.01)
    with pytest.raises(RemoteUnavailable, match="could not upload .*step-000000002"):
        Checkpointer(url, storage=storage).save(2, {"value": 2, "model": _model(2)})
    assert {name.split("/")[0] for name in _objects(s3, url)} == {"step-000000001"}
    assert _fresh(url, s3).load_latest({"value": None}).step == 1
    _fresh(url, s3).save(2, {"value": 2})  # the next save goes through
    assert _fresh(url, s3).load_latest({"value": None}).step == 2


def test_an_interrupted_multipart_upload_is_aborted(s3, url):
    storage = FsspecStorage(url, s3.storage_options)
    big = os.urandom(12 << 20)  # several parts of s3fs's multipart upload

    def fill(out):
        for start in range(0, len(big), 1 << 20):
            out.write(big[start : start + (1 << 20)])
        raise KeyboardInterrupt  # the process is being stopped mid-upload

    with pytest.raises(KeyboardInterrupt):
        storage.write(f"{url}/big.pt", fill)
    bucket = url.split("/")[2]
    client = _client(s3)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert not storage.exists(f"{url}/big.pt")


def test_the_server_stopped_during_a_save_then_back(tmp_path):
    from unbroken.testing import S3Server

    with S3Server() as server:
        url = server.make_bucket("outage") + "/ckpt"
        options = server.storage_options
        Checkpointer(url, storage_options=options).save(1, {"value": 1})
        storage = FsspecStorage(url, options, retries=1, backoff=0.01)
        checkpointer = Checkpointer(url, storage=storage)
        real = storage._upload
        port = server.port

        def outage(path, fill):
            if path.endswith("001-model.pt"):
                server.stop()  # the server goes away between two files of the save
            return real(path, fill)

        storage._upload = outage
        with pytest.raises(RemoteUnavailable):
            checkpointer.save(2, {"value": 2, "model": _model(2)})
        server.port = port
        server.start()  # the same endpoint, every object gone: a new, empty store
        server.make_bucket("outage")
        storage._upload = real
        checkpointer.save(3, {"value": 3})
        assert Checkpointer(url, storage_options=options).load_latest({"value": 0}).step == 3


def test_bad_urls_are_refused_before_anything_is_saved(s3, tmp_path):
    with pytest.raises(FileNotFoundError, match="the bucket 'no-such-bucket' does not exist"):
        Checkpointer("s3://no-such-bucket/run", storage_options=s3.storage_options)
    with pytest.raises(ValueError, match="protocol 'nope'"):
        Checkpointer("nope://bucket/run")
    with pytest.raises(ValueError, match="storage_options are for a URL"):
        Checkpointer(tmp_path, storage_options=s3.storage_options)
    with pytest.raises(RemoteUnavailable, match="could not reach"):
        Checkpointer(
            "s3://bucket/run",
            storage_options={**s3.storage_options, "endpoint_url": "http://127.0.0.1:9"},
        )


def test_a_file_url_is_a_local_directory(tmp_path):
    checkpointer = Checkpointer(f"file://{tmp_path}/ckpt")
    checkpointer.save(1, {"value": 1})
    assert (tmp_path / "ckpt" / "step-000000001" / "manifest.json").is_file()
    assert unbroken.Checkpointer(tmp_path / "ckpt").load_latest({"value": 0}).step == 1


def test_object_storage_reads_one_download_per_file(s3, url, monkeypatch):
    _fresh(url, s3).save(1, {"model": _model(1)})
    storage = FsspecStorage(url, s3.storage_options, cache=False)  # a new machine
    downloads = []
    real = storage.fs.cat_file
    monkeypatch.setattr(
        storage.fs, "cat_file", lambda path, **kw: downloads.append(path) or real(path, **kw)
    )
    Checkpointer(url, storage=storage).load_latest({"model": _model(2)})
    assert sorted(p.rpartition("/")[2] for p in downloads) == ["000-model.pt", "manifest.json"]
    assert isinstance(storage.open_read(downloads[-1]), io.BytesIO)


def test_unbroken_inspect_and_verify_a_url(s3, url, capsys):
    import json

    from unbroken.cli import main

    checkpointer = _fresh(url, s3)
    for step in (1, 2):
        checkpointer.save(step, {"model": _model(step)})
    options = ["--storage-options", json.dumps(s3.storage_options)]
    assert main(["verify", url, *options]) == 0
    assert "OK: the newest checkpoint, step-000000002, verifies" in capsys.readouterr().out
    assert main(["inspect", url, "--json", *options]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["kind"] == "checkpoints" and document["checkpoints_directory"] == url
    newest = document["checkpoints"][-1]
    assert (newest["path"], newest["verified"]) == (f"{url}/step-000000002", True)
    assert newest["bytes"] > 0 and newest["written"].endswith("Z")
    run = url.rpartition("/")[0]  # the run directory holding checkpoints/
    assert main(["inspect", run, "--json", *options]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "run"
    storage = FsspecStorage(url, s3.storage_options)
    storage.fs.pipe_file(f"{url}/step-000000002/000-model.pt", b"not a checkpoint")
    assert main(["verify", url, *options]) == 1
    said = capsys.readouterr().out
    assert (
        "step-000000002: 000-model.pt has 16 bytes" in said
        and "fall back to step-000000001" in said
    )
    assert main(["verify", "s3://no-such-bucket/x", *options]) == 2
    assert "the bucket 'no-such-bucket' does not exist" in capsys.readouterr().err


def test_a_killed_writers_multipart_upload_is_aborted_by_the_next_save(s3, url):
    client = _client(s3)
    bucket, _, key = url.removeprefix("s3://").partition("/")
    # What a writer SIGKILLed mid-upload leaves: an upload begun, never completed nor aborted.
    client.create_multipart_upload(Bucket=bucket, Key=f"{key}/step-000000002/000-model.pt")
    elsewhere = client.create_multipart_upload(Bucket=bucket, Key="other/data.bin")
    _fresh(url, s3).save(3, {"value": 3})
    left = [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    assert left == ["other/data.bin"]  # only the checkpoints' own
    client.abort_multipart_upload(
        Bucket=bucket, Key="other/data.bin", UploadId=elsewhere["UploadId"]
    )


def _dcp_copies():
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("unbroken-dcp-")}


def test_a_sharded_entry_goes_through_dcp_to_s3_and_back(s3, url):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    before = _dcp_copies()  # another process's may be there: only this test's must go

    saved = _state(3)
    net, adam = saved["model"], saved["optimizer"]
    _fresh(url, s3).save(1, {"net": unbroken.Sharded(net, adam), "note": "dcp"})
    assert [name for name in _objects(s3, url) if ".dcp/" in name] == [
        "step-000000001/000-net.dcp/.metadata",
        "step-000000001/000-net.dcp/__0_0.distcp",
    ]
    fresh = _state(4)
    restored = _fresh(url, s3).load_latest(
        {"net": unbroken.Sharded(fresh["model"], fresh["optimizer"]), "note": None}
    )
    assert restored.values == {"note": "dcp"}
    for key, value in net.state_dict().items():
        assert torch.equal(fresh["model"].state_dict()[key], value), key
    want = get_optimizer_state_dict(net, adam)["state"]
    got = get_optimizer_state_dict(fresh["model"], fresh["optimizer"])["state"]
    for key, state in want.items():
        for name, value in state.items():
            assert torch.equal(got[key][name], value), (key, name)
    assert _dcp_copies() <= before


class _DyingInRetention(FsspecStorage):
    """Killed while deleting an old checkpoint's parts: one part gone, then the process dies."""

    armed = False

    def remove_tree(self, path):
        if self.armed and path.rstrip("/").endswith("step-000000001"):
            self.armed = False
            self.fs.rm_file(sorted(self.fs.find(path))[0])  # the first object of it goes
            raise KeyboardInterrupt("killed mid-delete")
        super().remove_tree(path)


def test_a_writer_killed_while_dropping_an_old_checkpoint_leaves_none_half_in_view(s3, url):
    storage = _DyingInRetention(url, s3.storage_options)
    checkpointer = Checkpointer(url, keep=2, storage=storage)
    for step in (1, 2):
        checkpointer.save(step, {"model": _model(step)})
    storage.armed = True
    with pytest.raises(KeyboardInterrupt):
        checkpointer.save(3, {"model": _model(3)})  # commits 3, then drops 1: killed there
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # step 1 lost its manifest first: not corrupt, gone
        assert _fresh(url, s3).load_latest({"model": _model(0)}).step == 3
    seen = layout.candidates(FsspecStorage(url, s3.storage_options), url)
    assert [step for step, _ in seen] == [2, 3]  # no step 1 with a part missing
    assert (
        unbroken.cli.main(["verify", url, "--storage-options", json.dumps(s3.storage_options)]) == 0
    )


class _FailingAfterCommit(FsspecStorage):
    """The store goes away right after a checkpoint's manifest is written (its commit)."""

    def write(self, path, fill):
        digest = super().write(path, fill)
        if path.endswith("step-000000003/manifest.json"):
            self.list_directory = self._unreachable
        return digest

    def _unreachable(self, path):
        raise RemoteUnavailable(f"could not list {path}: the store went away")


def test_a_save_failing_after_its_commit_keeps_the_committed_checkpoint(s3, url):
    storage = _FailingAfterCommit(url, s3.storage_options)
    checkpointer = Checkpointer(url, storage=storage)
    for step in (1, 2):
        checkpointer.save(step, {"value": step})
    with pytest.raises(RemoteUnavailable):
        checkpointer.save(3, {"value": 3})  # committed; its retention could not list
    assert _fresh(url, s3).load_latest({"value": None}).values == {"value": 3}


def _downloads(storage, monkeypatch) -> list[str]:
    downloads: list[str] = []
    real = storage.fs.cat_file
    monkeypatch.setattr(
        storage.fs,
        "cat_file",
        lambda path, **kw: downloads.append(path.rpartition("/")[2]) or real(path, **kw),
    )
    return downloads


def test_a_restart_on_the_same_machine_reads_its_verified_local_copies(
    s3, url, tmp_path, monkeypatch
):
    cache = str(tmp_path / "cache")
    writer = Checkpointer(url, storage=FsspecStorage(url, s3.storage_options, cache=cache))
    for step in (1, 2, 3):
        writer.save(step, {"model": _model(step)})
    copies = sorted(os.listdir(next((tmp_path / "cache").iterdir())))
    # The models of steps 2 and 3: step 1's was pruned, and so are the manifests' copies (a
    # manifest is always read from the store: it says which copies can be trusted).
    assert len(copies) == 2
    storage = FsspecStorage(url, s3.storage_options, cache=cache)
    downloads = _downloads(storage, monkeypatch)
    model = _model(0)
    assert Checkpointer(url, storage=storage).load_latest({"model": model}).step == 3
    assert downloads == ["manifest.json"]  # the model from the disk
    assert storage.received < 1000
    assert torch.equal(model[0].weight, _model(3)[0].weight)
    # A copy that changed on the disk is not trusted: the file is downloaded, nothing skipped.
    for name in copies:
        path = next((tmp_path / "cache").iterdir()) / name
        path.write_bytes(b"x" * path.stat().st_size)
    storage = FsspecStorage(url, s3.storage_options, cache=cache)
    downloads = _downloads(storage, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Checkpointer(url, storage=storage).load_latest({"model": _model(0)}).step == 3
    assert downloads == ["manifest.json", "000-model.pt"]


def test_a_deleted_object_in_the_newest_checkpoint_is_skipped_with_the_reason(s3, url):
    checkpointer = _fresh(url, s3)
    for step in (1, 2):
        checkpointer.save(step, {"model": _model(step), "step": step})
    FsspecStorage(url, s3.storage_options).fs.rm_file(f"{url}/step-000000002/000-model.pt")
    elsewhere = Checkpointer(url, storage=FsspecStorage(url, s3.storage_options, cache=False))
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000002: 000-model\.pt"):
        assert elsewhere.load_latest({"model": _model(0), "step": 0}).step == 1


def test_a_local_copy_gone_since_it_was_found_is_downloaded(s3, url, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    storage = FsspecStorage(url, s3.storage_options, cache=cache)
    Checkpointer(url, storage=storage).save(1, {"model": _model(1)})
    assert Checkpointer(url, storage=storage).load_latest({"model": _model(0)}).step == 1
    for copy in next((tmp_path / "cache").iterdir()).iterdir():
        copy.unlink()  # pruned, or cleaned by the user, since this process found it
    downloads = _downloads(storage, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Checkpointer(url, storage=storage).load_latest({"model": _model(0)}).step == 1
    assert downloads == ["manifest.json", "000-model.pt"]


def test_a_large_object_is_uploaded_in_parts_and_downloaded_whole_in_parts(s3, url):
    # 40 MiB in one write (as torch.save writes a tensor): uploaded in parts of the filesystem's
    # block size, read back in ranged requests of transfer.DOWNLOAD_PART, a batch at a time.
    storage = FsspecStorage(url, {**s3.storage_options, "default_block_size": 5 << 20}, cache=False)
    big = os.urandom(40 << 20)
    parts = []
    real = storage.fs.cat_ranges
    storage.fs.cat_ranges = lambda paths, *args, **kw: (
        parts.append(len(paths)) or real(paths, *args, **kw)
    )
    digest = storage.write(f"{url}/big.pt", lambda out: out.write(big))
    assert digest.size == len(big)
    assert storage.fs.info(f"{url}/big.pt")["ETag"].endswith('-8"')  # 8 parts of 5 MiB
    with storage.open_read(f"{url}/big.pt") as opened:
        assert opened.read() == big
    assert sum(parts) == 3  # 16 + 16 + 8 MiB
