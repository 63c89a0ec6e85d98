"""Hugging Face `datasets` streaming over local Parquet files resumes exactly (no network)."""

import os

import pytest

pytest.importorskip("datasets")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

import unbroken
from unbroken.testing import assert_resumes_exactly


@pytest.fixture(scope="module")
def parquet_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("parquet")
    files = []
    for shard in range(4):  # 4 shards of 100 rows, so 2 workers get 2 shards each
        path = directory / f"part-{shard}.parquet"
        rows = range(shard * 100, shard * 100 + 100)
        pq.write_table(pa.table({"x": list(rows), "y": [float(r) / 7 for r in rows]}), path)
        files.append(str(path))
    return files


def _stream(files):
    return datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_streaming_dataset_resumes_exactly(parquet_files, workers):
    make = lambda: unbroken.DataLoader(
        _stream(parquet_files).with_format("torch"), batch_size=16, num_workers=workers, seed=0
    )
    batches = sum(1 for _ in make())
    assert batches == (25 if workers == 0 else 26)  # with 2 workers each ends on a partial batch
    cuts = [0, 1, 7, 13, 24, 25, 26, 27, 40, 52]  # start, middle, last batch, epoch ends, epoch 1
    assert assert_resumes_exactly(make, epochs=2, cuts=cuts) == len(cuts)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_exact_shuffle_of_the_stream_resumes_exactly(parquet_files, workers):
    make = lambda: unbroken.DataLoader(
        unbroken.shuffle_buffer(_stream(parquet_files).with_format("torch"), 64, seed=5),
        batch_size=16,
        num_workers=workers,
        seed=0,
    )
    first = [int(x) for batch in make() for x in batch["x"]]
    assert sorted(first) == list(range(400)) and first != sorted(first)
    assert assert_resumes_exactly(make, epochs=2, cuts=[0, 5, 13, 25, 26, 31]) == 6


def test_hf_buffer_shuffle_warns_that_it_is_not_exact(parquet_files):
    shuffled = _stream(parquet_files).shuffle(seed=1, buffer_size=50)
    with pytest.warns(UserWarning, match=r"drops the buffer's contents.*unbroken\.shuffle_buffer"):
        unbroken.DataLoader(shuffled, batch_size=16, seed=0)
