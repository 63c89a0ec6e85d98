"""A restarted process reading a ``StreamingDataset`` (issue 22, items 7 and 8): what it imports,
and where, before its first batch.

Each restart runs in a fresh interpreter (this one has imported pyarrow long ago): it imports
``unbroken``, builds the dataset and a loader, loads a state and takes the first batch, and
reports which of pyarrow.parquet, fsspec and s3fs were imported at each step, in the training
process and in each loader worker as it starts. On a restart (the cache has the index), building
the dataset imports its reader (pyarrow.parquet), so forked workers inherit it instead of each
importing it on its first read (which, in a child of a process that imported torch, also set off
a full garbage collection touching every inherited page: 0.15-0.3 s per worker on 2 cores). A
first run (an empty cache) leaves the import to the workers, which wait for downloads anyway. A
warm restart imports no filesystem library and builds no filesystem: it contacts no server
before its first batch. No timing is asserted (machines are noisy);
``benchmarks/stream_peers.py`` measures it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import unbroken
from unbroken.streaming import StreamingDataset, write_shards

N = 240
WATCHED = ("pyarrow.parquet", "fsspec", "s3fs")

_RESTART = textwrap.dedent(
    """
    import json
    import os
    import sys

    WATCHED = ("pyarrow.parquet", "fsspec", "s3fs")
    url, cache, options, workers, state, reports = sys.argv[1:]
    workers = int(workers)

    def loaded():
        return sorted(name for name in WATCHED if name in sys.modules)

    def started(worker_id):  # the first thing each worker runs once it has started
        with open(f"{reports}/started-{worker_id}.json", "w") as file:
            json.dump(loaded(), file)

    def probe(row):  # runs where the rows are read, after the read
        path = f"{reports}/read-{os.getpid()}.json"
        if not os.path.exists(path):
            with open(path, "w") as file:
                json.dump({"modules": loaded(), "filesystem": dataset.remote._fs is not None}, file)
        return row["id"]

    report = {}
    import unbroken

    report["after_import"] = loaded()
    dataset = unbroken.StreamingDataset(url, cache_dir=cache, storage_options=json.loads(options))
    report["after_build"] = loaded()
    loader = unbroken.DataLoader(
        dataset.map(probe),
        batch_size=16,
        shuffle=True,
        seed=5,
        num_workers=workers,
        worker_init_fn=started if workers else None,
        multiprocessing_context="fork" if workers else None,
    )
    loader.load_state_dict(json.loads(state))
    batches = iter(loader)
    report["ids"] = next(batches).tolist()
    report["after_first_batch"] = loaded()
    report["filesystem"] = dataset.remote._fs is not None
    del batches
    print(json.dumps(report))
    """
)


def _row(i: int) -> dict:
    return {"id": i, "x": i.to_bytes(4, "little") * 6}


def _warm(url: str, cache: Path, options: dict) -> tuple[dict, list[int]]:
    """Fill ``cache`` (every shard and the index's copy) by reading an epoch in this process;
    return the state after 7 batches and the ids of the batch after it."""
    dataset = StreamingDataset(url, cache_dir=str(cache), storage_options=options)
    loader = unbroken.DataLoader(dataset, batch_size=16, shuffle=True, seed=5)
    batches = iter(loader)
    for _ in range(7):
        next(batches)
    state, expected = loader.state_dict(), next(batches)["id"].tolist()
    for _ in batches:  # the rest of the epoch: every shard in the cache
        pass
    return state, expected


def _restart(
    url: str, cache: Path, options: dict, workers: int, state: dict, reports: Path
) -> tuple[dict, list[list[str]], list[dict]]:
    """The restart's report; the modules each worker had when it started; what each reading
    process had imported and built after its first read."""
    reports.mkdir()
    args = [url, str(cache), json.dumps(options), str(workers), json.dumps(state), str(reports)]
    done = subprocess.run(
        [sys.executable, "-c", _RESTART, *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    started = [json.loads(p.read_text()) for p in sorted(reports.glob("started-*.json"))]
    reads = [json.loads(p.read_text()) for p in sorted(reports.glob("read-*.json"))]
    return report, started, reads


@pytest.fixture(scope="module")
def local_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("remote") / "ds")
    write_shards((_row(i) for i in range(N)), url, shard_bytes=1200, row_group_bytes=300)
    return url


def test_a_restart_imports_the_reader_when_building_the_dataset_so_forked_workers_inherit_it(
    local_url, tmp_path
):
    state, expected = _warm(local_url, tmp_path / "cache", {})
    report, started, _ = _restart(local_url, tmp_path / "cache", {}, 2, state, tmp_path / "reports")
    assert report["after_import"] == []  # `import unbroken` imports none of them
    assert report["after_build"] == ["pyarrow.parquet"]
    assert started == [["pyarrow.parquet"], ["pyarrow.parquet"]]  # both workers inherited it
    assert report["ids"] == expected


def test_a_first_run_leaves_the_reader_to_the_workers_which_import_it_while_downloading(
    local_url, tmp_path
):
    """An empty cache (the index fetched): the first batch waits for downloads, which start
    once the workers exist; importing the reader before them would only delay those."""
    state, expected = _warm(local_url, tmp_path / "warm", {})
    report, started, reads = _restart(
        local_url, tmp_path / "empty", {}, 2, state, tmp_path / "reports"
    )
    assert "pyarrow.parquet" not in report["after_build"]  # (fsspec is: it read the index)
    assert len(started) == 2 and not any("pyarrow.parquet" in modules for modules in started)
    assert report["ids"] == expected
    assert reads and all("pyarrow.parquet" in read["modules"] for read in reads)


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_warm_restart_builds_no_filesystem_before_its_first_batch(
    request, local_url, tmp_path, where, workers
):
    if where == "s3":
        s3 = request.getfixturevalue("s3")
        bucket = f"unbroken-startup-{workers}"
        s3.make_bucket(bucket)
        url, options = f"s3://{bucket}/ds", s3.storage_options
        write_shards(
            (_row(i) for i in range(N)),
            url,
            shard_bytes=1200,
            row_group_bytes=300,
            storage_options=options,
        )
    else:
        url, options = local_url, {}
    state, expected = _warm(url, tmp_path / "cache", options)
    report, _, reads = _restart(
        url, tmp_path / "cache", options, workers, state, tmp_path / "reports"
    )
    assert report["ids"] == expected
    # No process imported fsspec or s3fs, or built a filesystem: no client was made, so no
    # server was contacted (test_streaming.py also reads with the server's endpoint dead).
    clients = {"fsspec", "s3fs"}
    assert not clients & set(report["after_first_batch"]) and not report["filesystem"]
    assert 1 <= len(reads) <= max(workers, 1)
    for read in reads:
        assert "pyarrow.parquet" in read["modules"]  # it read the rows
        assert not clients & set(read["modules"]) and not read["filesystem"]
