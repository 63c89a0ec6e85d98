"""The Trainer and its run directory's lease in object storage (the moto S3 server), with real
processes and signals: a job frozen (SIGSTOP) past its lease and resumed (SIGCONT) after
another took the run over changes nothing of the new job's, and a job SIGKILLed and restarted at
once waits no longer for its lease on S3 than for its lock on a local disk."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from locations import SUPPORT

import unbroken
from unbroken.checkpoint import FsspecStorage

JOB = SUPPORT / "trainer_job.py"
CONFIG = {"workers": 0, "checkpoint_every_steps": 2, "pace": 0.05}


def _start(disk: Path, config: dict, name: str = "out") -> subprocess.Popen:
    """``trainer_job.py`` on a "machine" of its own (an empty disk and temporary directory),
    its output in ``disk/<name>``."""
    disk.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": tempfile.mkdtemp(prefix="ub-")}  # short: torch's sockets
    env["XDG_CACHE_HOME"] = os.path.join(env["TMPDIR"], "cache")
    with open(disk / name, "wb") as out:
        return subprocess.Popen(
            [sys.executable, str(JOB), str(disk), json.dumps(config)],
            cwd=disk,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _batches(disk: Path) -> int:
    """How many batches the process on ``disk`` ran (trainer_job's Pace writes it)."""
    try:
        return int((disk / "status").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _wait_for(process: subprocess.Popen, done, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert process.poll() is None, f"the job ended before {what} ({process.returncode})"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.002)


def _objects(storage: FsspecStorage, url: str) -> dict[str, str]:
    """Every object under ``url`` but the lease's, with its ETag."""
    storage.fs.invalidate_cache()
    found = storage.fs.find(url, detail=True)
    return {p: info["ETag"] for p, info in found.items() if "/.lock" not in p}


def test_a_trainer_frozen_past_its_lease_and_resumed_changes_nothing_of_the_job_after_it(
    s3, tmp_path
):
    url = s3.make_bucket(f"frozen-{secrets.token_hex(4)}") + "/runs/exp1"
    lease = 2.0
    config = {**CONFIG, "epochs": 2, "url": url, "storage_options": s3.storage_options}
    config["lease_seconds"] = lease
    storage = FsspecStorage(url, s3.storage_options)
    first = _start(tmp_path / "first", config)
    try:
        # Frozen in a batch's pause, after its first checkpoint (batch 4), before its second.
        _wait_for(first, lambda: _batches(tmp_path / "first") >= 5, "5 batches")
        first.send_signal(signal.SIGSTOP)
        time.sleep(lease)
        second = _start(tmp_path / "second", config)
        assert second.wait(timeout=300) == 0, (tmp_path / "second" / "out").read_text()
        left = _objects(storage, url)
        assert any(p.endswith("/manifest.json") for p in left) and f"{url[5:]}/metrics.csv" in left
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=120) != 0
        said = (tmp_path / "first" / "out").read_text()
        assert "DirectoryInUse" in said and "is no longer this job's" in said, said[-3000:]
        assert f"pid {second.pid} on" in said, said[-3000:]  # the job that holds it, named
        assert _objects(storage, url) == left  # nothing deleted, written or replaced
        saved = unbroken.Checkpointer(f"{url}/checkpoints", storage=storage).load_latest(
            {"progress": None}
        )
        assert saved.values["progress"]["epoch"] == 2  # the second job's end, whole
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()


def _restart_cost(directory: str, disk: Path, config: dict) -> tuple[float, float, str]:
    """A job on ``directory`` SIGKILLed after 6 batches and restarted at once: the restart's
    seconds from its spawn to its first step, those it spent on its run directory and lock (its
    own account of its way to the first step), and what it said."""
    config = {**CONFIG, "epochs": 3, **config}
    first = _start(disk, config, "first")
    _wait_for(first, lambda: _batches(disk) >= 6, "6 batches")
    first.kill()
    first.wait()
    (disk / "status").unlink()
    spawned = time.monotonic()
    restart = _start(disk, config, "restart")
    try:
        _wait_for(restart, lambda: "first step after" in (disk / "restart").read_text(), "step")
        took = time.monotonic() - spawned
    finally:
        restart.kill()
        restart.wait()
    said = (disk / "restart").read_text()
    found = re.search(r"run directory and its lock ([0-9.]+) s", said)
    assert found, said
    return took, float(found.group(1)), said


def test_a_trainer_on_s3_restarted_at_once_after_a_sigkill_does_not_wait_out_its_lease(
    s3, tmp_path
):
    # What a restart would wait if it did not know its predecessor dead: longer than a
    # restart's imports (else that lease would have lapsed by the store's clock anyway).
    lease = 15.0
    local = _restart_cost(str(tmp_path / "run"), tmp_path / "run", {})
    url = s3.make_bucket(f"restart-{secrets.token_hex(4)}") + "/runs/exp1"
    options = {"url": url, "storage_options": s3.storage_options, "lease_seconds": lease}
    remote = _restart_cost(url, tmp_path / "s3", options)
    costs = f"spawn to first step, lock: local {local[:2]}, S3 {remote[:2]}"
    # The run directory and its lock cost an S3 client's import and first request more, not
    # the lease's wait.
    assert remote[1] - local[1] < lease, costs
    taken = re.search(
        r"took the lease on \S+ over from pid (\d+) .*gone.* after ([0-9.]+) s", remote[2]
    )
    assert taken, remote[2]
    assert float(taken.group(2)) < 2.0, costs  # its predecessor is known dead: not waited for
