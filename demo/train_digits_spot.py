"""The spot-instance job: the run directory in object storage, every restart on a new machine.

`make demo-spot` runs this file. The driver starts one S3 protocol server (moto, on 127.0.0.1)
and trains the main demo's job (`train_digits.py`: a convnet on scikit-learn's digits, 2 loader
workers, augmentation, dropout, accumulation, a OneCycle schedule) with its run directory at
`s3://spot/runs/digits`. A preempted spot instance takes its disk with it, so every restart is a
new "machine": a new, empty working directory and temporary directory; the checkpoints,
metrics.csv and the lock live in the bucket only.

The process is SIGKILLed 4 times (once while a checkpoint is being uploaded) and preempted once
the way clouds do it: SIGTERM to its process group, then SIGKILL if it is still there after a
grace period (`GRACE`, seconds). Each process reports the bytes it uploaded and downloaded.
Then the same job runs uninterrupted on a local disk, and the driver prints the verdict: final
weights and metrics.csv identical bit for bit, or the first difference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train_digits import compare_runs, train  # the main demo's (demo/ is on sys.path)

from unbroken.checkpoint import FsspecStorage

OUTPUT = Path(__file__).resolve().parent.parent / "demo_output" / "spot"
URL = "s3://spot/runs/digits"
GRACE = 10.0  # seconds between SIGTERM and SIGKILL (AWS spot gives 120, GCP 30)
# How long a killed process's lock on the run directory lasts (the Trainer's default is 30 s): a
# machine restarted at once waits for it; one restarted minutes later, as clouds do, does not.
LEASE = 5.0
TARGETS = ["random", "uploading", "random", "preempt", "random"]  # 4 SIGKILLs, 1 preemption


class Traffic:
    """Writes what this process moved to and from the store, for the driver to print."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _write(self, trainer) -> None:
        storage = trainer.run.storage
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{storage.sent} {storage.received}")
        os.replace(tmp, self.path)  # whole when the driver reads it, even after a SIGKILL

    def on_train_batch_end(self, trainer, logs) -> None:
        self._write(trainer)

    on_validation_batch_end = on_train_batch_end

    def on_fit_end(self, trainer) -> None:
        self._write(trainer)


def main(seed: int | None) -> int:
    from unbroken.testing import S3Server

    shutil.rmtree(OUTPUT, ignore_errors=True)
    OUTPUT.mkdir(parents=True)
    rng = random.Random(seed)
    started = time.perf_counter()
    with S3Server() as s3:
        s3.make_bucket("spot")
        options = json.dumps(s3.storage_options)
        print(
            f"unbroken spot demo: run directory {URL} on a local S3 server; every restart on a "
            f"new machine (empty disk); 4 SIGKILLs (one mid-upload) and one SIGTERM with a "
            f"{GRACE:.0f} s grace period; a restart after a SIGKILL first waits out the dead "
            f"process's {LEASE:.0f} s lease on the run directory"
        )
        machines, batch = [], 0
        for attempt in range(20):
            machine = Path(tempfile.mkdtemp(prefix=f"machine-{attempt}-", dir=OUTPUT))
            machines.append(machine)
            (machine / "tmp").mkdir()
            # Its own disk: temporary files, and the cache of checkpoint copies (none yet).
            env = {
                **os.environ,
                "TMPDIR": str(machine / "tmp"),
                "XDG_CACHE_HOME": str(machine / "cache"),
            }
            command = [sys.executable, __file__, "--train", str(machine), options]
            process = subprocess.Popen(command, cwd=machine, env=env, start_new_session=True)
            target = TARGETS[attempt] if attempt < len(TARGETS) else None
            what = _interrupt(process, machine, target, batch + rng.randint(5, 30), s3)
            sent, received = _traffic(machine)
            where = _status(machine)
            batch = int(where[1]) if where else batch
            moved = f"uploaded {_mb(sent)}, downloaded {_mb(received)}"
            if what is None:
                if process.returncode != 0:
                    print(f"training process failed with exit code {process.returncode}")
                    return 1
                print(f"  machine {attempt}: finished the run; {moved}")
                break
            print(f"  machine {attempt}: {what} at training batch {batch}; {moved}")
        final = machines[-1]
        storage = FsspecStorage(URL, s3.storage_options)
        (final / "metrics.csv").write_bytes(storage.fs.cat_file(f"{URL}/metrics.csv"))
    reference = OUTPUT / "uninterrupted"
    reference.mkdir()
    subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("train_digits.py")),
            "--train",
            str(reference),
        ],
        check=True,
    )
    print(f"  uninterrupted run on a local disk finished ({time.perf_counter() - started:.0f} s)")
    verdict, text = compare_runs(final, reference)
    print(text)
    return verdict


def _interrupt(
    process: subprocess.Popen, machine: Path, target: str | None, earliest: int, s3
) -> str | None:
    """Interrupt ``process`` as ``target`` says from training batch ``earliest`` on: what was
    done, or None if it was left to finish."""
    if target is None:
        process.wait()
        return None
    storage = FsspecStorage(URL, s3.storage_options)
    while process.poll() is None:
        where = _status(machine)
        batch = int(where[1]) if where else 0
        if batch >= earliest and target == "uploading" and _uploading(storage):
            process.send_signal(signal.SIGKILL)
            process.wait()
            return "SIGKILL while a checkpoint was being uploaded"
        if batch >= earliest and target == "random":
            process.send_signal(signal.SIGKILL)
            process.wait()
            return "SIGKILL"
        if batch >= earliest and target == "preempt":
            sent = time.perf_counter()
            os.killpg(process.pid, signal.SIGTERM)  # the whole group, as a cloud agent does
            try:
                code = process.wait(timeout=GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return f"SIGTERM, then SIGKILL after the {GRACE:.0f} s grace period"
            seconds = time.perf_counter() - sent
            return f"SIGTERM: checkpoint uploaded, exit {code} after {seconds:.1f} s"
        time.sleep(0.001)
    return None


def _uploading(storage: FsspecStorage) -> bool:
    """Whether a checkpoint is being uploaded: a step-* prefix without its manifest yet."""
    root = f"{URL}/checkpoints"
    try:
        names = [e.name for e in storage.list_directory(root) if e.name.startswith("step-")]
        return any(not storage.exists(f"{root}/{name}/manifest.json") for name in names)
    except OSError:
        return False


def _status(machine: Path) -> list[str] | None:
    try:
        return (machine / "status").read_text().split()
    except (FileNotFoundError, ValueError):
        return None


def _traffic(machine: Path) -> tuple[int, int]:
    try:
        sent, received = (machine / "traffic").read_text().split()
        return int(sent), int(received)
    except (FileNotFoundError, ValueError):
        return 0, 0


def _mb(size: int) -> str:
    return f"{size / 1e6:.2f} MB"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", nargs=2, metavar=("MACHINE", "STORAGE_OPTIONS"))
    parser.add_argument("--seed", type=int, help="the kill moments' seed (default: random)")
    args = parser.parse_args()
    if args.train:
        machine = Path(args.train[0])
        options = json.loads(args.train[1])
        train(URL, machine, options, (Traffic(machine / "traffic"),), lease_seconds=LEASE)
        sys.exit(0)
    sys.exit(main(args.seed))
