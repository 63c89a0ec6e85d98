"""The streaming job: train on digits streamed from an S3 server, SIGKILL it, compare.

`make demo-stream` runs this file. The driver starts one S3 protocol server (moto, on
127.0.0.1) for the whole demo and writes scikit-learn's digits to it as Parquet shards with
`unbroken.streaming.write_shards`: the 1500 training images in 17 shards of 4 row groups, the
297 validation images in 4 more. The training process (`--train DIR ...`) is an
unbroken.Trainer run that reads them through `StreamingDataset`: the shards are downloaded
into a local cache as the loader's exact future order needs them, shuffled by shard windows,
with random augmentation per sample (torch, numpy and `random` draws), 2 loader workers,
dropout, SGD with momentum, a OneCycle LR schedule and a checkpoint every 5 optimizer steps.

The driver trains once uninterrupted (the reference, with a cache of its own), then starts the
same command in another directory and SIGKILLs its whole process group (the loader workers
too) at 4 random training batches, restarting it each time until training completes; the
cache is emptied before the second restart, so that run must fetch its shards from the
server again. It prints, per process, where it resumed and how many bytes it downloaded
before its first batch and in all, the cache contents at the end, and the verdict: final
weights and metrics.csv identical bit for bit, or the first difference.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from train_digits import ConvNet, compare_runs  # the main demo's (demo/ is on sys.path)

import unbroken

OUTPUT = Path(__file__).resolve().parent.parent / "demo_output" / "stream"
EPOCHS, BATCH, SEED = 4, 32, 7
KILLS, EMPTY_CACHE_BEFORE = 4, 2  # restart 2 (after the second kill) starts with an empty cache
TRAIN = 1500  # of the 1797 digits; the rest is the validation set
PER_EPOCH = -(-TRAIN // BATCH)  # 47 training batches per epoch
BUCKET = "digits"
SHARD_BYTES, ROW_GROUP_BYTES = 24 << 10, 6 << 10  # small, so the little dataset has 17 shards


def train_sample(row: dict):
    """A row as (image, label), randomly augmented. Applied with StreamingDataset.map, which
    keeps the dataset's window shuffle and prefetch and lets the loader seed every sample on
    its own: the same draws after a resume."""
    image, label = val_sample(row)
    dy, dx = torch.randint(-1, 2, (2,)).tolist()  # shift by up to a pixel (torch RNG)
    image = torch.roll(image, shifts=(dy, dx), dims=(1, 2))
    image = image * random.uniform(0.8, 1.2)  # contrast (random)
    image = image + torch.from_numpy(np.random.normal(0, 0.05, image.shape)).float()
    return image, label


def val_sample(row: dict):
    image = torch.frombuffer(bytearray(row["image"]), dtype=torch.float32).view(1, 8, 8)
    return image, row["label"]


class Status:
    """Tells the driver where the run is (epoch batch and training batch), to aim its kills."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, logs) -> None:
        progress, tmp = trainer.progress, self.path.with_suffix(".tmp")
        tmp.write_text(f"{progress.batches} {progress.epoch} {progress.epoch_batches}")
        os.replace(tmp, self.path)


def cached(cache: Path) -> dict[str, int]:
    """The complete shards in a cache directory: name -> bytes."""
    return {p.name: p.stat().st_size for p in cache.glob("*.parquet")}


def train(directory: Path, endpoint: str, cache: Path) -> None:
    """One training process: resumes from the newest checkpoint in `directory` if any."""
    from torchmetrics.classification import MulticlassAccuracy

    from unbroken.streaming import StreamingDataset

    torch.set_num_threads(1)
    before = cached(cache) if cache.exists() else {}
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    streams = [
        StreamingDataset(
            f"s3://{BUCKET}/{split}",
            cache_dir=str(cache),
            storage_options=options,
            window_shards=2,
            prefetch_bytes=64 << 10,  # download at most ~4 shards ahead of the reader
        )
        for split in ("train", "val")
    ]
    torch.manual_seed(SEED)  # model init; a resumed run takes the weights from its checkpoint
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_loader = unbroken.DataLoader(
        streams[0].map(train_sample),
        batch_size=BATCH,
        shuffle=True,  # the StreamingDataset's shuffle: shards and rows within 2-shard windows
        num_workers=2,
        persistent_workers=True,
        seed=SEED,
    )
    val_loader = unbroken.DataLoader(streams[1].map(val_sample), batch_size=100, seed=SEED)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.1, total_steps=EPOCHS * len(train_loader)
    )
    train_acc, val_acc = MulticlassAccuracy(10), MulticlassAccuracy(10)
    trainer: unbroken.Trainer | None = None
    first = True

    def report_first_batch() -> None:
        # Printed (and flushed) as soon as the first batch arrives: the process may be
        # SIGKILLed at any moment after it. Shards new in the cache since this process
        # started: the downloads of all its processes (the prefetcher's threads and the loader
        # workers); `cache.downloaded_bytes` counts this process's own (the prefetcher's).
        nonlocal first
        if first:
            first = False
            assert trainer is not None
            new = {n: b for n, b in cached(cache).items() if n not in before}
            mine = sum(s.cache.downloaded_bytes for s in streams)
            print(
                f"first-batch downloaded={sum(new.values())} shards={len(new)} "
                f"by-main-process={mine} at={trainer.progress.where().replace(' ', '_')}",
                flush=True,
            )

    def training_step(model, batch):
        report_first_batch()
        images, labels = batch
        logits = model(images)
        train_acc.update(logits, labels)
        return nn.functional.cross_entropy(logits, labels)

    def validation_step(model, batch):
        report_first_batch()
        images, labels = batch
        logits = model(images)
        val_acc.update(logits, labels)
        return nn.functional.cross_entropy(logits, labels)

    trainer = unbroken.Trainer(
        directory,
        max_epochs=EPOCHS,
        seed=SEED,
        checkpoint_every_steps=5,
        callbacks=[Status(directory / "status")],
        progress_bar=False,
        tensorboard=False,
    )
    trainer.fit(
        model,
        optimizer,
        train_loader,
        val_loader,
        scheduler=scheduler,
        training_step=training_step,
        validation_step=validation_step,
        train_metrics={"accuracy": train_acc},
        val_metrics={"accuracy": val_acc},
    )
    torch.save(model.state_dict(), directory / "final_weights.pt")
    new = {n: b for n, b in cached(cache).items() if n not in before}
    print(f"finished downloaded={sum(new.values())} shards={len(new)}", flush=True)


def write_dataset(s3) -> tuple[dict, dict]:
    """scikit-learn's digits (no download) as sharded Parquet datasets on the S3 server."""
    from sklearn.datasets import load_digits

    from unbroken.streaming import write_shards

    digits = load_digits()
    images = (torch.tensor(digits.images, dtype=torch.float32) / 16.0).numpy()
    rows = [
        {"image": images[i].tobytes(), "label": int(digits.target[i])} for i in range(len(images))
    ]
    s3.make_bucket(BUCKET)
    common = {
        "shard_bytes": SHARD_BYTES,
        "row_group_bytes": ROW_GROUP_BYTES,
        "storage_options": s3.storage_options,
    }
    train = write_shards(rows[:TRAIN], f"s3://{BUCKET}/train", **common)
    val = write_shards(rows[TRAIN:], f"s3://{BUCKET}/val", **common)
    return train, val


def main(kill_seed: int | None) -> int:
    from unbroken.testing import S3Server

    started = time.perf_counter()
    shutil.rmtree(OUTPUT, ignore_errors=True)
    OUTPUT.mkdir(parents=True)
    if kill_seed is None:
        kill_seed = random.randrange(10_000)
    rng = random.Random(kill_seed)
    with S3Server() as s3:
        train_index, val_index = write_dataset(s3)
        shards = train_index["shards"] + val_index["shards"]
        total = sum(s["bytes"] for s in shards)
        print(
            f"unbroken streaming demo: an S3 server (moto) at {s3.endpoint}; scikit-learn's "
            f"digits written to s3://{BUCKET}/train ({train_index['rows']} rows, "
            f"{len(train_index['shards'])} shards) and s3://{BUCKET}/val ({val_index['rows']} "
            f"rows, {len(val_index['shards'])} shards), {total} bytes of Parquet in all\n"
            f"{EPOCHS} epochs of a convnet, {PER_EPOCH} batches of {BATCH} per epoch, shuffled "
            "in windows of 2 shards, 2 loader workers, augmentation, dropout, a checkpoint every "
            "5 steps; bytes downloaded = complete shards a process added to the local cache"
        )
        command = [sys.executable, __file__, "--endpoint", s3.endpoint]

        print("1. uninterrupted (the reference), with an empty cache of its own")
        reference, reference_cache = OUTPUT / "uninterrupted", OUTPUT / "cache-uninterrupted"
        code, report = _run(command, reference, reference_cache)
        if code != 0:
            return _failed(reference, code)
        print(f"   {_describe(report)}")

        # Kill points: 4 training batches at random (--kill-seed reproduces them), none at an
        # epoch's first or last batch, so every resume is mid-epoch.
        points, at = [], 0
        for _ in range(KILLS):
            at += rng.randint(12, 40)
            while at % PER_EPOCH in (0, PER_EPOCH - 1):
                at += 1
            points.append(at)
        print(
            f"2. SIGKILL to the whole process group after training batches "
            f"{', '.join(map(str, points))} (from --kill-seed {kill_seed}), restarting until "
            f"done; the cache is emptied before restart {EMPTY_CACHE_BEFORE}"
        )
        killed, cache = OUTPUT / "killed", OUTPUT / "cache"
        process_number, downloaded = 0, [0, 0]  # bytes before and after the cache was emptied
        while True:
            if process_number == EMPTY_CACHE_BEFORE:
                removed = cached(cache)
                shutil.rmtree(cache)
                print(
                    f"   cache emptied: {len(removed)} shards, {sum(removed.values())} bytes "
                    "deleted"
                )
            target = points[process_number] if process_number < len(points) else None
            code, report = _run(command, killed, cache, kill_at=target)
            print(f"   process {process_number}: {_describe(report)}")
            downloaded[process_number >= EMPTY_CACHE_BEFORE] += report["added"][1]
            if target is None:
                if code != 0:
                    return _failed(killed, code)
                break
            if code != -signal.SIGKILL:
                print(f"   the training process ended with {code} before its kill point")
                return _failed(killed, code)
            process_number += 1

        print(
            f"   downloaded by the {process_number + 1} processes: {downloaded[0]} bytes before "
            f"the cache was emptied, {downloaded[1]} after (the dataset is {total} bytes)"
        )

        print(f"3. the cache at the end ({cache}):")
        names = {}  # cache file name -> the shard it holds (the cache names files by checksum)
        for split, index in (("train", train_index), ("val", val_index)):
            for shard in index["shards"]:
                digest = shard["checksum"].partition(":")[2][:32]
                names[f"{digest}-{shard['bytes']}.parquet"] = f"{split}/{shard['name']}"
        files = sorted(cache.iterdir(), key=lambda p: (names.get(p.name, "~"), p.name))
        for path in files:
            if path.name in names:
                lock = " (+ .lock)" if Path(f"{path}.lock").exists() else ""
                print(
                    f"   {path.name:<50} {path.stat().st_size:>6} bytes  {names[path.name]}{lock}"
                )
            elif not (path.name.endswith(".lock") and path.name[: -len(".lock")] in names):
                print(f"   {path.name:<50} {path.stat().st_size:>6} bytes")
        parts = [p.name for p in files if ".part-" in p.name]
        shard_files = cached(cache)
        print(
            f"   {len(shard_files)} shards, {sum(shard_files.values())} bytes (the dataset: "
            f"{len(shards)} shards, {total} bytes); lock files: "
            f"{sum(p.name.endswith('.lock') for p in files)}; partial downloads (.part-*): "
            f"{parts or 'none'}"
        )
    verdict = compare_runs(killed, reference)
    print(f"verdict: {verdict[1]}")
    if parts:
        print("   but partial downloads were left in the cache")
    print(f"   {time.perf_counter() - started:.0f} s in all (logs: {OUTPUT}/*/process-*.log)")
    return verdict[0] or bool(parts)


def _run(command: list, run: Path, cache: Path, kill_at: int | None = None) -> tuple[int, dict]:
    """Run one training process in `run` (until done, or SIGKILLed after training batch
    `kill_at`); its exit code and what it reported, with the bytes it added to the cache."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "status").unlink(missing_ok=True)
    log = run / f"process-{len(list(run.glob('process-*.log')))}.log"
    before = cached(cache) if cache.exists() else {}
    with open(log, "w") as output:
        # A session of its own: the process group a scheduler would signal.
        process = subprocess.Popen(
            [*command, "--train", str(run), "--cache", str(cache)],
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        killed_at = None
        while process.poll() is None:
            if kill_at is not None:
                try:
                    batch, epoch, epoch_batch = map(int, (run / "status").read_text().split())
                except (FileNotFoundError, ValueError):
                    batch = -1
                if batch >= kill_at:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    killed_at = f"training batch {batch} (epoch {epoch}, train batch {epoch_batch})"
                    break
            time.sleep(0.0005)
    report: dict = {"killed_at": killed_at}
    for line in log.read_text().splitlines():
        if line.startswith(("first-batch ", "finished ")):
            kind, *fields = line.split()
            report[kind] = dict(field.split("=") for field in fields)
        elif line.startswith("unbroken: "):
            report["resume"] = line.split(": ", 1)[1].replace(f"{run}/", "")
    added = {n: b for n, b in cached(cache).items() if n not in before}
    report["added"] = (len(added), sum(added.values()))
    return process.returncode, report


def _describe(report: dict) -> str:
    first = report.get("first-batch")
    shards, total = report["added"]
    end = f"SIGKILLed after {report['killed_at']}" if report["killed_at"] else "finished"
    if first is None:
        return f"killed before its first batch; downloaded {total} bytes ({shards} shards)"
    resume = report.get("resume", "")
    if resume.startswith("resumed from checkpoint "):
        checkpoint, _, where = resume.removeprefix("resumed from checkpoint ").partition(" ")
        start = f"resumed at {where.strip('()')} from {checkpoint}"
    else:
        start = f"started fresh at {first['at'].replace('_', ' ')}"
    return (
        f"{start}\n     downloaded {first['downloaded']} bytes ({first['shards']} shards) before "
        f"its first batch, {total} bytes ({shards} shards) in all; {end}"
    )


def _failed(run: Path, code: int) -> int:
    logs = sorted(run.glob("process-*.log"))
    if logs:
        print(logs[-1].read_text()[-3000:])
    print(f"training process exited with {code}; its output: {logs[-1] if logs else run}")
    return 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kill-seed", type=int, help="picks the kill points (default: random)")
    arguments = parser.parse_args()
    if arguments.train:
        train(arguments.train, arguments.endpoint, arguments.cache)
    else:
        sys.exit(main(arguments.kill_seed))
