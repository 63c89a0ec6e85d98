"""A store that cannot be read is not a corrupt checkpoint, and a failed upload lets its process
exit (the moto S3 server on 127.0.0.1).

The store goes down right after the checkpoints were listed: its endpoint then refuses
connections (a port nothing listens on). ``load_latest`` must raise ``RemoteUnavailable``
naming the directory, never skip the checkpoints as corrupt and return "none" (a Trainer would
start fresh and its first save delete them as "a larger step"); ``unbroken verify`` must say it
could not read them, not that they are corrupt. A save never deletes a newer checkpoint that
was not read and found damaged.

The same holds past the first read of the manifest (on a local disk that stops answering at one
read): the manifest read again, a file hashed, an entry's file loaded.

An upload that fails mid-way (its store gone, or its multipart upload aborted by another
writer's clean-up) with its abort failing too must still let the interpreter exit.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import unbroken
import unbroken.cli
from unbroken.checkpoint import Checkpointer, FsspecStorage, LocalStorage, layout, verdict
from unbroken.errors import RemoteUnavailable


@pytest.fixture(scope="module")
def refused():
    """An endpoint that refuses connections: a port bound, but not listening."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{closed.getsockname()[1]}"


class Outage:
    """From right after ``layout.candidates`` (the listing of ``load_latest`` and of
    ``unbroken verify``) until ``end()``, the storage that listed talks to ``refused``."""

    def __init__(self, monkeypatch, refused: str) -> None:
        self.refused, self.down = refused, []
        real = layout.candidates

        def listed_then_down(storage, root):
            found = real(storage, root)
            if isinstance(storage, FsspecStorage) and not self.down:
                self.down.append((storage, storage.storage_options, storage.retries))
                storage.storage_options = {**storage.storage_options, "endpoint_url": refused}
                storage._fs, storage.retries, storage.backoff = None, 1, 0.01
            return found

        monkeypatch.setattr(layout, "candidates", listed_then_down)

    def end(self) -> None:
        for storage, options, retries in self.down:
            storage.storage_options, storage.retries, storage._fs = options, retries, None


def _url(s3, name: str) -> str:
    return s3.make_bucket(f"{name}-{secrets.token_hex(4)}") + "/runs/exp1"


def _steps(s3, checkpoints: str) -> list[str]:
    storage = FsspecStorage(checkpoints, s3.storage_options, cache=False)
    return [name for _, name in layout.committed(storage, checkpoints)]


def test_load_latest_raises_naming_the_store_and_skips_nothing(s3, refused, monkeypatch):
    checkpoints = _url(s3, "unread") + "/checkpoints"
    for step in (10, 20):
        Checkpointer(checkpoints, storage_options=s3.storage_options).save(step, {"step": step})
    outage = Outage(monkeypatch, refused)
    checkpointer = Checkpointer(checkpoints, storage_options=s3.storage_options)
    with warnings.catch_warnings(record=True) as said, pytest.raises(RemoteUnavailable) as raised:
        warnings.simplefilter("always")
        checkpointer.load_latest({"step": None})
    assert f"could not read the checkpoints in {checkpoints}" in str(raised.value)
    assert "step-000000020/manifest.json" in str(raised.value)
    assert not [w for w in said if "skipping" in str(w.message)]
    outage.end()
    assert _steps(s3, checkpoints) == [f"{checkpoints}/step-0000000{s}" for s in (10, 20)]
    assert checkpointer.load_latest({"step": None}).step == 20  # the store is back


def test_a_save_never_deletes_a_newer_checkpoint_not_found_damaged(s3):
    checkpoints = _url(s3, "newer") + "/checkpoints"
    for step in (10, 20):
        Checkpointer(checkpoints, storage_options=s3.storage_options).save(step, {"step": step})
    fresh = Checkpointer(checkpoints, storage_options=s3.storage_options)
    with pytest.raises(ValueError, match=r"cannot save step 5 .*'step-000000010', 'step-0000000"):
        fresh.save(5, {"step": 5})  # a run that never read them: they may be good
    assert [p.rpartition("/")[2] for p in _steps(s3, checkpoints)] == [
        "step-000000010",
        "step-000000020",
    ]


def test_a_trainer_whose_store_goes_down_after_the_listing_fails_and_keeps_both(
    s3, refused, monkeypatch, tmp_path
):
    from trainer_job import run

    url = _url(s3, "resume")
    options = {"storage_options": s3.storage_options, "lease_seconds": 2.0, "epochs": 1}
    run(url, **options)  # checkpoints at the run's end and at its last periodic save
    before = _steps(s3, f"{url}/checkpoints")
    assert len(before) == 2
    outage = Outage(monkeypatch, refused)
    real = Checkpointer.load_latest

    def back_after_the_read(self, state):  # the store answers again right after the read
        try:
            return real(self, state)
        finally:
            outage.end()

    monkeypatch.setattr(Checkpointer, "load_latest", back_after_the_read)
    with pytest.raises(RemoteUnavailable, match=f"could not read the checkpoints in {url}"):
        run(url, **{**options, "epochs": 2})  # never a fresh start
    assert _steps(s3, f"{url}/checkpoints") == before


def test_verify_says_the_store_could_not_be_read_not_corrupt(s3, refused, monkeypatch, capsys):
    checkpoints = _url(s3, "verify") + "/checkpoints"
    Checkpointer(checkpoints, storage_options=s3.storage_options).save(1, {"step": 1})
    Outage(monkeypatch, refused)
    options = json.dumps(s3.storage_options)
    assert unbroken.cli.main(["verify", checkpoints, "--storage-options", options]) == 2
    out, err = capsys.readouterr()
    assert "could not download" in err and "step-000000001/manifest.json" in err, err
    assert "CORRUPT" not in out + err


CHILD = textwrap.dedent(
    """
    import os, sys, time
    from unbroken.checkpoint import FsspecStorage

    url, endpoint, marker, go = sys.argv[1:5]
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "default_block_size": 5 << 20}  # 5 MiB parts: S3's smallest
    storage = FsspecStorage(url, options, retries=0, cache=False)

    def fill(out):
        out.write(os.urandom(6 << 20))  # the multipart upload begins, its first part goes
        open(marker, "w").close()
        while not os.path.exists(go):  # the test takes the store away, or the upload
            time.sleep(0.02)
        out.write(os.urandom(6 << 20))  # the next part fails, and so does the abort

    storage.write(url + "/big.pt", fill)
    """
)


@pytest.mark.parametrize("how", ["store gone", "upload aborted by another writer"])
def test_a_failed_upload_whose_abort_fails_too_lets_the_process_exit(tmp_path, how):
    from unbroken.testing import S3Server

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    marker, go = tmp_path / "marker", tmp_path / "go"
    with S3Server() as server:
        url = server.make_bucket("exits") + "/run"
        child = subprocess.Popen(
            [sys.executable, str(script), url, server.endpoint, str(marker), str(go)],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            while not marker.exists():
                assert child.poll() is None, child.communicate()[1]
                time.sleep(0.02)
            if how == "store gone":
                server.stop()
            else:  # another job's clean-up aborts every multipart upload of the bucket
                storage = FsspecStorage(url, server.storage_options, cache=False)
                storage.abort_uploads(url)
            go.touch()
            began = time.monotonic()
            try:
                _, err = child.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{how}: the process did not exit 60 s after its upload failed")
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert child.returncode == 1 and time.monotonic() - began < 60
    assert f"could not upload {url}/big.pt" in err, err


# Past the first read of the manifest, on a local disk that stops answering as a store does
# after its retries (``RemoteUnavailable``) at one read of one file: the manifest read again
# (``classify``, after a file of the wrong size), a file hashed, or an entry's file loaded.
class Unanswered(LocalStorage):
    """A local disk on which the ``nth`` opening of the file at ``path`` is not answered."""

    def __init__(self, path: str, nth: int) -> None:
        self.path, self.nth, self.opened = path, nth, 0

    def open_read(self, path: str):
        if path == self.path:
            self.opened += 1
            if self.opened == self.nth:
                raise RemoteUnavailable(f"could not download {path}: the store did not answer")
        return super().open_read(path)


def _two_checkpoints(tmp_path) -> tuple[str, str]:
    """Checkpoints of steps 1 and 2; the root and the newest's path."""
    root = str(tmp_path / "checkpoints")
    with Checkpointer(root) as checkpointer:
        checkpointer.save(1, {"model": torch.nn.Linear(3, 2), "epoch": 1})
        newest = str(checkpointer.save(2, {"model": torch.nn.Linear(3, 2), "epoch": 2}))
    return root, newest


@pytest.mark.parametrize("nth, when", [(1, "hashed"), (2, "loaded")])
def test_an_outage_while_an_entry_is_hashed_or_loaded_is_no_damaged_checkpoint(tmp_path, nth, when):
    root, newest = _two_checkpoints(tmp_path)
    model = f"{newest}/000-model.pt"
    checkpointer = Checkpointer(root, storage=Unanswered(model, nth))
    with warnings.catch_warnings(record=True) as said, pytest.raises(RemoteUnavailable) as raised:
        warnings.simplefilter("always")
        checkpointer.load_latest({"model": torch.nn.Linear(3, 2), "epoch": None})
    assert model in str(raised.value), when  # never step 1 instead, as if step 2 were damaged
    assert not [w for w in said if "skipping" in str(w.message)]
    # What `unbroken verify` does: every file hashed, then every entry loaded.
    with pytest.raises(RemoteUnavailable):
        verdict.classify(Unanswered(model, nth), newest, 2)
    assert Checkpointer(root).load_latest({"epoch": None}).step == 2  # it answers again: whole


def test_an_outage_while_a_manifest_is_read_again_is_no_damaged_checkpoint(tmp_path):
    # A file of the wrong size: the checkpoint is corrupt, and classify reads its manifest
    # again for what the rest says. That read meets the outage: no verdict, not "damaged".
    root, newest = _two_checkpoints(tmp_path)
    with open(f"{newest}/001-epoch.pt", "ab") as file:
        file.write(b"\0")
    manifest = f"{newest}/manifest.json"
    assert verdict.classify(Unanswered(manifest, 3), newest, 2).status == "corrupt"
    with pytest.raises(RemoteUnavailable, match="manifest.json"):
        verdict.classify(Unanswered(manifest, 2), newest, 2)
