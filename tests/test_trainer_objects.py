"""A Trainer whose run directory is in object storage (the moto S3 server): a job SIGKILLed at
random moments, inside uploads too, and restarted each time on a new "machine" (an empty working
directory and temporary directory, nothing local carried over) ends with the weights and the
metrics.csv of a run that was never interrupted. One job per URL: a second is refused."""

from __future__ import annotations

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
from trainer_job import kill_seed

import unbroken
from unbroken.checkpoint import ObjectStorage
from unbroken.errors import DirectoryInUse
from unbroken.testing import assert_same

JOB = Path(__file__).with_name("trainer_job.py")
LEASE = 1.5  # seconds a killed job's lock lasts: each restart waits about this long


def _machine(tmp_path: Path, name: str) -> tuple[Path, dict]:
    """A new, empty "machine": its disk and the environment of a process started on it (its
    TMPDIR short: torch's workers put sockets there, whose paths must fit in 108 bytes)."""
    disk = tmp_path / name
    disk.mkdir()
    (disk / "tmp").symlink_to(tempfile.mkdtemp(prefix="ub-"))
    return disk, {**os.environ, "TMPDIR": os.readlink(disk / "tmp")}


@pytest.fixture(autouse=True)
def _machines(tmp_path):
    yield
    for link in tmp_path.glob("*/tmp"):
        shutil.rmtree(os.readlink(link), ignore_errors=True)


def _start(disk: Path, env: dict, config: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB), str(disk), config], cwd=disk, env=env)


def _uploading(storage: ObjectStorage, checkpoints: str) -> bool:
    """Whether a checkpoint is being written: a step-* prefix without its manifest yet."""
    try:
        names = [e.name for e in storage.list_directory(checkpoints) if e.name.startswith("step-")]
        return any(not storage.exists(f"{checkpoints}/{n}/manifest.json") for n in names)
    except Exception:
        return False


def _step(model, batch):
    return model(batch[0]).sum()


def test_sigkill_with_the_run_directory_in_s3_and_every_restart_on_an_empty_disk(s3, tmp_path):
    url = s3.make_bucket(f"spot-{secrets.token_hex(4)}") + "/runs/exp1"
    job = {"workers": 2, "epochs": 4, "checkpoint_every_steps": 2, "pace": 0.02}
    reference = tmp_path / "reference"
    subprocess.run([sys.executable, str(JOB), str(reference), json.dumps(job)], check=True)
    config = json.dumps(
        {**job, "url": url, "storage_options": s3.storage_options, "lease_seconds": LEASE}
    )
    storage = ObjectStorage(url, s3.storage_options)
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
    got = torch.load(disk / "final.pt", weights_only=True)
    want = torch.load(reference / "final.pt", weights_only=True)
    assert_same(dict(got), dict(want), "final weights")
    log = storage.fs.cat_file(f"{url}/metrics.csv")
    assert log == (reference / "metrics.csv").read_bytes()
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
