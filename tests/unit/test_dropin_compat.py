"""What code written for torch's DataLoader does with ``unbroken.DataLoader`` (issue 23): each
behaviour is checked against torch's own loader doing the same, and where unbroken adds a
position, against the order computed without the loader.

- ``get_worker_info().dataset`` in ``worker_init_fn`` and in a worker stands in for the
  user's dataset copy: torch's recipe for splitting an ``IterableDataset`` across workers, and
  a map-style dataset configured per worker (fork and spawn);
- ``pickle.dumps(loader)``; ``unbroken.DataLoader[T]``;
- a dataset whose length changes between epochs;
- torch's warning when an ``IterableDataset`` yields more than its ``len()`` said;
- torch's warning of more workers than CPUs, at ``iter()``, once;
- torch's error for a worker killed by a signal.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import json
import math
import os
import pickle
import re
import resource
import signal
import subprocess
import sys
import time
import traceback
import typing
import warnings

import pytest
import torch
from torch.utils.data import get_worker_info

import unbroken
from unbroken.errors import StateMismatch
from unbroken.testing import assert_same

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
    # The copy has no iteration of its own open: it goes on where the original is, as a loader
    # that loaded its state would.
    rest, copied = list(batches), list(copy)
    assert len(copied) == len(rest) > 0
    for got, want in zip(copied, rest):
        assert_same(got, want)
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


# ------------------------------------------------- the iterator: an object, errors, two at once


def _indices(batches) -> list[list[int]]:
    return [b.tolist() for b in batches]


def _epoch(seed: int, epoch: int, n: int = 10, batch_size: int = 3) -> list[list[int]]:
    """An epoch's batches computed without the loader: unbroken's documented shuffle."""
    from unbroken.data import keys
    from unbroken.data.bijection import IndexShuffle

    order = IndexShuffle(n, keys.shuffle(seed, epoch)).range(0, n)
    return [list(order[i : i + batch_size]) for i in range(0, n, batch_size)]


def test_iter_returns_an_iterator_object_with_len_as_torchs():
    loader = unbroken.DataLoader(list(range(10)), batch_size=3, seed=0)
    theirs = iter(torch.utils.data.DataLoader(list(range(10)), batch_size=3))
    ours = iter(loader)
    assert iter(ours) is ours and len(ours) == len(theirs) == 4
    assert not isinstance(ours, typing.Generator)
    assert next(ours).tolist() == next(theirs).tolist() == [0, 1, 2]


def test_workers_start_at_iter_as_torchs(tmp_path):
    started = tmp_path / "started"

    def init(worker_id: int) -> None:
        (started / f"{worker_id}").touch()

    started.mkdir()
    loader = unbroken.DataLoader(
        list(range(8)), batch_size=2, num_workers=2, worker_init_fn=init, seed=0
    )
    batches = iter(loader)
    deadline = time.monotonic() + 60
    while len(list(started.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # no next() yet: the workers run anyway
    assert sorted(p.name for p in started.iterdir()) == ["0", "1"]
    assert _indices(batches) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_between_iter_and_next_restarts_the_started_workers(workers):
    loader = unbroken.DataLoader(
        list(range(10)), batch_size=3, shuffle=True, num_workers=workers, seed=4
    )
    batches = iter(loader)  # started for epoch 0
    loader.set_epoch(5)  # as Lightning does when it resumes
    assert _indices(batches) == _epoch(4, 5)
    saved = {**loader.state_dict(), "epoch": 2, "batches": 1, "samples": 3}
    batches = iter(loader)  # started for epoch 6
    loader.load_state_dict(saved)
    assert _indices(batches) == _epoch(4, 2)[1:]


class Flaky(torch.utils.data.Dataset):
    """Samples 4 and 7 raise: a corrupt record in a dataset."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        if i in (4, 7):
            raise ValueError(f"sample {i} is corrupt")
        return i


def _skip_bad_batches(loader, states=None) -> list:
    """The "skip bad batches" loop written for torch's loader."""
    got, batches = [], iter(loader)
    while True:
        try:
            got.append(next(batches).tolist())
        except StopIteration:
            return got
        except ValueError as error:
            got.append(type(error).__name__)
        if states is not None:
            states.append(json.loads(json.dumps(loader.state_dict())))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_a_batch_propagates_and_the_loop_goes_on_as_with_torch(workers):
    theirs = _skip_bad_batches(
        torch.utils.data.DataLoader(Flaky(), batch_size=3, num_workers=workers)
    )
    states: list = []
    loader = unbroken.DataLoader(Flaky(), batch_size=3, num_workers=workers, seed=0)
    ours = _skip_bad_batches(loader, states)
    assert ours == theirs == [[0, 1, 2], "ValueError", "ValueError", [9]]
    # The failed batch counts as received: a state taken after it resumes at the next batch.
    assert [s["batches"] for s in states] == [1, 2, 3, 4]
    for k, state in enumerate(states[:-1]):
        again = unbroken.DataLoader(Flaky(), batch_size=3, num_workers=workers, seed=0)
        again.load_state_dict(state)
        assert _skip_bad_batches(again) == ours[k + 1 :]


def test_an_error_from_a_worker_is_raised_as_torch_raises_it():
    def message(make):
        with pytest.raises(ValueError) as raised:
            list(make(Flaky(), batch_size=3, num_workers=1))
        # torch's own iterator stays in frames of the traceback, which a cycle keeps (torch's
        # reraise holds its exception): cleared, its worker stops now, not 5 s into a later
        # garbage collection (unbroken.DataLoader clears them itself).
        traceback.clear_frames(raised.tb)
        return str(raised.value)

    theirs, ours = message(_torch), message(_ours)
    assert (
        ours.splitlines()[0]
        == theirs.splitlines()[0]
        == ("Caught ValueError in DataLoader worker process 0.")
    )
    assert "sample 4 is corrupt" in ours and "Traceback" in ours


def test_an_error_in_collate_fn_is_a_failed_batch_too():
    def collate(batch):
        if 5 in batch:
            raise RuntimeError("cannot collate")
        return torch.tensor(batch)

    loader = unbroken.DataLoader(list(range(9)), batch_size=3, collate_fn=collate, seed=0)
    got, batches = [], iter(loader)
    for _ in range(3):
        try:
            got.append(next(batches).tolist())
        except RuntimeError:
            got.append("failed")
    assert got == [[0, 1, 2], "failed", [6, 7, 8]] and loader.state_dict()["batches"] == 3


class StallsOnce(torch.utils.data.Dataset):
    """The worker reading sample 6 stalls past the loader's ``timeout`` (once: it removes
    ``marker`` first)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __len__(self) -> int:
        return 9

    def __getitem__(self, i: int) -> int:
        if i == 6 and get_worker_info() is not None and os.path.exists(self.marker):
            os.remove(self.marker)
            time.sleep(2.5)
        return i


def test_a_failure_outside_the_users_code_leaves_the_position_for_the_next_iteration(tmp_path):
    # torch's timeout is torch's failure, not a batch's (as a worker that dies is: that one
    # torch reports from a SIGCHLD handler at any moment, which a test cannot wait for): the
    # batch does not count, and the next iter() continues from the last batch received, as a
    # resumed run would.
    marker = tmp_path / "stall"
    marker.touch()
    loader = unbroken.DataLoader(StallsOnce(marker), batch_size=3, num_workers=1, timeout=1, seed=0)
    got, said = [], ""
    try:
        for batch in loader:
            got.append(batch.tolist())
    except RuntimeError as error:
        said = str(error)
    assert "DataLoader timed out after 1 seconds" in said
    assert got == [[0, 1, 2], [3, 4, 5]]
    assert loader.state_dict()["batches"] == 2 and loader.epoch == 0
    assert [b.tolist() for b in loader] == [[6, 7, 8]]
    assert loader.epoch == 1


def test_two_iterations_at_once_are_independent_as_with_torch():
    loader = unbroken.DataLoader(list(range(10)), batch_size=3, shuffle=True, seed=8)
    pairs = [(a.tolist(), b.tolist()) for a, b in zip(loader, loader)]
    assert pairs == [(batch, batch) for batch in _epoch(8, 0)]
    theirs = torch.utils.data.DataLoader(list(range(10)), batch_size=3)
    assert [(a.tolist(), b.tolist()) for a, b in zip(theirs, theirs)][0] == ([0, 1, 2], [0, 1, 2])
    assert loader.epoch == 1  # the first of them ran out: its epoch is over


@pytest.mark.parametrize("workers", [0, 2])
def test_a_peek_inside_a_loop_neither_advances_the_loop_nor_moves_its_state(workers):
    loader = unbroken.DataLoader(
        list(range(10)), batch_size=3, shuffle=True, num_workers=workers, seed=8
    )
    got, peeks, states = [], [], []
    for batch in loader:
        peeks.append(next(iter(loader)).tolist())  # e.g. to log one batch
        got.append(batch.tolist())
        states.append(json.loads(json.dumps(loader.state_dict())))
    assert got == _epoch(8, 0) and peeks == [_epoch(8, 0)[0]] * 4
    assert [(s["epoch"], s["batches"]) for s in states] == [(0, 1), (0, 2), (0, 3), (0, 4)]
    for k, state in enumerate(states):  # each state resumes the loop, not the peek
        again = unbroken.DataLoader(list(range(10)), batch_size=3, shuffle=True, seed=8)
        again.load_state_dict(state)
        assert [b.tolist() for b in again] == got[k + 1 :]


def test_a_new_loop_while_an_old_iterator_is_held_reads_the_epoch_whole():
    loader = unbroken.DataLoader(list(range(10)), batch_size=3, shuffle=True, seed=8)
    held = iter(loader)
    next(held)  # e.g. a batch taken to see its shapes, the iterator kept
    assert [b.tolist() for b in loader] == _epoch(8, 0)  # as torch: a whole pass
    assert [b.tolist() for b in loader] == _epoch(8, 1)  # the held one changes nothing now
    next(held)
    assert loader.state_dict()["epoch"] == 2


def test_persistent_workers_taken_over_by_a_newer_iteration_say_so():
    loader = unbroken.DataLoader(
        list(range(10)), batch_size=2, num_workers=1, persistent_workers=True, seed=0
    )
    first = iter(loader)
    next(first)
    second = iter(loader)  # torch resets its one persistent iterator here
    assert next(second).tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="persistent_workers=True"):
        next(first)
    assert [b.tolist() for b in second] == [[2, 3], [4, 5], [6, 7], [8, 9]]


# ------------------------------------------------- torch's warning and error about its workers

TOO_MANY_WORKERS = "This DataLoader will create 2 worker processes in total"


@pytest.fixture
def one_cpu():
    """This process (and the workers it forks) on one CPU: two workers are more than torch
    suggests, whatever the machine (pyproject's filterwarnings ignores the warning elsewhere)."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs os.sched_setaffinity (Linux)")
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    yield
    os.sched_setaffinity(0, cpus)


def _too_many(caught) -> list[str]:
    return [str(w.message) for w in caught if TOO_MANY_WORKERS in str(w.message)]


@pytest.mark.parametrize("between", ["nothing", "set_epoch", "load_state_dict"])
def test_too_many_workers_are_warned_of_at_iter_once_as_by_torch(one_cpu, between):
    """torch warns as it builds a loader and as iter() creates an iterator; never at next(),
    even when a set_epoch or load_state_dict between them makes ours start its workers again."""
    said = {}
    saved = unbroken.DataLoader(list(range(8)), batch_size=2, seed=3)
    next(iter(saved))
    for make in (_torch, _ours):
        with pytest.warns(UserWarning) as built:
            loader = make(list(range(8)), batch_size=2, num_workers=2)
        with pytest.warns(UserWarning) as at_iter:
            batches = iter(loader)
        with warnings.catch_warnings(record=True) as at_next:
            warnings.simplefilter("always")
            if make is _ours and between == "set_epoch":
                loader.set_epoch(1)
            elif make is _ours and between == "load_state_dict":
                loader.load_state_dict(saved.state_dict())
            next(batches)
        assert len(_too_many(built)) == len(_too_many(at_iter)) == 1, make
        assert _too_many(at_next) == [], (make, between)
        # Issued by torch's own code, at its own line: one filter serves both loaders.
        (warning,) = [w for w in at_iter if TOO_MANY_WORKERS in str(w.message)]
        said[make] = (str(warning.message), warning.filename, warning.lineno)
        del batches
    assert said[_ours] == said[_torch]
    assert said[_ours][1].endswith(os.path.join("torch", "utils", "data", "dataloader.py"))


class SegfaultsAt(torch.utils.data.Dataset):
    """Its worker dies of SIGSEGV reading sample ``at`` (torch's worker says so, then dies)."""

    def __init__(self, at: int, tensors: bool) -> None:
        self.at, self.tensors = at, tensors

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        if index == self.at:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
            if self.tensors:  # hold the GIL a moment: the training process is taking the
                ctypes.PyDLL(None).usleep(100_000)  # last batch over from a waiting thread
            os.kill(os.getpid(), signal.SIGSEGV)
        # Strings are sent to the training process whole; a tensor's memory is taken over
        # through a socket of the worker's, which it closes as it dies.
        return torch.full((4,), float(index)) if self.tensors else str(index)


# torch's report of the death, from its SIGCHLD handler or from its check of the workers.
DEATH = re.compile(
    r"DataLoader worker \(pid \d+\) is killed by signal: Segmentation fault\.\s*"
    r"|DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"
)


def _death(make, tensors: bool) -> tuple[type, str]:
    with pytest.raises(Exception) as raised:
        for _ in make(SegfaultsAt(2, tensors), batch_size=1, num_workers=1):
            pass
    error = raised.value
    return type(error), DEATH.sub("DataLoader worker (pid N) ...", str(error))


# torch's SIGCHLD handler may raise its report inside a connection's __del__, which Python
# prints and drops: torch's doing, on either loader (ours then says it in torch's words).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_worker_killed_by_a_signal_is_reported_as_torch_reports_it():
    """Side by side with torch's loader: a RuntimeError with its message. Where a queued batch
    of tensors finds the dying worker's socket closed first, torch's own loader raises a
    ConnectionResetError, ConnectionRefusedError or EOFError instead (here in a third to
    most of such deaths), and its message comes later, into whatever code runs then; ours
    waits for it, every time."""
    theirs = _death(_torch, tensors=False)
    assert theirs == (RuntimeError, "DataLoader worker (pid N) ..."), theirs
    assert _death(_ours, tensors=False) == theirs
    for _ in range(8):  # a race: each is another chance for the connection to break first
        assert _death(_ours, tensors=True) == theirs
    time.sleep(0.3)  # and no report of the death comes later, into whatever code runs then
    gc.collect()  # torch's iterator, which the traceback kept, waits for its worker


def _dead_child(name: bytes) -> int:
    """A child process named ``name`` that died of SIGSEGV, not yet waited for."""
    gc.collect()  # iterators that earlier tests' tracebacks kept: their dead workers are waited for
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        faulthandler.disable()  # pytest's: it would print this process's stack
        ctypes.CDLL(None).prctl(15, name)  # PR_SET_NAME, as torch names its workers
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), signal.SIGSEGV)
    deadline = time.monotonic() + 30
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return pid


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, prctl")
def test_a_dead_worker_whose_report_torch_lost_is_reported_in_torchs_words(monkeypatch):
    """torch reports a death once, from its SIGCHLD handler, wherever the main thread is: in a
    __del__, the report is printed and dropped, and torch will not repeat it. A loader worker
    found dead then is reported in torch's words; another child (the user's) is not taken for
    one, and the broken connection is raised as it was."""
    from unbroken.data import workers

    monkeypatch.setattr(workers, "DEATH_WAIT", 0.2)
    broken = ConnectionResetError(104, "Connection reset by peer")
    pid = _dead_child(b"pt_data_worker")
    try:
        with pytest.raises(RuntimeError) as raised:
            workers.await_death_report(broken)
    finally:
        os.waitpid(pid, 0)
    assert str(raised.value) == f"DataLoader worker (pid {pid}) is killed by signal: " + (
        "Segmentation fault. "
    )
    pid = _dead_child(b"python")
    try:
        workers.await_death_report(broken)  # returns: the caller raises the error itself
    finally:
        os.waitpid(pid, 0)
