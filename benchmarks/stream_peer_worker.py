"""One library's side of ``stream_peers.py``: run inside that library's virtual environment.

How it measures, and what the numbers mean: ``docs/benchmarks/stream-peers.md``.

Self-contained (no ``harness`` import): it runs in the peers' virtual environments, and a
resume child's clock starts at its spawn, so it imports nothing it does not measure.

    python stream_peer_worker.py --library streaming|litdata|unbroken --endpoint URL \
        --remote s3://bench/NAME --work DIR [--samples N] [--phase main]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 64
SHARD_BYTES = 8 << 20
SEED = 0
POSITIONS = (0.01, 0.50, 0.99)
X_BYTES = 1024

# The sample payload: 8 bytes of the sample id (little endian), then 1016 bytes cut from a fixed
# 1 MiB pseudo-random block (sha256 in counter mode: identical in every environment, no numpy
# version dependence, incompressible). The id prefix lets every reader be checked exactly.
# Built on first use (~30 ms), not at import: a resume child's clock starts at its spawn, and the
# first batch must not wait for the harness's own data.
_BLOCK = b""


def _block() -> bytes:
    global _BLOCK
    if not _BLOCK:
        _BLOCK = b"".join(hashlib.sha256(k.to_bytes(8, "little")).digest() for k in range(32768))
    return _BLOCK


def make_x(i: int) -> bytes:
    block = _block()
    off = (i * 7919) % (len(block) - (X_BYTES - 8))
    return i.to_bytes(8, "little") + block[off : off + X_BYTES - 8]


def make_row(i: int) -> dict[str, Any]:
    return {"x": make_x(i), "y": i % 10}


def rows(n: int):
    for i in range(n):
        yield make_row(i)


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The same collate for all three loaders: x stays a list of bytes, y becomes a tensor
    (torch's default_collate treats bytes as a sequence and transposes them into 1024 tensors)."""
    import torch

    # bytes(): LitData hands out memoryviews, which cannot cross the worker queue.
    return {
        "x": [bytes(item["x"]) for item in items],
        "y": torch.tensor([int(item["y"]) for item in items]),
    }


def _xs(batch: Any) -> list[bytes]:
    xs = batch["x"]
    if isinstance(xs, (list, tuple)) and xs and hasattr(xs[0], "numpy"):  # default_collate
        return [bytes(row) for row in np.stack([t.numpy() for t in xs], axis=1).astype(np.uint8)]
    if isinstance(xs, (list, tuple)):
        return [bytes(x) for x in xs]
    if hasattr(xs, "numpy"):  # a uint8 tensor [B, 1024]
        arr = xs.numpy()
        return [bytes(row) for row in arr]
    if isinstance(xs, np.ndarray):
        return [bytes(row) for row in xs]
    raise TypeError(f"unexpected batch['x'] type {type(xs)}")


def _ys(batch: Any) -> list[int]:
    ys = batch["y"]
    if hasattr(ys, "tolist"):
        return [int(v) for v in ys.tolist()]
    return [int(v) for v in ys]


def batch_ids(batch: Any) -> list[int]:
    return [int.from_bytes(x[:8], "little") for x in _xs(batch)]


def batch_ok(batch: Any) -> bool:
    """Every sample's x and y are exactly what was written for its id."""
    return all(
        x == make_x(int.from_bytes(x[:8], "little")) and y == int.from_bytes(x[:8], "little") % 10
        for x, y in zip(_xs(batch), _ys(batch))
    )


def dir_bytes(path: str | Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def dir_files(path: str | Path) -> list[tuple[str, int]]:
    out = []
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            try:
                out.append((os.path.relpath(full, path), os.lstat(full).st_size))
            except OSError:
                pass
    return sorted(out)


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def set_s3_env(endpoint: str) -> None:
    os.environ.update(
        {
            "S3_ENDPOINT_URL": endpoint,  # MosaicML Streaming reads this (boto3 endpoint_url)
            "AWS_ENDPOINT_URL": endpoint,  # boto3/botocore >= 1.31 and obstore read this
            "AWS_ENDPOINT": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",  # obstore (LitData's chunk downloads) refuses http:// otherwise
        }
    )


def list_remote(endpoint: str, remote: str) -> dict[str, int]:
    """{basename: size} of every object under ``remote`` (boto3 if present, else s3fs)."""
    bucket, _, prefix = remote[len("s3://") :].partition("/")
    out: dict[str, int] = {}
    try:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"].rsplit("/", 1)[-1]] = obj["Size"]
    except ImportError:
        import s3fs

        fs = s3fs.S3FileSystem(
            endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True
        )
        for path, info in fs.find(f"{bucket}/{prefix}", detail=True).items():
            out[path.rsplit("/", 1)[-1]] = info["size"]
    return out


# ---------------------------------------------------------------------------------------------
# The three libraries, behind one small interface.
# ---------------------------------------------------------------------------------------------


class Lib:
    name = ""

    def __init__(self, endpoint: str, remote: str) -> None:
        self.endpoint, self.remote = endpoint, remote

    # What a training script imports at its top to use the library, and nothing more: the
    # same rule for all three. Whatever else a library needs for its first batch (pyarrow,
    # fsspec, boto3, ...) it imports itself while the loader is built or iterated, inside the
    # "build to first batch" clock; a resume's other clock starts at the process's spawn and
    # holds every import.
    modules: tuple[str, ...] = ()

    def preimport(self) -> None:
        """``import`` the library as a training script would, before its loader is built."""
        import importlib

        for module in self.modules:
            importlib.import_module(module)

    def version(self) -> str:
        raise NotImplementedError

    def write(self, n: int, work: Path) -> dict[str, Any]:
        raise NotImplementedError

    def loader(self, cache: str, workers: int) -> Any:
        """A fresh dataset and loader, shuffled with seed 0, batch 64."""
        raise NotImplementedError

    def state(self, loader: Any) -> Any:
        return loader.state_dict()

    def load(self, loader: Any, state: Any) -> None:
        loader.load_state_dict(state)

    def shard_bounds(self, cache: str, n: int) -> tuple[list[int], str]:
        """Cumulative sample counts at the end of each shard, in write order."""
        per = max(1, SHARD_BYTES // (X_BYTES + 16))
        return list(range(per, n, per)) + [n], "nominal (8 MiB / 1040 B per sample)"

    def epochs(self, loader: Any):
        """Iterate one epoch (the loader advances its own epoch counter)."""
        return iter(loader)


class StreamingLib(Lib):
    name = "streaming"
    modules = ("streaming",)

    def version(self) -> str:
        import streaming

        return streaming.__version__

    def write(self, n: int, work: Path) -> dict[str, Any]:
        from streaming import MDSWriter

        t0 = time.perf_counter()
        with MDSWriter(
            out=self.remote,
            columns={"x": "bytes", "y": "int"},
            size_limit=SHARD_BYTES,
            compression=None,
            progress_bar=False,
        ) as writer:
            for row in rows(n):
                writer.write(row)
        return {"seconds": time.perf_counter() - t0}

    def loader(self, cache: str, workers: int) -> Any:
        from streaming import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(
            remote=self.remote, local=cache, shuffle=True, shuffle_seed=SEED, batch_size=BATCH
        )  # shuffle_algo default ("py1e"), predownload default, cache_limit None
        return StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=collate)

    def shard_bounds(self, cache: str, n: int) -> tuple[list[int], str]:
        index = json.loads((Path(cache) / "index.json").read_text())
        return [int(c) for c in np.cumsum([s["samples"] for s in index["shards"]])], "index.json"


def _litdata_item(i: int) -> dict[str, Any]:
    return make_row(i)


def _litdata_allow_http() -> None:
    """LitData moves chunks with obstore, whose client refuses plain http:// endpoints unless
    ``allow_http`` is set; LitData builds every S3Store with its module-level
    ``_OBSTORE_CLIENT_OPTIONS`` and offers no setting for it (AWS_ALLOW_HTTP is not read), so add
    the one key here. Real S3 is https and needs no such change; nothing else is altered."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True


class LitDataLib(Lib):
    name = "litdata"
    modules = ("litdata",)

    @property
    def storage_options(self) -> dict[str, Any]:
        # LitData hands storage_options to boto3's session.client("s3", **options), and derives
        # obstore's endpoint from that client.
        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "region_name": "us-east-1",
        }

    def version(self) -> str:
        import litdata

        return litdata.__version__

    def write(self, n: int, work: Path) -> dict[str, Any]:
        from litdata import optimize

        # optimize() stages chunks in a local cache folder before uploading them.
        os.environ.setdefault("DATA_OPTIMIZER_CACHE_FOLDER", str(work / "litdata-optimize-cache"))
        os.environ.setdefault(
            "DATA_OPTIMIZER_DATA_CACHE_FOLDER", str(work / "litdata-optimize-data")
        )
        _litdata_allow_http()
        t0 = time.perf_counter()
        optimize(
            fn=_litdata_item,
            inputs=list(range(n)),
            output_dir=self.remote,
            chunk_bytes=SHARD_BYTES,
            num_workers=1,  # one writer process, as for the others; keeps chunks in id order
            storage_options=self.storage_options,
            mode="overwrite",
            # optimize() otherwise calls multiprocessing.set_start_method("spawn", force=True),
            # which would also switch the DataLoader workers of this process to spawn.
            start_method="fork",
        )
        return {"seconds": time.perf_counter() - t0, "note": "optimize(num_workers=1)"}

    def loader(self, cache: str, workers: int) -> Any:
        from litdata import StreamingDataLoader, StreamingDataset

        _litdata_allow_http()
        ds = StreamingDataset(
            self.remote,
            cache_dir=cache,
            shuffle=True,
            seed=SEED,
            storage_options=self.storage_options,
        )
        return StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=collate)

    def shard_bounds(self, cache: str, n: int) -> tuple[list[int], str]:
        found = sorted(Path(cache).rglob("index.json"))
        if not found:
            return super().shard_bounds(cache, n)
        index = json.loads(found[0].read_text())
        return [int(c) for c in np.cumsum([c["chunk_size"] for c in index["chunks"]])], "index.json"


class UnbrokenLib(Lib):
    name = "unbroken"
    modules = ("unbroken",)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def version(self) -> str:
        import unbroken

        return unbroken.__version__

    def write(self, n: int, work: Path) -> dict[str, Any]:
        from unbroken.streaming import write_shards

        t0 = time.perf_counter()
        index = write_shards(
            rows(n), self.remote, shard_bytes=SHARD_BYTES, storage_options=self.storage_options
        )
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "index_type": type(index).__name__}

    def loader(self, cache: str, workers: int) -> Any:
        import unbroken
        from unbroken.streaming import StreamingDataset

        ds = StreamingDataset(self.remote, cache_dir=cache, storage_options=self.storage_options)
        return unbroken.DataLoader(
            ds, batch_size=BATCH, shuffle=True, seed=SEED, num_workers=workers, collate_fn=collate
        )

    def shard_bounds(self, cache: str, n: int) -> tuple[list[int], str]:
        # The sample counts of the shards, wherever the dataset or its index exposes them.
        try:
            from unbroken.streaming import StreamingDataset

            ds = StreamingDataset(
                self.remote, cache_dir=cache, storage_options=self.storage_options
            )
            for owner in (ds, getattr(ds, "index", None), getattr(ds, "_index", None)):
                if owner is None:
                    continue
                for attr in ("shard_samples", "shard_sizes", "sample_counts", "counts", "rows"):
                    counts = getattr(owner, attr, None)
                    if counts is not None and not callable(counts) and len(counts) > 0:
                        if isinstance(counts[0], (int, np.integer)):
                            return [int(c) for c in np.cumsum(counts)], f"dataset.{attr}"
                for attr in ("shards",):
                    shards = getattr(owner, attr, None)
                    if shards and hasattr(shards[0], "rows"):  # unbroken's index.Shard
                        counts = [int(s.rows) for s in shards]
                        return [int(c) for c in np.cumsum(counts)], "index (Shard.rows)"
                    if shards and isinstance(shards[0], dict):
                        for key in ("samples", "rows", "num_samples", "count"):
                            if key in shards[0]:
                                counts = [s[key] for s in shards]
                                return [int(c) for c in np.cumsum(counts)], f"shards[{key}]"
        except Exception:
            pass
        return super().shard_bounds(cache, n)


LIBS = {"streaming": StreamingLib, "litdata": LitDataLib, "unbroken": UnbrokenLib}


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def run_epoch(
    loader: Any,
    it: Any,
    *,
    states_at: dict[int, Any] | None = None,
    lib: Lib | None = None,
    check: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Drain one epoch; returns ids in order, seconds, and optional states/batches."""
    ids: list[int] = []
    ok = True
    first = None
    t0 = time.perf_counter()
    nb = 0
    for batch in it:
        if first is None:
            first = time.perf_counter() - t0
        nb += 1
        b_ids = batch_ids(batch)
        ids.extend(b_ids)
        if check and not batch_ok(batch):
            ok = False
        if states_at is not None and nb in states_at:
            states_at[nb] = {"state": lib.state(loader), "next": None}
        if states_at is not None and (nb - 1) in states_at and nb - 1 > 0:
            states_at[nb - 1]["next"] = b_ids
        if progress:
            print(f"B {nb}", flush=True)
    seconds = time.perf_counter() - t0
    return {"ids": ids, "seconds": seconds, "first_batch_s": first, "batches": nb, "x_ok": ok}


def shuffle_quality(ids: list[int], n: int, bounds: list[int]) -> dict[str, Any]:
    a = np.asarray(ids, dtype=np.int64)
    jumps = np.abs(np.diff(a)) / n
    shard = np.searchsorted(np.asarray(bounds), a, side="right")
    per_batch = [len(np.unique(shard[k : k + BATCH])) for k in range(0, len(a), BATCH)]
    return {
        "mean_jump": float(jumps.mean()) if len(jumps) else None,
        "median_jump": float(np.median(jumps)) if len(jumps) else None,
        "shards_per_batch": float(np.mean(per_batch)) if per_batch else None,
        "shards": len(bounds),
        "distinct": int(len(np.unique(a))),
        "received": len(ids),
    }


def order_compare(a: list[int], b: list[int]) -> dict[str, Any]:
    return {
        "same_order": a == b,
        "same_set": sorted(a) == sorted(b),
        "first_difference": next((k for k, (p, q) in enumerate(zip(a, b)) if p != q), None),
    }


def child(args: argparse.Namespace, phase: str, extra: list[str], **popen: Any) -> subprocess.Popen:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--library",
        args.library,
        "--endpoint",
        args.endpoint,
        "--remote",
        args.remote,
        "--work",
        args.work,
        "--samples",
        str(args.samples),
        "--phase",
        phase,
        *extra,
    ]
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **popen)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of a child's process group (loader workers it did not stop), so
    no process of one measurement runs into the next."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def run_child(
    args: argparse.Namespace, phase: str, extra: list[str], timeout: float
) -> dict[str, Any]:
    spawned = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine
    proc = child(args, phase, extra, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return {"error": f"timed out after {timeout:.0f}s", "stderr_tail": err[-1500:]}
    _kill_group(proc)
    result = last_json(out)
    if result is not None:
        result["spawned_at"] = spawned
    if result is None or proc.returncode != 0:
        return {
            "error": f"exit code {proc.returncode}",
            "stderr_tail": err[-2500:],
            **(result or {}),
        }
    return result


def link_copy(src: str, dst: str) -> None:
    """A hard-link copy of a cache dir (a warm cache that no running dataset has registered)."""
    shutil.copytree(src, dst, copy_function=os.link)


def phase_resume(lib: Lib, args: argparse.Namespace) -> dict[str, Any]:
    """A restarted training process: import the library, build the loader (``--workers``), load
    the state, take the first batch. Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC, the
    same clock in every process), so the parent, which noted when it spawned this process,
    gets both times: spawn to first batch (interpreter, every import, build, first batch) and
    build to first batch (after the ``import`` of the library alone, the same for all three)."""
    started = time.monotonic()  # the interpreter and this harness's imports are done
    with open(args.state, "rb") as f:
        state = pickle.load(f)
    lib.preimport()
    imported = time.monotonic()
    loader = lib.loader(args.cache, args.workers)
    lib.load(loader, state)
    it = iter(loader)
    batch = next(it)
    first = time.monotonic()
    cache_bytes = dir_bytes(args.cache)  # what was in the cache when the first batch arrived
    out = {
        "started_at": started,
        "built_at": imported,
        "first_batch_at": first,
        "seconds": first - imported,
        "imports_s": imported - started,
        "ids": batch_ids(batch),
        "x_ok": batch_ok(batch),
        "cache_bytes": cache_bytes,
        "modules": sorted(m for m in ("pyarrow", "fsspec", "s3fs", "boto3") if m in sys.modules),
    }
    # Stop background downloads and workers before the process exits, where the library allows
    # it (the parent kills the process group afterwards in any case).
    del it, loader
    return out


def phase_epoch(lib: Lib, args: argparse.Namespace) -> dict[str, Any]:
    if args.clean_shm and lib.name == "streaming":
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
    loader = lib.loader(args.cache, args.workers)
    r = run_epoch(loader, lib.epochs(loader), check=True, progress=args.progress)
    return {"ids": r["ids"], "seconds": r["seconds"], "x_ok": r["x_ok"], "batches": r["batches"]}


def kill_test(
    lib: Lib, args: argparse.Namespace, work: Path, reference: list[int]
) -> dict[str, Any]:
    """SIGKILL a num_workers=2, empty-cache epoch mid-way; inspect; restart on the same cache."""
    cache = work / "cache-kill"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    total_batches = -(-args.samples // BATCH)
    kill_at = max(2, total_batches // 10)
    before = shm_entries()
    err_path = work / "kill-child-stderr.txt"
    err_file = open(err_path, "w")  # a file, not a pipe: a full pipe would stall the child
    proc = child(
        args,
        "epoch",
        ["--cache", str(cache), "--workers", "2", "--progress"],
        stderr=err_file,
        start_new_session=True,
    )
    got = 0
    t0 = time.perf_counter()
    deadline = t0 + 600
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("B "):
            got = int(line.split()[1])
            if got >= kill_at:
                break
        if time.perf_counter() > deadline:
            break
    cache_at_kill = dir_bytes(cache)
    shm_during = shm_entries() - before
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    err_file.close()
    err_tail = err_path.read_text()[-1500:]
    time.sleep(1.0)
    left_shm = sorted(shm_entries() - before)
    remote = list_remote(args.endpoint, args.remote)
    files = dir_files(cache)
    # A cache file is a complete copy of a remote object if it has its name and size, or (for
    # caches that rename, e.g. by content hash) the size and extension of one.
    by_size = {(size, Path(name).suffix) for name, size in remote.items()}
    complete, other = [], []
    for rel, size in files:
        base = rel.rsplit("/", 1)[-1]
        ok = remote.get(base) == size or (size, Path(base).suffix) in by_size
        (complete if ok else other).append((rel, size))
    result: dict[str, Any] = {
        "killed_after_batches": got,
        "of_batches": total_batches,
        "child_exit": proc.returncode,
        "child_stderr_tail": err_tail if proc.returncode not in (-9, 0) else "",
        "cache_bytes_at_kill": cache_at_kill,
        "shm_new_while_running": sorted(shm_during),
        "shm_left_after_kill": left_shm,
        "cache_complete_files": len(complete),
        "cache_other_files": [f"{rel} ({size} B)" for rel, size in other],
        "cache_partial_files": [f"{rel} ({size} B)" for rel, size in other if size > 0],
        "cache_empty_files": [rel for rel, size in other if size == 0],
    }
    restart = run_child(args, "epoch", ["--cache", str(cache), "--workers", "2"], timeout=900)
    result["restart"] = _restart_summary(restart, reference, args.samples)
    if "error" in restart and lib.name == "streaming":
        retry = run_child(
            args, "epoch", ["--cache", str(cache), "--workers", "2", "--clean-shm"], timeout=900
        )
        result["restart_after_clean_stale_shared_memory"] = _restart_summary(
            retry, reference, args.samples
        )
    result["shm_left_after_restart"] = sorted(shm_entries() - before)
    return result


def _restart_summary(r: dict[str, Any], reference: list[int], n: int) -> dict[str, Any]:
    if "error" in r:
        return {"works": False, "error": r["error"], "stderr_tail": r.get("stderr_tail", "")}
    return {
        "works": True,
        "seconds": r["seconds"],
        "x_ok": r["x_ok"],
        "distinct": len(set(r["ids"])),
        "complete": len(set(r["ids"])) == n and len(r["ids"]) == n,
        "exact": r["ids"] == reference and r["x_ok"],
    }


def phase_main(lib: Lib, args: argparse.Namespace) -> dict[str, Any]:
    n = args.samples
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "library": lib.name,
        "version": lib.version(),
        "samples": n,
        "python": sys.version.split()[0],
    }
    import torch

    res["torch"] = torch.__version__
    shm_start = shm_entries()

    def step(name: str) -> None:
        print(f"[{lib.name}] {name} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)

    lib.preimport()
    step("write")
    res["write"] = lib.write(n, work)

    total_batches = -(-n // BATCH)
    ks = sorted({max(1, round(total_batches * p)) for p in POSITIONS})
    ks = [min(k, total_batches - 1) for k in ks]
    pos_of = {k: p for k, p in zip(ks, POSITIONS)}

    # --- num_workers=0: cold epoch (empty cache), then a warm second epoch.
    step("epoch w0 cold")
    c0 = str(work / "cache-w0")
    shutil.rmtree(c0, ignore_errors=True)
    t0 = time.perf_counter()
    loader0 = lib.loader(c0, 0)
    build0 = time.perf_counter() - t0
    states: dict[int, Any] = {k: None for k in ks}
    e_cold0 = run_epoch(loader0, lib.epochs(loader0), states_at=states, lib=lib, check=True)
    step("epoch w0 warm")
    e_warm0 = run_epoch(loader0, lib.epochs(loader0))
    bounds, bounds_src = lib.shard_bounds(c0, n)
    res["shuffle"] = {**shuffle_quality(e_cold0["ids"], n, bounds), "shard_bounds": bounds_src}
    res["cold_w0_x_ok"] = e_cold0["x_ok"]
    res["throughput"] = {
        "w0_cold": n / e_cold0["seconds"],
        "w0_warm": n / e_warm0["seconds"],
        "w0_build_s": build0,
        "w0_cold_first_batch_s": e_cold0["first_batch_s"],
        # From building the loader (which reads the index: from the server, for all three).
        "w0_cold_build_first_batch_s": build0 + e_cold0["first_batch_s"],
    }
    res["epoch_samples"] = {"w0_e0": len(e_cold0["ids"]), "w0_e1": len(e_warm0["ids"])}
    res["epochs_differ"] = e_cold0["ids"] != e_warm0["ids"]

    # states: JSON round trip as a checkpoint would do; pickled for the child processes.
    res["state_json"] = True

    def save_states(found: dict[int, Any], tag: str) -> dict[int, str]:
        files = {}
        for k in ks:
            state = found[k]["state"]
            try:
                state = json.loads(json.dumps(state))
            except (TypeError, ValueError):
                res["state_json"] = False
            path = work / f"state-{tag}-{k}.pkl"
            with open(path, "wb") as f:
                pickle.dump(state, f)
            files[k] = str(path)
        return files

    state_files = {0: save_states(states, "w0")}
    del loader0
    gc.collect()
    # Resume runs at the same cache path (LitData's state records the cache dir and refuses
    # another); "warm" restores the epoch's cache from this hard-link snapshot, "cold" empties it.
    snapshot = str(work / "cache-w0-snapshot")
    shutil.rmtree(snapshot, ignore_errors=True)
    link_copy(c0, snapshot)

    # --- num_workers=2: cold epoch, then a warm second epoch.
    step("epoch w2 cold")
    c2 = str(work / "cache-w2")
    shutil.rmtree(c2, ignore_errors=True)
    loader2 = lib.loader(c2, 2)
    states2: dict[int, Any] = {k: None for k in ks}
    e_cold2 = run_epoch(loader2, lib.epochs(loader2), states_at=states2, lib=lib)
    step("epoch w2 warm")
    e_warm2 = run_epoch(loader2, lib.epochs(loader2))
    del loader2
    gc.collect()
    state_files[2] = save_states(states2, "w2")
    snapshot2 = str(work / "cache-w2-snapshot")
    shutil.rmtree(snapshot2, ignore_errors=True)
    link_copy(c2, snapshot2)
    res["throughput"].update({"w2_cold": n / e_cold2["seconds"], "w2_warm": n / e_warm2["seconds"]})
    res["epoch_samples"].update({"w2_e0": len(e_cold2["ids"]), "w2_e1": len(e_warm2["ids"])})
    res["order_w0_vs_w2"] = {
        "epoch0": order_compare(e_cold0["ids"], e_cold2["ids"]),
        "epoch1": order_compare(e_warm0["ids"], e_warm2["ids"]),
    }

    # --- resume latency, each in a fresh process: num_workers 0 and 2, each resuming a state
    # its own num_workers saved, at the cache path that loader used (LitData's state records
    # it); "warm" restores that cache from its snapshot, "cold" empties it. Every measurement
    # is taken --resume-repeats times, in rounds (each round takes all of them once), and
    # reported as the median; the single runs are kept under "runs".
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    setups = [
        (k, workers, kind, cache_dir, snap, found)
        for k in ks
        for workers, cache_dir, snap, found in (
            (0, c0, snapshot, states),
            (2, c2, snapshot2, states2),
        )
        for kind in ("warm", "cold")
    ]
    for round_ in range(args.resume_repeats):
        for k, workers, kind, cache_dir, snap, found in setups:
            label = f"{round(pos_of[k] * 100)}%"
            name = kind if workers == 0 else f"{kind}_w{workers}"
            step(f"resume {label} {kind}, {workers} workers (round {round_ + 1})")
            cache = Path(cache_dir)
            shutil.rmtree(cache, ignore_errors=True)
            if kind == "warm":
                link_copy(snap, str(cache))
            else:
                cache.mkdir(parents=True)
            extra = ["--cache", str(cache), "--state", state_files[workers][k]]
            r = run_child(args, "resume", [*extra, "--workers", str(workers)], timeout=600)
            if "error" in r:
                run = {"error": r["error"], "stderr_tail": r.get("stderr_tail", "")}
            else:
                expected = found[k]["next"]
                run = {
                    "seconds": r["seconds"],  # building the loader to the first batch
                    "process_seconds": r["first_batch_at"] - r["spawned_at"],  # spawn to it
                    "start_seconds": r["started_at"] - r["spawned_at"],  # interpreter, harness
                    "imports_s": r["imports_s"],  # `import <library>`
                    "exact": r["ids"] == expected and r["x_ok"],
                    "cache_bytes": r["cache_bytes"],
                    "modules_at_first_batch": r.get("modules"),
                }
                if r["ids"] != expected:
                    run["got_first_ids"] = r["ids"][:4]
                    run["want_first_ids"] = (expected or [])[:4]
            runs.setdefault((label, name), []).append(run)
    res["resume"] = {}
    for k in ks:
        label = f"{round(pos_of[k] * 100)}%"
        entry: dict[str, Any] = {"batch": k}
        for name in ("warm", "cold", "warm_w2", "cold_w2"):
            done = runs[(label, name)]
            failed = [run for run in done if "error" in run]
            if failed:
                entry[name] = {**failed[0], "runs": done}
                continue
            entry[name] = {
                key: float(np.median([run[key] for run in done]))
                for key in ("seconds", "process_seconds", "start_seconds", "imports_s")
            }
            entry[name].update(
                exact=all(run["exact"] for run in done),
                cache_bytes=int(np.median([run["cache_bytes"] for run in done])),
                modules_at_first_batch=done[0]["modules_at_first_batch"],
                runs=done,
            )
        res["resume"][label] = entry
    for cache_dir, snap in ((c0, snapshot), (c2, snapshot2)):
        shutil.rmtree(cache_dir, ignore_errors=True)
        link_copy(snap, cache_dir)

    # --- SIGKILL mid-epoch.
    step("kill test")
    try:
        res["kill"] = kill_test(lib, args, work, e_cold2["ids"])
    except Exception as exc:
        res["kill"] = {
            "error": f"{type(exc).__name__}: {exc}",
            "trace": traceback.format_exc()[-1500:],
        }
    res["shm_left_at_end"] = sorted(shm_entries() - shm_start)
    res["cache_bytes"] = {"w0": dir_bytes(c0), "w2": dir_bytes(c2)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--library", choices=sorted(LIBS), required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--remote", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--phase", choices=("main", "resume", "epoch"), default="main")
    ap.add_argument("--cache")
    ap.add_argument("--state")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--clean-shm", action="store_true")
    ap.add_argument(
        "--resume-repeats", type=int, default=3, help="resume measurements: runs of each (median)"
    )
    args = ap.parse_args()
    set_s3_env(args.endpoint)
    lib = LIBS[args.library](args.endpoint, args.remote)
    if args.phase == "main":
        try:
            out = phase_main(lib, args)
        except Exception as exc:
            out = {
                "library": args.library,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()[-3000:],
            }
    elif args.phase == "resume":
        out = phase_resume(lib, args)
    else:
        out = phase_epoch(lib, args)
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    # Some loaders leave non-daemon download threads behind; do not wait for them.
    os._exit(0)


if __name__ == "__main__":
    main()
