"""A Trainer whose run directory is in object storage (the moto S3 server): a job SIGKILLed at
random moments, inside uploads too, and restarted each time on a new "machine" (an empty working
directory and temporary directory, nothing local carried over) ends with the weights and the
metrics.csv of a run that was never interrupted. One job per URL: a second is refused."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from locations import SUPPORT
from trainer_job import kill_seed

import unbroken
from unbroken.checkpoint import FsspecStorage
from unbroken.errors import DirectoryInUse
from unbroken.testing import assert_same

JOB = SUPPORT / "trainer_job.py"
LEASE = 1.5  # seconds a killed job's lock lasts: each restart waits about this long


def _machine(tmp_path: Path, name: str) -> tuple[Path, dict]:
    """A new, empty "machine": its disk and the environment of a process started on it (its
    TMPDIR short: torch's workers put sockets there, whose paths must fit in 108 bytes)."""
    disk = tmp_path / name
    disk.mkdir()
    (disk / "tmp").symlink_to(tempfile.mkdtemp(prefix="ub-"))
    tmp = os.readlink(disk / "tmp")
    return disk, {**os.environ, "TMPDIR": tmp, "XDG_CACHE_HOME": os.path.join(tmp, "cache")}


@pytest.fixture(autouse=True)
def _machines(tmp_path):
    yield
    for link in tmp_path.glob("*/tmp"):
        shutil.rmtree(os.readlink(link), ignore_errors=True)


def _start(disk: Path, env: dict, config: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB), str(disk), config], cwd=disk, env=env)


def _uploading(storage: FsspecStorage, checkpoints: str) -> bool:
    """Whether a checkpoint is being written: a step-* prefix without its manifest yet."""
    try:
        names = [e.name for e in storage.list_directory(checkpoints) if e.name.startswith("step-")]
        return any(not storage.exists(f"{checkpoints}/{n}/manifest.json") for n in names)
    except Exception:
        return False


def _step(model, batch):
    return model(batch[0]).sum()


JOB_CONFIG = {"workers": 2, "epochs": 4, "checkpoint_every_steps": 2, "pace": 0.02}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, on a local disk."""
    done = tmp_path_factory.mktemp("reference")
    subprocess.run([sys.executable, str(JOB), str(done), json.dumps(JOB_CONFIG)], check=True)
    return done


def _same_as(reference: Path, disk: Path, storage: FsspecStorage, url: str) -> None:
    got = torch.load(disk / "final.pt", weights_only=True)
    want = torch.load(reference / "final.pt", weights_only=True)
    assert_same(dict(got), dict(want), "final weights")
    log = storage.fs.cat_file(f"{url}/metrics.csv")
    assert log == (reference / "metrics.csv").read_bytes()


def test_sigkill_with_the_run_directory_in_s3_and_every_restart_on_an_empty_disk(
    s3, tmp_path, reference
):
    url = s3.make_bucket(f"spot-{secrets.token_hex(4)}") + "/runs/exp1"
    job = JOB_CONFIG
    config = json.dumps(
        {**job, "url": url, "storage_options": s3.storage_options, "lease_seconds": LEASE}
    )
    storage = FsspecStorage(url, s3.storage_options)
    seed = kill_seed()
    rng = random.Random(seed)
    kills = in_uploads = 0
    for restart in range(40):
        disk, env = _machine(tmp_path, f"machine-{restart}")
        process = _start(disk, env, config)
        aim_at_upload, batches = kills % 3 == 0, rng.randint(1, 8)
        while process.poll() is None and kills < 10:
            status = disk / "status"
            ran = int(status.read_text() or 0) if status.exists() else 0
            uploading = aim_at_upload and ran > 0 and _uploading(storage, f"{url}/checkpoints")
            if uploading or (not aim_at_upload and ran >= batches) or ran >= 12:
                process.send_signal(signal.SIGKILL)
                kills += 1
                in_uploads += uploading
                break
            time.sleep(0.002)
        if process.wait() == 0:
            break
        assert process.returncode == -signal.SIGKILL, (process.returncode, seed)
    assert process.returncode == 0, f"the run did not finish (UNBROKEN_KILL_SEED={seed})"
    assert kills == 10 and in_uploads >= 2, (kills, in_uploads, f"UNBROKEN_KILL_SEED={seed}")
    _same_as(reference, disk, storage, url)
    # The run's history came back from the store on every new machine: 10 processes killed,
    # then the one that finished (checkpoint_every_seconds="auto" counts these failures).
    history = json.loads(storage.fs.cat_file(f"{url}/history.json"))["sessions"]
    assert [s["end"] for s in history] == [None] * 10 + ["finished"], history
    # The log's local working copy is gone with the run that finished.
    assert not [p.name for p in (disk / "tmp").iterdir() if p.name.startswith("unbroken-run-")]


def test_a_second_job_on_one_url_is_refused_naming_the_first(s3, tmp_path):
    url = s3.make_bucket(f"twice-{secrets.token_hex(4)}") + "/runs/exp1"
    config = {"epochs": 50, "pace": 0.05, "url": url, "storage_options": s3.storage_options}
    disk, env = _machine(tmp_path, "first")
    first = _start(disk, env, json.dumps({**config, "lease_seconds": LEASE}))
    try:
        while not (disk / "status").exists():
            assert first.poll() is None, "the first job ended early"
            time.sleep(0.05)
        trainer = unbroken.Trainer(
            url, storage_options=s3.storage_options, max_epochs=1, lease_seconds=LEASE
        )
        model = torch.nn.Linear(8, 3)
        loader = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 8)), seed=0)
        started = time.monotonic()
        with pytest.raises(
            DirectoryInUse, match=rf"in use by another training job \(pid {first.pid} on "
        ):
            trainer.fit(
                model, torch.optim.SGD(model.parameters(), lr=0.1), loader, training_step=_step
            )
        assert time.monotonic() - started < 3 * LEASE + 5
    finally:
        first.kill()
        first.wait()


def test_a_run_url_whose_bucket_does_not_exist_fails_before_training(s3, tmp_path):
    trainer = unbroken.Trainer(
        "s3://no-such-bucket/run", storage_options=s3.storage_options, max_epochs=1
    )
    model = torch.nn.Linear(8, 3)
    loader = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 8)), seed=0)
    with pytest.raises(FileNotFoundError, match="the bucket 'no-such-bucket' does not exist"):
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, training_step=_step)
    with pytest.raises(ValueError, match="storage_options are for a run directory at a URL"):
        unbroken.Trainer(tmp_path / "run", storage_options=s3.storage_options, max_epochs=1)


class Outage:
    """Stops the S3 server after one training batch and starts it again (empty, on the same
    endpoint) after another: the saves between cannot reach it. The run's lease is put back as
    it was (a store that comes back keeps its objects; a job whose lease is gone must stop)."""

    def __init__(self, server, stop_at: int, back_at: int, bucket: str) -> None:
        self.server, self.stop_at, self.back_at, self.bucket = server, stop_at, back_at, bucket

    def on_train_batch_end(self, trainer, logs) -> None:
        fs = trainer.run.storage.fs
        if trainer.progress.ticks == self.stop_at:
            self.port = self.server.port
            self.lease = {p: fs.cat_file(p) for p in fs.glob(f"{trainer.run.location}/.lock.*")}
            self.server.stop()
        elif trainer.progress.ticks == self.back_at:
            with trainer.run.lease._lock:  # no renewal looks before the lease is back
                self.server.port = self.port
                self.server.start()
                self.server.make_bucket(self.bucket)
                for path, body in self.lease.items():
                    fs.pipe_file(path, body)


def test_training_goes_on_through_an_outage_of_the_store_and_the_next_save_goes_through(
    tmp_path, capfd
):
    from trainer_job import run

    from unbroken.testing import S3Server

    reference = run(tmp_path / "reference", epochs=2)
    with S3Server() as server:
        url = server.make_bucket("outage") + "/runs/exp1"
        outage = Outage(server, stop_at=5, back_at=9, bucket="outage")
        model = run(
            url,
            epochs=2,
            callbacks=[outage],
            storage_options=server.storage_options,
            lease_seconds=LEASE,
        )
        said = capfd.readouterr().err
        assert "checkpoint at epoch 0, train batch 8, optimizer step 4 failed (could not" in said
        assert "training goes on" in said
        assert_same(model.state_dict(), reference.state_dict(), "weights")
        storage = FsspecStorage(url, server.storage_options)
        restored = unbroken.Checkpointer(f"{url}/checkpoints", storage=storage).load_latest(
            {"progress": None}
        )
        assert restored.values["progress"]["epoch"] == 2  # the final save reached the store
        log = storage.fs.cat_file(f"{url}/metrics.csv")
        assert log == (tmp_path / "reference" / "metrics.csv").read_bytes()
        if importlib.util.find_spec("tensorboard") is not None:  # its events are uploaded too
            assert [p for p in storage.fs.find(f"{url}/tensorboard") if "tfevents" in p]


def test_a_preemption_uploads_its_checkpoint_before_exit_75_and_a_new_machine_goes_on(
    s3, tmp_path, reference
):
    url = s3.make_bucket(f"preempted-{secrets.token_hex(4)}") + "/runs/exp1"
    config = json.dumps(
        {**JOB_CONFIG, "url": url, "storage_options": s3.storage_options, "lease_seconds": LEASE}
    )
    disk, env = _machine(tmp_path, "preempted")
    process = subprocess.Popen(
        [sys.executable, str(JOB), str(disk), config], cwd=disk, env=env, start_new_session=True
    )
    while not (disk / "status").exists() or int((disk / "status").read_text() or 0) < 7:
        assert process.poll() is None
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGTERM)  # as a scheduler does: the whole process group
    assert process.wait(timeout=120) == 75
    storage = FsspecStorage(url, s3.storage_options)
    saved = unbroken.Checkpointer(f"{url}/checkpoints", storage=storage).load_latest(
        {"progress": None}
    )
    ran = int((disk / "status").read_text())
    assert saved.values["progress"]["ticks"] in (ran, ran + 1)  # at the batch the signal hit
    disk, env = _machine(tmp_path, "next")
    subprocess.run([sys.executable, str(JOB), str(disk), config], cwd=disk, env=env, check=True)
    _same_as(reference, disk, storage, url)
    history = json.loads(storage.fs.cat_file(f"{url}/history.json"))["sessions"]
    assert [s["end"] for s in history] == ["preempted", "finished"], history
