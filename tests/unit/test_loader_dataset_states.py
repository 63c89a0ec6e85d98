"""Datasets' own states as torchdata's tests write them: non-str keys, state set up in __iter__,
unsaveable states, and streams that became shorter than the saved position."""

import functools
import gc
import json
import multiprocessing
import multiprocessing.util
import weakref

import pytest
import torch
from pipelines import Positioned
from torch.utils.data import IterableDataset, Sampler, get_worker_info

import unbroken
from unbroken.testing import assert_resumes_exactly

REPLAY_WARNING = r"ignore:.*O\(k\):UserWarning"


def _shard(n):
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info else (0, 1)
    return list(range(worker, n, workers))


class IntKeyed(IterableDataset):
    """Like torchdata's test datasets: ``state_dict()`` keyed by ints (and other non-str keys).
    ``load_state_dict`` refuses keys whose type changed on the way."""

    KEYS = (0, 1, 2.5, None, (3, "a"), "name")

    def __init__(self, n):
        self.n, self.position, self.epoch = n, 0, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        shard = _shard(self.n)
        while self.position < len(shard):
            self.position += 1
            yield torch.tensor([shard[self.position - 1], self.epoch])

    def state_dict(self):
        return {
            0: self.position,
            1: self.epoch,
            2.5: [1.5],
            None: None,
            (3, "a"): {True: 1},
            "name": "x",
        }

    def load_state_dict(self, state):
        keys = [(type(key), key) for key in state]
        nested = [(type(key), key) for key in state[(3, "a")]]
        if keys != [(type(key), key) for key in self.KEYS] or nested != [(bool, True)]:
            raise AssertionError(f"keys changed on the way: {keys}")
        self.position, self.epoch = state[0], state[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_state_with_non_str_keys_iterates_and_resumes_exactly(workers):
    def make():
        return unbroken.DataLoader(IntKeyed(9), batch_size=2, num_workers=workers, seed=0)

    assert len(list(make())) == 5
    cuts = None if workers == 0 else [0, 2, 5, 9]
    assert assert_resumes_exactly(make, epochs=2, cuts=cuts)
    loader = make()
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain JSON


class IterationState:
    def __init__(self, start, end):
        self.curr, self.end = start, end


class CountIterCallsIter(IterableDataset):
    """torchdata's pattern: the iteration state is created in ``__iter__`` (which returns the
    dataset itself), and ``state_dict``/``load_state_dict`` read and write it."""

    def __init__(self, length):
        self.length, self.iter_calls = length, 0

    def __iter__(self):
        self.iter_calls += 1
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        per_worker = self.length // workers
        self.iter_state = IterationState(per_worker * worker, per_worker * (worker + 1))
        return self

    def __next__(self):
        if self.iter_state.curr >= self.iter_state.end:
            raise StopIteration
        self.iter_state.curr += 1
        return self.iter_state.curr - 1

    def state_dict(self):
        return {
            "curr": self.iter_state.curr,
            "end": self.iter_state.end,
            "iter_calls": self.iter_calls,
        }

    def load_state_dict(self, state):
        self.iter_state.curr, self.iter_state.end = state["curr"], state["end"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_sets_up_its_state_in_iter_resumes_mid_epoch_exactly(workers):
    make = lambda: unbroken.DataLoader(
        CountIterCallsIter(12), batch_size=2, num_workers=workers, seed=0
    )
    first = [batch.tolist() for batch in make()]
    assert sorted(sum(first, [])) == list(range(12))
    cuts = None if workers == 0 else [0, 1, 4, 6, 7, 10]
    assert assert_resumes_exactly(make, epochs=2, cuts=cuts)
    # Every epoch yields the whole dataset: a fresh epoch starts from what __iter__ sets up.
    loader = make()
    epochs = [sorted(sum((b.tolist() for b in loader), [])) for _ in range(2)]
    assert epochs == [list(range(12))] * 2


@pytest.mark.parametrize("workers", [0, 2])
def test_each_fresh_epoch_starts_from_the_state_as_constructed(workers):
    loader = unbroken.DataLoader(Positioned(7, 3), batch_size=2, num_workers=workers, seed=0)
    epochs = [sorted(sum((b.tolist() for b in loader), [])) for _ in range(3)]
    expected = [3, 4, 5, 6] if workers == 0 else [3, 3, 4, 4, 5, 5, 6, 6]  # a replica per worker
    assert epochs == [expected] * 3


class Unsaveable(IterableDataset):
    def __init__(self, n):
        self.n, self.position = n, 0

    def __iter__(self):
        while self.position < self.n:
            self.position += 1
            yield self.position - 1

    def state_dict(self):
        return {"position": self.position, "handle": object(), frozenset({1}): 0}

    def load_state_dict(self, state):
        self.position = state["position"]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_unsaveable_dataset_state_fails_only_at_state_dict_naming_its_key(workers):
    loader = unbroken.DataLoader(Unsaveable(6), batch_size=2, num_workers=workers, seed=0)
    assert loader.state_dict()["epoch"] == 0  # nothing received yet: nothing to encode
    batches = []
    for batch in loader:  # iterating works
        batches.append(batch)
        with pytest.raises(
            ValueError,
            match=r"dataset\.state_dict\(\)\.handle: a builtins\.object "
            "cannot be saved as JSON",
        ):
            loader.state_dict()
    assert len(batches) == (3 if workers == 0 else 6)
    assert loader.state_dict()["epoch"] == 1  # after the epoch: saveable again


class UnsaveableSampler(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n

    def state_dict(self):
        return {frozenset({1}): 0}

    def load_state_dict(self, state):
        pass


def test_an_unsaveable_sampler_state_fails_only_at_state_dict_naming_its_key():
    loader = unbroken.DataLoader(list(range(5)), batch_size=2, sampler=UnsaveableSampler(5), seed=0)
    batches = []
    for batch in loader:
        batches.append(batch)
        with pytest.raises(
            ValueError,
            match=r"sampler\.state_dict\(\): key frozenset\(\{1\}\) "
            "is a frozenset",
        ):
            loader.state_dict()
    assert len(batches) == 3


class Replayed(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(_shard(self.n))


class SamplerPattern(IterableDataset):
    def __init__(self, n):
        self.n, self.sampler = n, None

    def __iter__(self):
        self.sampler = _shard(self.n)
        self.sampler_iter = iter(self.sampler)
        return self

    def __next__(self):
        return next(self.sampler_iter)


def _shorter_than_saved(cls, workers):
    """A loader of a 3-item ``cls`` stream given the state of one that yielded 8 items."""
    loader = unbroken.DataLoader(cls(12), batch_size=2, num_workers=workers, seed=0)
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    state = loader.state_dict()
    iterator.close()
    shorter = unbroken.DataLoader(cls(3), batch_size=2, num_workers=workers, seed=0)
    shorter.load_state_dict(state)
    return shorter


@pytest.mark.filterwarnings(REPLAY_WARNING)
@pytest.mark.parametrize("cls", [Replayed, SamplerPattern])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateless_stream_shorter_than_the_saved_position_is_a_clear_error(cls, workers):
    shorter = _shorter_than_saved(cls, workers)
    match = (
        r"the state says worker 0 of .* had (yielded \d+ items|drawn \d+ sampler indices) "
        r"this epoch, but it now yields only \d+; .*not deterministic, or shorter"
    )
    with pytest.raises(ValueError, match=match):
        list(shorter)


@pytest.mark.filterwarnings(REPLAY_WARNING)
def test_an_iteration_a_workers_error_ended_stops_its_workers_while_the_error_is_held():
    """The error keeps its traceback, as pytest, a debugger or a retry loop keep it, and no
    garbage collection comes: the iteration's workers are stopped before it reaches the loop.
    Left to a collection, each would cost a 5 s join at whatever step the collection came."""
    shorter = _shorter_than_saved(SamplerPattern, 2)
    before = set(multiprocessing.active_children())
    gc.disable()
    try:
        with pytest.raises(ValueError, match="shorter") as held:
            list(shorter)
        left = set(multiprocessing.active_children()) - before
    finally:
        gc.enable()
    assert held.value.__traceback__ is not None
    assert not left, left


def test_a_failed_iteration_leaves_no_cycle_that_holds_its_loader():
    """Once the error that ended an iteration on workers is dropped, nothing of the library's
    holds the loader: dropped by the user, it and its persistent workers go at once. A cycle
    would keep them to a garbage collection, which then waits 5 s for each worker."""
    loader = unbroken.DataLoader(
        list(range(10)), batch_size=2, num_workers=1, persistent_workers=True, seed=0
    )
    before = set(multiprocessing.active_children())
    gc.disable()
    try:
        first = iter(loader)
        next(first)
        second = iter(loader)  # takes the persistent workers over: first fails at its next
        next(second)
        with pytest.raises(RuntimeError, match="persistent_workers=True"):
            next(first)
        assert [b.tolist() for b in second] == [[2, 3], [4, 5], [6, 7], [8, 9]]
        dropped = weakref.ref(loader)
        del loader, first, second
        alive = dropped() is not None
        left = set(multiprocessing.active_children()) - before
    finally:
        gc.enable()
    assert not alive, "a cycle holds the loader"
    assert not left, left


class _RaisesAt(torch.utils.data.Sampler):
    """Yields 0..39, and raises ``error`` in place of ``at``."""

    def __init__(self, at, error):
        self.at, self.error = at, error

    def __len__(self):
        return 40

    def __iter__(self):
        for index in range(40):
            if index == self.at:
                raise self.error
            yield index


def test_stopping_the_workers_of_a_failed_iteration_leaves_the_users_frames_alone():
    """Only torch's frames of the error's traceback are cleared. A sampler raising an error
    kept from earlier keeps the locals of its frame, and the user's generator that kept the
    error, paused since, goes on: its frame is in that traceback too."""
    kept = []

    def paused():
        try:
            raise KeyError("kept")
        except KeyError as error:
            kept.append(error)
        yield "a"
        yield "b"

    generator = paused()
    assert next(generator) == "a"
    loader = unbroken.DataLoader(
        list(range(40)), batch_size=2, sampler=_RaisesAt(15, kept[0]), num_workers=2, seed=0
    )
    with pytest.raises(KeyError, match="kept") as held:
        list(loader)
    assert next(generator) == "b"
    entry, sampler_locals = held.value.__traceback__, None
    while entry is not None:
        if entry.tb_frame.f_code is _RaisesAt.__iter__.__code__:
            sampler_locals = entry.tb_frame.f_locals
        entry = entry.tb_next
    assert sampler_locals is not None and sampler_locals["index"] == 15


def _note_a_clean_exit(directory, worker_id):
    """worker_init_fn: the worker writes a file named for it if it exits by its loop's end;
    killed (or ended by the SIGTERM torch sends when a join timed out), it writes none."""
    note = (directory / str(worker_id)).touch
    multiprocessing.util.Finalize(None, note, exitpriority=0)


def test_an_iteration_the_garbage_collector_frees_stops_its_workers_at_once(tmp_path):
    """An iteration caught in a reference cycle is freed by a collection. Its workers must
    end as told (the loop's end) within that collection, not be terminated after a join that
    timed out because the collection had closed their queues first."""
    loader = unbroken.DataLoader(
        list(range(12)),
        batch_size=2,
        num_workers=2,
        seed=0,
        worker_init_fn=functools.partial(_note_a_clean_exit, tmp_path),
    )
    iterator = iter(loader)
    next(iterator)
    cycle = {"iterator": iterator}
    cycle["itself"] = cycle
    del iterator, cycle
    gc.collect()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["0", "1"]


@pytest.mark.filterwarnings(REPLAY_WARNING)
def test_a_resumable_shorter_than_the_saved_position_is_a_clear_error():
    def generator(n):
        yield from range(n)

    stream = unbroken.resumable(lambda epoch: generator(10))
    iterator = iter(stream)
    for _ in range(7):
        next(iterator)
    shorter = unbroken.resumable(lambda epoch: generator(3))
    shorter.load_state_dict(stream.state_dict())
    with pytest.raises(
        ValueError,
        match="7 items of epoch 0 were received, but the re-made generator yields only 3",
    ):
        list(shorter)
