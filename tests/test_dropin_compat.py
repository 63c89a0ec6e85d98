"""What code written for torch's DataLoader does with ``unbroken.DataLoader`` (issue 23): each
behaviour is checked against torch's own loader doing the same, and where unbroken adds a
position, against the order computed without the loader.

- ``get_worker_info().dataset`` in ``worker_init_fn`` and in a worker stands in for the
  user's dataset copy: torch's recipe for splitting an ``IterableDataset`` across workers, and
  a map-style dataset configured per worker (fork and spawn);
- ``pickle.dumps(loader)``; ``unbroken.DataLoader[T]``;
- a dataset whose length changes between epochs;
- torch's warning when an ``IterableDataset`` yields more than its ``len()`` said.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import subprocess
import sys
import time
import typing
import warnings

import pytest
import torch
from torch.utils.data import get_worker_info

import unbroken
from unbroken.errors import StateMismatch

CONTEXTS = ["fork", "spawn"]


def _torch(dataset, **kwargs):
    return torch.utils.data.DataLoader(dataset, **kwargs)


def _ours(dataset, **kwargs):
    return unbroken.DataLoader(dataset, seed=3, **kwargs)


# ------------------------------------------------------------------ get_worker_info().dataset


class Range(torch.utils.data.IterableDataset):
    """torch's documented example: [start, end), split across workers in worker_init_fn."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def split_range(worker_id: int) -> None:  # torch's recipe, as its documentation writes it
    info = get_worker_info()
    dataset = info.dataset  # the dataset copy in this worker process
    assert isinstance(dataset, Range), type(dataset)
    start, end = dataset.start, dataset.end
    per_worker = int(math.ceil((end - start) / float(info.num_workers)))
    dataset.start = start + worker_id * per_worker
    dataset.end = min(dataset.start + per_worker, end)


class PerWorker(torch.utils.data.Dataset):
    """A map-style dataset configured per worker: each sample says which worker read it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        info = get_worker_info()
        assert isinstance(info.dataset, PerWorker) and info.dataset.value == self.value
        return {"index": i, "worker": self.value}


def configure(worker_id: int) -> None:
    dataset = get_worker_info().dataset
    assert isinstance(dataset, PerWorker)
    assert not hasattr(dataset, "value")  # a fresh copy, nothing set yet
    dataset.value = 100 + worker_id


@pytest.mark.parametrize("context", CONTEXTS)
def test_torchs_recipe_splits_an_iterable_dataset_across_workers(context):
    kwargs = {"num_workers": 2, "worker_init_fn": split_range, "multiprocessing_context": context}
    theirs = [int(x) for x in _torch(Range(3, 10), **kwargs)]
    ours = [int(x) for x in _ours(Range(3, 10), **kwargs)]
    assert sorted(theirs) == sorted(ours) == list(range(3, 10))  # each once: split, not copied
    assert ours == theirs  # and the workers' turns interleave as torch's do


@pytest.mark.parametrize("context", CONTEXTS)
def test_a_map_style_dataset_configured_in_worker_init_fn_is_configured(context):
    kwargs = {"batch_size": 2, "num_workers": 2, "worker_init_fn": configure}
    kwargs["multiprocessing_context"] = context
    theirs = [b["worker"].tolist() for b in _torch(PerWorker(), **kwargs)]
    ours = [b["worker"].tolist() for b in _ours(PerWorker(), **kwargs)]
    assert ours == theirs == [[100, 100], [101, 101], [100, 100], [101, 101]]


def test_the_stand_in_keeps_its_own_attributes_apart_from_the_users():
    # A dataset with attributes named like unbroken's wrapper's would-be fields: they are the
    # user's, read and written in the worker as on the dataset itself.
    class Wrapping(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.dataset, self.batch_size, self.plan = list(range(6)), "user's", "user's"

        def __len__(self) -> int:
            return len(self.dataset)

        def __getitem__(self, i: int):
            return self.dataset[i]

    def check(worker_id: int) -> None:
        dataset = get_worker_info().dataset
        assert dataset.dataset == list(range(6)) and dataset.plan == "user's"
        dataset.dataset = [10 * x for x in range(6)]

    loader = unbroken.DataLoader(
        Wrapping(), batch_size=3, num_workers=1, worker_init_fn=check, seed=0
    )
    assert [b.tolist() for b in loader] == [[0, 10, 20], [30, 40, 50]]


# ---------------------------------------------------------------------------- pickle, typing


def _pickled_loaders():
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0))
    yield "shuffled", unbroken.DataLoader(dataset, batch_size=3, shuffle=True, seed=1)
    yield "workers", unbroken.DataLoader(dataset, batch_size=3, num_workers=2, seed=1)
    yield "stream", unbroken.DataLoader(Range(0, 7), batch_size=3, seed=1)
    yield "sampler", unbroken.DataLoader(dataset, batch_size=3, sampler=list(range(10)), seed=1)


@pytest.mark.parametrize("name", ["shuffled", "workers", "stream", "sampler"])
def test_a_loader_pickles_and_the_copy_goes_on_from_the_same_state(name):
    loader = dict(_pickled_loaders())[name]
    batches = iter(loader)
    next(batches)
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.state_dict() == loader.state_dict()
    del batches
    rest = [b for b in loader]
    assert [
        torch.equal(a[0], b[0]) if isinstance(a, list) else torch.equal(a, b)
        for a, b in zip([b for b in copy], rest)
    ] == [True] * len(rest)
    if name == "shuffled":  # the copy's sampler is a view of the copy, not of the original
        assert copy.sampler._loader_ref() is copy
        assert list(copy.sampler) == list(loader.sampler)


def test_the_loader_is_generic_like_torchs():
    alias = unbroken.DataLoader[torch.Tensor]
    assert typing.get_origin(alias) is unbroken.DataLoader
    assert typing.get_args(alias) == (torch.Tensor,)

    def train(loader: unbroken.DataLoader[dict]) -> int:  # annotations evaluate
        return len(loader)

    assert typing.get_type_hints(train)["loader"] == unbroken.DataLoader[dict]


# ------------------------------------------------------------- a dataset that changes length


class Growing(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        assert 0 <= i < self.n, f"index {i} of a dataset of {self.n}"
        return i


def test_a_dataset_that_grows_between_epochs_is_read_whole_at_the_next_epoch():
    dataset = Growing(10)
    loader = unbroken.DataLoader(dataset, batch_size=4, shuffle=True, seed=5)
    theirs = torch.utils.data.DataLoader(dataset, batch_size=4)
    epochs = []
    for n in (10, 13, 7):
        dataset.n = n
        assert len(loader) == len(theirs) == math.ceil(n / 4)
        epochs.append([int(i) for b in loader for i in b])
        assert sorted(epochs[-1]) == list(range(n))
    # Each epoch is the order of a loader built over the dataset at that length.
    for epoch, n in enumerate((10, 13, 7)):
        fresh = unbroken.DataLoader(Growing(n), batch_size=4, shuffle=True, seed=5)
        fresh.set_epoch(epoch)
        assert [int(i) for b in fresh for i in b] == epochs[epoch]


def test_a_state_resumes_only_on_the_length_it_was_saved_with():
    dataset = Growing(10)
    loader = unbroken.DataLoader(dataset, batch_size=4, shuffle=True, seed=5)
    list(loader)
    dataset.n = 13
    batches = iter(loader)
    next(batches)
    dataset.n = 20  # changed mid-epoch: this epoch is still ordered over 13
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["fingerprint"]["dataset_length"] == 13
    rest = [b.tolist() for b in batches]
    again = unbroken.DataLoader(Growing(13), batch_size=4, shuffle=True, seed=5)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == rest
    with pytest.raises(StateMismatch, match="dataset_length"):
        unbroken.DataLoader(Growing(10), batch_size=4, shuffle=True, seed=5).load_state_dict(state)


# ------------------------------------------------- an IterableDataset longer than its len()


class Overlong(torch.utils.data.IterableDataset):
    def __len__(self) -> int:
        return 3

    def __iter__(self):
        return iter(range(5))


def _warnings(make, ask_len: bool) -> list[str]:
    loader = make(Overlong(), batch_size=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ask_len:
            assert len(loader) == 3
        for _ in loader:
            pass
    said = [str(w.message) for w in caught if "Length of IterableDataset" in str(w.message)]
    return [re.sub(r" at 0x[0-9a-f]+", "", message) for message in said]  # another object


def test_a_stream_longer_than_its_len_warns_as_torch_does():
    theirs, ours = _warnings(_torch, True), _warnings(_ours, True)
    assert len(ours) == len(theirs) == 2  # at the 4th and the 5th item
    assert ours == theirs
    assert "was reported to be 3" in ours[0] and "4 samples have been fetched" in ours[0]
    assert _warnings(_ours, False) == _warnings(_torch, False) == []  # len() never asked


# ------------------------------------------- a worker whose training process was SIGKILLed

_ORPHAN = """
import os, sys, time
from unbroken.data.workers import worker_init

parent_alive = sys.argv[1] == "alive"
init = worker_init(None)  # made in the training process, as the loader makes it
reader, writer = os.pipe()
child = os.fork()
if child == 0:  # the worker
    init(0)  # what the loader's workers run first
    os.read(reader, 1)  # the training process has been killed (or not)
    # What multiprocessing's resource sharer does when the training process it was sending
    # a batch's tensors to dies: it reports the broken connection through sys.excepthook.
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        sys.excepthook(*sys.exc_info())
    sys.stderr.write("reported\\n")
    os._exit(3)
if parent_alive:
    os.write(writer, b"x")
    os.waitpid(child, 0)
else:  # the training process dies; the worker hears of it as it is torn down
    os.write(writer, b"x")
    os._exit(0)
"""


@pytest.mark.parametrize("training_process", ["killed", "alive"])
def test_a_worker_whose_training_process_died_exits_without_a_traceback(tmp_path, training_process):
    log = tmp_path / "stderr"
    with open(log, "w") as err:
        subprocess.run(
            [sys.executable, "-c", _ORPHAN, training_process], stderr=err, check=True, timeout=600
        )
        deadline = time.monotonic() + 60
        while training_process == "killed" and time.monotonic() < deadline:
            time.sleep(0.2)  # the orphaned worker outlives the process we waited for
            if "reported" in log.read_text() or _exited_quietly(log):
                break
    said = log.read_text()
    if training_process == "killed":
        assert "Traceback" not in said and "reported" not in said, said
    else:  # a live training process: a connection error is a real one, and is reported
        assert "ConnectionResetError" in said and "reported" in said, said


def _exited_quietly(log) -> bool:
    alive = subprocess.run(
        ["pgrep", "-f", "unbroken.data.workers import worker_init"], capture_output=True
    )
    return alive.returncode != 0
