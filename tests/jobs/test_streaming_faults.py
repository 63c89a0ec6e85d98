"""A transient fault of the storage changes nothing the user sees: the real S3 protocol server
(moto's, on 127.0.0.1) is stopped with SIGSTOP mid-epoch for longer than the client's read
timeout, so requests time out and are retried, and the epoch's samples and every random draw
of their augmentation (Python's ``random``, numpy's and torch's global generators) equal an
epoch read without the outage, with 0 and 2 workers and the prefetcher's download threads
running beside the reader."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import unbroken
from unbroken.streaming import StreamingDataset, write_shards


@pytest.fixture(scope="module")
def outage_ds(s3) -> str:
    """400 rows in ~20 shards, so that downloads go on all epoch long."""
    s3.make_bucket("faults")
    url = "s3://faults/ds"
    rows = ({"id": i, "x": bytes(200)} for i in range(400))
    write_shards(
        rows, url, storage_options=s3.storage_options, shard_bytes=4000, row_group_bytes=1000
    )
    return url


def augmented(row: dict) -> torch.Tensor:
    # Draws from every generator the loader seeds for the batch.
    draws = [random.random(), float(np.random.rand()), torch.rand(()).item()]
    return torch.tensor([row["id"], *draws], dtype=torch.float64)


def epoch(s3, url, cache, workers: int, stop_for: float) -> tuple[torch.Tensor, float]:
    """One epoch; with ``stop_for`` > 0 the server is stopped that long after the 3rd batch."""
    options = {**s3.storage_options, "config_kwargs": {"read_timeout": 1, "connect_timeout": 1}}
    dataset = StreamingDataset(
        url, cache_dir=str(cache), storage_options=options, prefetch_threads=2, prefetch_bytes=4000
    )
    loader = unbroken.DataLoader(
        dataset.map(augmented), batch_size=8, shuffle=True, seed=3, num_workers=workers
    )
    batches, start = [], time.monotonic()
    for i, batch in enumerate(loader):
        batches.append(batch)
        if i == 2 and stop_for:
            os.kill(s3._process.pid, signal.SIGSTOP)
            threading.Timer(stop_for, os.kill, (s3._process.pid, signal.SIGCONT)).start()
    return torch.cat(batches), time.monotonic() - start


@pytest.mark.parametrize("workers", [0, 2])
def test_an_s3_outage_mid_epoch_changes_no_sample_and_no_draw(s3, outage_ds, tmp_path, workers):
    clean, _ = epoch(s3, outage_ds, tmp_path / "clean", workers, 0)
    faulty, took = epoch(s3, outage_ds, tmp_path / "faulty", workers, 3.0)
    assert took >= 3.0  # the epoch waited out the outage: its requests timed out and retried
    assert sorted(clean[:, 0].tolist()) == list(range(400))
    assert torch.equal(faulty, clean)


def test_only_the_reading_thread_gets_its_random_state_back(monkeypatch):
    # A call made by the thread that reads samples puts Python's random state back; one on
    # another thread (the prefetcher's) must not, or it would undo the reader's own draws.
    from unbroken.streaming.remote import Remote

    remote = Remote("memory://nowhere")
    random.seed(1)
    first = random.random()
    random.seed(1)
    assert remote.retrying("read", "x", random.random) == first
    assert random.random() == first  # the state from before the call

    seen = []

    def on_another_thread():
        random.seed(2)
        remote.retrying("read", "x", random.random)
        seen.append(random.random())

    thread = threading.Thread(target=on_another_thread)
    thread.start()
    thread.join()
    random.seed(2)
    random.random()
    assert seen == [random.random()]  # not put back there


def test_botocore_makes_one_attempt_and_leaves_retries_to_unbroken(s3):
    from unbroken.streaming.remote import Remote

    fs = Remote("s3://faults/ds", s3.storage_options).fs
    assert fs.config_kwargs["retries"] == {"total_max_attempts": 1}
    own = {**s3.storage_options, "config_kwargs": {"retries": {"max_attempts": 7}}}
    assert Remote("s3://faults/ds", own).fs.config_kwargs["retries"] == {"max_attempts": 7}
    assert "config_kwargs" not in Remote("memory://ds", {}).storage_options


def test_a_cached_shard_of_another_size_is_fetched_again(s3, outage_ds, tmp_path):
    # Truncated or extended on the local disk after it was verified: fetched again, not served.
    cache = tmp_path / "cache"
    clean, _ = epoch(s3, outage_ds, cache, 0, 0)
    shards = sorted(cache.glob("*.parquet"))
    assert len(shards) > 2
    shards[0].write_bytes(shards[0].read_bytes()[:-100])  # truncated
    with open(shards[1], "ab") as file:
        file.write(b"junk")  # extended
    again, _ = epoch(s3, outage_ds, cache, 0, 0)
    assert torch.equal(again, clean)
    assert all(shard.stat().st_size == size for shard, size in sizes(shards))


def sizes(shards):
    for shard in shards:
        yield shard, int(shard.stem.rsplit("-", 1)[1])


def test_a_malformed_index_is_never_cached_and_a_damaged_copy_names_itself(tmp_path):
    # A malformed index on the storage is refused and not kept: once it is repaired there, the
    # next run reads it (it used to stay in the cache until refresh_index=True).
    from unbroken.errors import CorruptShard

    url, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    write_shards(({"id": i} for i in range(40)), url, shard_bytes=400)
    index = tmp_path / "ds" / "unbroken-index.json"
    good = index.read_bytes()
    index.write_bytes(good.replace(b'"rows"', b'"rowz"', 1))
    with pytest.raises(CorruptShard, match=f"the index {url}/unbroken-index.json is malformed"):
        StreamingDataset(url, cache_dir=cache)
    index.write_bytes(good)
    assert len(StreamingDataset(url, cache_dir=cache)) == 40  # repaired: read, then kept
    # The cache's copy damaged on this disk: the error names the local file and the way out.
    (copy,) = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("index-")]
    copy.write_bytes(b"{not json")
    with pytest.raises(CorruptShard, match="refresh_index=True") as damaged:
        StreamingDataset(url, cache_dir=cache)
    assert str(copy) in str(damaged.value) and "not valid JSON" in str(damaged.value)
    assert len(StreamingDataset(url, cache_dir=cache, refresh_index=True)) == 40


def test_a_deleted_shard_a_missing_bucket_and_a_bad_footer_name_the_shard_and_its_url(s3, tmp_path):
    import s3fs

    from unbroken.errors import CorruptShard

    s3.make_bucket("names")
    url = "s3://names/ds"
    write_shards(
        ({"id": i} for i in range(60)), url, storage_options=s3.storage_options, shard_bytes=400
    )
    fs = s3fs.S3FileSystem(**s3.storage_options)
    shards = sorted(p for p in fs.ls("names/ds") if p.endswith(".parquet"))
    first = shards[0].rsplit("/", 1)[1]

    def read_all(cache: str) -> None:
        dataset = StreamingDataset(url, cache_dir=cache, storage_options=s3.storage_options)
        list(unbroken.DataLoader(dataset, batch_size=8, seed=0))

    # The shard's object deleted after the index was written: not retried, named.
    saved = fs.cat_file(shards[0])
    fs.rm(shards[0])
    with pytest.raises(FileNotFoundError, match=f"could not download {url}/{first}: it does not"):
        read_all(str(tmp_path / "a"))
    # A Parquet file whose footer is damaged, its index entry resealed to match its bytes (as
    # a hand-edited index would): the checksum passes, pyarrow cannot read it.
    broken = saved[:-12] + b"\x00" * 8 + saved[-4:]
    fs.pipe_file(shards[0], broken)
    index = json.loads(fs.cat_file("names/ds/unbroken-index.json"))
    entry = next(e for e in index["shards"] if e["name"] == first)
    entry["checksum"] = "sha256:" + hashlib.sha256(broken).hexdigest()
    entry["bytes"] = len(broken)
    fs.pipe_file("names/ds/unbroken-index.json", json.dumps(index).encode())
    with pytest.raises(CorruptShard, match=f"shard {first} \\({url}/{first}, cached as"):
        read_all(str(tmp_path / "b"))
    # A bucket that does not exist: the index's URL, and what to check.
    with pytest.raises(FileNotFoundError, match="s3://no-such-bucket/ds"):
        StreamingDataset(
            "s3://no-such-bucket/ds",
            cache_dir=str(tmp_path / "c"),
            storage_options=s3.storage_options,
        )


def test_damage_past_the_first_mebibytes_is_caught(tmp_path):
    # A hash that covered only a file's first MiBs would pass every smaller file: damage one
    # byte 6 MiB into a checkpoint file and into a shard of several MiB.
    from unbroken import Checkpointer
    from unbroken.errors import CorruptShard

    big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB
    checkpoints = Checkpointer(tmp_path / "ckpt", keep=3)
    checkpoints.save(1, {"x": big})
    checkpoints.save(2, {"x": big + 1})
    (data,) = [p for p in (tmp_path / "ckpt" / "step-000000002").iterdir() if p.suffix == ".pt"]
    damaged = bytearray(data.read_bytes())
    damaged[6 << 20] ^= 0xFF
    data.write_bytes(bytes(damaged))
    with pytest.warns(UserWarning, match="does not match its sha256"):
        restored = Checkpointer(tmp_path / "ckpt").load_latest({"x": None})
    assert restored.step == 1 and torch.equal(restored.values["x"], big)

    url = str(tmp_path / "ds")
    noise = np.random.default_rng(0)
    rows = ({"id": i, "x": noise.bytes(16 << 10)} for i in range(600))  # ~10 MiB, one shard
    write_shards(rows, url, shard_bytes=64 << 20, row_group_bytes=1 << 20)
    (shard,) = (tmp_path / "ds").glob("*.parquet")
    damaged = bytearray(shard.read_bytes())
    assert len(damaged) > 7 << 20
    damaged[6 << 20] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    with pytest.raises(CorruptShard, match="checksum"):
        dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"))
        next(iter(unbroken.DataLoader(dataset, batch_size=4, seed=0)))


def test_the_cache_never_serves_another_datasets_shard_of_the_same_name_and_size(tmp_path):
    # Two datasets (or two versions of one) whose shards have the same names and sizes but
    # other bytes, in one cache: each reads its own rows.
    cache = str(tmp_path / "cache")
    for version in (1, 2):
        rows = ({"id": i, "v": version} for i in range(50))
        write_shards(rows, str(tmp_path / f"v{version}"), shard_bytes=500)
    for version in (1, 2, 1):
        dataset = StreamingDataset(str(tmp_path / f"v{version}"), cache_dir=cache)
        assert {row["v"] for row in dataset} == {version}
    names = sorted(p.name for p in (tmp_path / "v1").glob("*.parquet"))
    assert names == sorted(p.name for p in (tmp_path / "v2").glob("*.parquet"))  # same names


FIRST_BATCH = """
import sys, unbroken
from unbroken.streaming import StreamingDataset
url, cache, endpoint, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
dataset = StreamingDataset(url, cache_dir=cache, storage_options=options, prefetch_threads=4)
batch = next(iter(unbroken.DataLoader(dataset, batch_size=8, shuffle=True, seed=1, num_workers=workers)))
print("first batch", len(batch["id"]))
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_process_that_exits_after_its_first_batch_exits_cleanly(s3, outage_ds, tmp_path, workers):
    # A restarted process that exits right after its first batch, while the prefetcher's
    # threads and the S3 client's event loop are still downloading (a cold cache), and after a
    # warm one: exit status 0 every time, never an abort in a thread's destructor (seen twice
    # in 16 warm resumes once: "terminate called without an active exception").
    script = tmp_path / "first_batch.py"
    script.write_text(FIRST_BATCH)
    for attempt in range(4):
        cache = tmp_path / ("warm" if attempt % 2 else f"cold-{attempt}")
        done = subprocess.run(
            [sys.executable, str(script), outage_ds, str(cache), s3.endpoint, str(workers)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0 and "first batch 8" in done.stdout, done.stderr[-2000:]
        assert "terminate called" not in done.stderr
