"""An independent oracle: each uninterrupted stream checked against a reference built without it.

Resume tests compare an interrupted run with the loader's own uninterrupted run, so a bug that
changes both (an epoch-blind shuffle, a dataset's ``__getitems__`` ignored) passes them. Here
the uninterrupted stream itself is checked against what the README promises, computed by hand:

- map-style: every epoch is a permutation (or its drop_last prefix) in whole batches, a pure
  function of (seed, epoch) that changes with both; each batch's global generators are seeded
  from (seed, epoch, its first position) and its samples draw in turn, whatever
  ``num_workers``; ``sample_seed()``/``sample_rng()`` follow the sample's own position;
- user samplers and batch samplers: the loader's order is the sampler's own;
- iterable datasets: the dataset iterated directly, batched, and with workers torch's
  round-robin over the per-worker batches;
- ``CombinedLoader``: each mode's definition applied to plain lists of the children's batches;
- what a resume must not do: read samples it skips, or walk the skipped prefix (O(k)).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pipelines import Stateless
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import unbroken
from unbroken.data.bijection import IndexShuffle
from unbroken.data.combined import MODES, CombinedLoader
from unbroken.data.keys import derive_key
from unbroken.data.rng import batch_seeds, sample_rng_seed, sample_seed_at
from unbroken.data.sources.orders import _BLOCK


def _as_list(items):
    return list(items)  # collate: keep the samples (a sample_seed() needs 64 unsigned bits)


def _as_batch(sample):
    return [sample]  # batch_size=None: each sample as a batch of one


class Probe(Dataset):
    """Each sample: its index, its sample_seed() and what it drew from every generator."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return {
            "index": index,
            "seed": unbroken.sample_seed(),
            "torch": torch.rand(2).tolist(),
            "numpy": np.random.rand(2).tolist(),
            "random": random.random(),
            "own": torch.rand(2, generator=unbroken.sample_rng()).tolist(),
        }


def _batch_draws(key, first, count):
    """What the batch of ``count`` samples starting at position ``first`` draws from the global
    generators, computed apart: seeded once from its first position, then drawn in turn."""
    torch_seed, numpy_seed, random_seed = batch_seeds(key, first)
    torch_gen = torch.Generator().manual_seed(torch_seed)
    numpy_gen, random_gen = np.random.RandomState(numpy_seed), random.Random(random_seed)
    return [
        {
            "torch": torch.rand(2, generator=torch_gen).tolist(),
            "numpy": numpy_gen.rand(2).tolist(),
            "random": random_gen.random(),
        }
        for _ in range(count)
    ]


def _run(n, batch_size, shuffle, drop_last, seed, workers=0, epochs=3, **kw):
    loader = unbroken.DataLoader(
        Probe(n),
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        seed=seed,
        num_workers=workers,
        collate_fn=_as_list if batch_size is not None else _as_batch,
        **kw,
    )
    return loader, [list(loader) for _ in range(epochs)]


def _check_epoch(batches, n, batch_size, shuffle, drop_last, seed, epoch):
    """One epoch of a map-style loader against the README's contract, computed by hand."""
    step = batch_size or 1
    count = n - n % step if drop_last else n
    sizes = [len(batch) for batch in batches]
    assert sizes == [step] * (count // step) + ([count % step] if count % step else []), sizes
    samples = [sample for batch in batches for sample in batch]
    indices = [sample["index"] for sample in samples]
    if not shuffle:
        assert indices == list(range(count))
    else:
        assert len(set(indices)) == count and set(indices) <= set(range(n))
        if not drop_last:
            assert sorted(indices) == list(range(n))
    key, position = derive_key(seed, epoch), 0
    for batch in batches:
        # The documented derivation: the batch seeded from its first position, whatever indices.
        expected = _batch_draws(key, position, len(batch))
        for sample, draws in zip(batch, expected):
            assert sample["seed"] == sample_seed_at(key, position), f"epoch {epoch} {position}"
            got = {name: sample[name] for name in ("torch", "numpy", "random")}
            assert got == draws, f"epoch {epoch} position {position}"
            own = torch.Generator().manual_seed(sample_rng_seed(key, position))
            assert sample["own"] == torch.rand(2, generator=own).tolist()
            assert sample["own"] != sample["torch"]  # sample_rng() is a stream of its own
            position += 1
    return indices


@given(
    n=st.integers(0, 40),
    batch_size=st.integers(1, 8),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
)
@settings(max_examples=40)
def test_a_map_style_stream_is_what_the_contract_says(n, batch_size, shuffle, drop_last, seed):
    loader, epochs = _run(n, batch_size, shuffle, drop_last, seed)
    assert [len(batches) for batches in epochs] == [len(loader)] * 3
    orders = [
        _check_epoch(batches, n, batch_size, shuffle, drop_last, seed, epoch)
        for epoch, batches in enumerate(epochs)
    ]
    # Samples are a pure function of (seed, epoch, position, batch size): a fresh loader told
    # the epoch repeats them, and drop_last only cuts the epoch short.
    fresh = unbroken.DataLoader(
        Probe(n), batch_size=batch_size, shuffle=shuffle, seed=seed, collate_fn=_as_list
    )
    fresh.set_epoch(2)
    last = [s for batch in epochs[2] for s in batch]
    assert [s for batch in fresh for s in batch][: len(last)] == last
    seeds = [s["seed"] for batches in epochs for batch in batches for s in batch]
    assert len(set(seeds)) == len(seeds)  # each (epoch, position) draws its own numbers
    if shuffle and n >= 12:  # two equal orders of >= 8 of 12 items: odds below 1 in 10**7
        assert len({tuple(order) for order in orders}) == 3, "epochs repeat one order"
        _, other = _run(n, batch_size, shuffle, drop_last, seed ^ 1, epochs=1)
        assert [s["index"] for batch in other[0] for s in batch] != orders[0], "seed ignored"


@pytest.mark.parametrize(
    "n, batch_size, shuffle, drop_last, seed, persistent",
    [
        (23, 4, True, False, 7, True),
        (17, 3, False, True, 2**64 - 1, False),
        (9, None, True, False, 1, False),
    ],
)
def test_a_map_style_stream_with_workers_is_what_the_contract_says(
    n, batch_size, shuffle, drop_last, seed, persistent
):
    loader, epochs = _run(
        n, batch_size, shuffle, drop_last, seed, workers=2, epochs=2, persistent_workers=persistent
    )
    orders = [
        _check_epoch(batches, n, batch_size, shuffle, drop_last, seed, epoch)
        for epoch, batches in enumerate(epochs)
    ]
    if shuffle:
        assert orders[0] != orders[1]
    # Every sample (index and draws, sample_rng()'s too) as in process.
    _, in_process = _run(n, batch_size, shuffle, False, seed, epochs=2)
    for batches, reference in zip(epochs, in_process):
        samples = [s for batch in batches for s in batch]
        assert samples == [s for batch in reference for s in batch][: len(samples)]


def test_randomness_follows_the_position_not_the_index():
    # Shuffled or not, position p of epoch e draws the same numbers: seeds of (seed, e, p).
    _, ordered = _run(16, 4, False, False, 5, epochs=2)
    _, shuffled = _run(16, 4, True, False, 5, epochs=2)
    for a, b in zip(ordered, shuffled):
        strip = lambda batches: [
            {k: v for k, v in s.items() if k != "index"} for batch in batches for s in batch
        ]
        assert strip(a) == strip(b)
    assert [s["index"] for s in shuffled[0][0]] != [0, 1, 2, 3]


# --- user samplers and batch samplers ----------------------------------------------------------


class UnevenBatches(torch.utils.data.Sampler):
    """Batches of 1, 2, 3, 1, 2, ... indices, reversed every other epoch."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(list(iter(self)))

    def __iter__(self):
        start, size, order = 0, 1, list(range(self.n))
        if self.epoch % 2:
            order.reverse()
        while start < self.n:
            yield order[start : start + size]
            start, size = start + size, size % 3 + 1


@given(n=st.integers(0, 20), batch_size=st.integers(1, 4), drop_last=st.booleans())
@settings(max_examples=15)
def test_a_user_sampler_order_is_the_samplers_own(n, batch_size, drop_last):
    loader = unbroken.DataLoader(
        Probe(n),
        batch_size=batch_size,
        sampler=Stateless(n),
        drop_last=drop_last,
        seed=0,
        collate_fn=_as_list,
    )
    for epoch in range(2):
        sampler = Stateless(n)
        sampler.set_epoch(epoch)
        order = list(sampler)
        expected = [order[i : i + batch_size] for i in range(0, n, batch_size)]
        if drop_last and n % batch_size:
            expected.pop()
        assert [[s["index"] for s in batch] for batch in loader] == expected


def test_a_user_batch_sampler_order_is_the_samplers_own():
    loader = unbroken.DataLoader(
        Probe(11), batch_sampler=UnevenBatches(11), seed=0, collate_fn=_as_list
    )
    for epoch in range(2):
        sampler = UnevenBatches(11)
        sampler.set_epoch(epoch)
        assert [[s["index"] for s in batch] for batch in loader] == list(sampler)


# --- a dataset's own __getitems__ --------------------------------------------------------------


def _log(directory, line):
    """One line per event, from any process (O_APPEND writes this short are not interleaved)."""
    with open(os.path.join(directory, "events"), "a") as file:
        file.write(f"{line}\n")


def _events(directory):
    path = os.path.join(directory, "events")
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return file.read().split()


class BatchedReads(Dataset):
    """Reads a whole batch per call; each call logs itself and tags its items with its seed."""

    def __init__(self, n, directory):
        self.n, self.directory = n, directory

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return {"index": index, "via": "__getitem__"}

    def __getitems__(self, indices):
        _log(self.directory, "call")
        seed, draws = unbroken.sample_seed(), torch.rand(len(indices)).tolist()
        return [
            {"index": i, "via": "__getitems__", "seed": seed, "draw": d}
            for i, d in zip(indices, draws)
        ]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_datasets_own_getitems_is_called_once_per_batch_and_seeded(tmp_path, workers):
    loader = unbroken.DataLoader(
        BatchedReads(10, str(tmp_path)),
        batch_size=3,
        shuffle=True,
        num_workers=workers,
        seed=4,
        collate_fn=_as_list,
    )
    epochs = [list(loader) for _ in range(2)]
    assert _events(tmp_path) == ["call"] * 8  # 4 batches an epoch, one call each
    for epoch, batches in enumerate(epochs):
        for number, batch in enumerate(batches):
            assert {s["via"] for s in batch} == {"__getitems__"}
            # Seeded from the batch's first position: the seeds of (4, epoch, 3 * number).
            key = derive_key(4, epoch)
            seed = sample_seed_at(key, 3 * number)
            assert [s["seed"] for s in batch] == [seed] * len(batch)
            torch_seed = batch_seeds(key, 3 * number)[0]
            expected = torch.rand(len(batch), generator=torch.Generator().manual_seed(torch_seed))
            assert [s["draw"] for s in batch] == expected.tolist()
    # A resume continues with the same calls: batch 2 of epoch 1, seeded as in the full run.
    saved = unbroken.DataLoader(
        BatchedReads(10, str(tmp_path)), batch_size=3, shuffle=True, seed=4, collate_fn=_as_list
    )
    saved.set_epoch(1)
    iterator = iter(saved)
    next(iterator), next(iterator)
    resumed = unbroken.DataLoader(
        BatchedReads(10, str(tmp_path)),
        batch_size=3,
        shuffle=True,
        num_workers=workers,
        seed=4,
        collate_fn=_as_list,
    )
    resumed.load_state_dict(saved.state_dict())
    assert list(resumed) == epochs[1][2:]


# --- iterable datasets -------------------------------------------------------------------------


class _Sharded(IterableDataset):
    """Shards range(n) by worker; ``as_worker`` lets a test iterate one worker's share directly."""

    def __init__(self, n):
        self.n, self.epoch, self.as_worker = n, 0, None

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _shard(self):
        info = get_worker_info()
        worker, workers = self.as_worker or ((info.id, info.num_workers) if info else (0, 1))
        shard = list(range(worker, self.n, workers))
        return shard[::-1] if self.epoch % 2 else shard  # every other epoch, another order


class StatefulKind(_Sharded):
    def __init__(self, n):
        super().__init__(n)
        self.position = 0

    def __iter__(self):
        shard = self._shard()
        while self.position < len(shard):
            self.position += 1
            yield torch.tensor(shard[self.position - 1])

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class SamplerKind(_Sharded):
    """Lightning's pattern: ``__next__`` draws an index from ``sampler_iter`` and reads it."""

    sampler = None

    def __iter__(self):
        self.sampler = self._shard()
        self.sampler_iter = iter(self.sampler)
        return self

    def __next__(self):
        return torch.tensor(next(self.sampler_iter))


class ReplayedKind(_Sharded):
    def __iter__(self):
        return (torch.tensor(i) for i in self._shard())


class RangeKind(_Sharded):
    """A global-cursor stream: workers read global batches, so no sharding of its own."""

    def read_range(self, start, stop):
        order = list(range(self.n))[::-1] if self.epoch % 2 else list(range(self.n))
        return (torch.tensor(i) for i in order[start:stop])

    def __iter__(self):
        return self.read_range(0, self.n)


KINDS = [StatefulKind, SamplerKind, ReplayedKind, RangeKind]


def _direct(cls, n, epoch, worker=None):
    """The dataset iterated directly, by plain Python: its epoch's items, as ints."""
    dataset = cls(n)
    dataset.set_epoch(epoch)
    dataset.as_worker = worker
    return [int(item) for item in iter(dataset)]


def _batched(items, batch_size, drop_last):
    batches = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
    return batches[:-1] if batches and drop_last and len(batches[-1]) < batch_size else batches


def _round_robin(per_worker):
    """torch's order for iterable datasets: one batch per live worker in turn, by worker id."""
    out, queues = [], [list(batches) for batches in per_worker]
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


@given(
    n=st.integers(0, 25),
    batch_size=st.integers(1, 5),
    drop_last=st.booleans(),
    cls=st.sampled_from(KINDS),
)
@settings(max_examples=30)
def test_an_iterable_stream_in_process_is_the_dataset_batched(n, batch_size, drop_last, cls):
    loader = unbroken.DataLoader(cls(n), batch_size=batch_size, drop_last=drop_last, seed=1)
    for epoch in range(2):
        expected = _batched(_direct(cls, n, epoch), batch_size, drop_last)
        assert [batch.tolist() for batch in loader] == expected


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.__name__)
def test_an_iterable_stream_with_workers_is_torchs_round_robin(cls):
    # 11 items in batches of 2 over 3 workers: shards of 4, 4 and 3 items, so the last worker
    # ends first with a partial batch. A global-cursor stream is read in global order instead.
    n, batch_size, workers = 11, 2, 3
    loader = unbroken.DataLoader(cls(n), batch_size=batch_size, num_workers=workers, seed=1)
    for epoch in range(2):
        if cls is RangeKind:
            expected = _batched(_direct(cls, n, epoch), batch_size, False)
        else:
            expected = _round_robin(
                [
                    _batched(_direct(cls, n, epoch, (w, workers)), batch_size, False)
                    for w in range(workers)
                ]
            )
        assert [batch.tolist() for batch in loader] == expected


def test_an_iterable_stream_with_workers_drops_each_workers_partial_batch():
    loader = unbroken.DataLoader(
        StatefulKind(11), batch_size=2, drop_last=True, num_workers=2, seed=1
    )
    expected = _round_robin(
        [_batched(_direct(StatefulKind, 11, 0, (w, 2)), 2, True) for w in range(2)]
    )
    assert (
        [batch.tolist() for batch in loader]
        == expected
        == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10]]
    )


class CountedSamplerKind(SamplerKind):
    """Logs every index its sampler yields ("index") and every sample it reads ("read")."""

    def __init__(self, n, directory):
        super().__init__(n)
        self.directory = directory

    def __iter__(self):
        super().__iter__()
        self.sampler_iter = self._logged(self.sampler_iter)
        return self

    def _logged(self, indices):
        for index in indices:
            _log(self.directory, "index")
            yield index

    def __next__(self):
        item = super().__next__()
        _log(self.directory, "read")
        return item


@pytest.mark.parametrize("workers", [0, 2])
def test_resuming_the_sampler_pattern_reads_no_sample_it_skips(tmp_path, workers):
    saved_dir, resumed_dir = tmp_path / "saved", tmp_path / "resumed"
    saved_dir.mkdir(), resumed_dir.mkdir()

    def make(directory):
        return unbroken.DataLoader(
            CountedSamplerKind(20, str(directory)), batch_size=2, num_workers=workers, seed=0
        )

    loader = make(saved_dir)
    iterator = iter(loader)
    received = [next(iterator).tolist() for _ in range(6)]  # 12 of the 20 items
    state = loader.state_dict()
    rest = [batch.tolist() for batch in iterator]
    resumed = make(resumed_dir)
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == rest and len(received + rest) == 10
    events = _events(resumed_dir)
    # The resume draws all 20 indices (12 skipped) but reads only the 8 samples it yields.
    assert (events.count("index"), events.count("read")) == (20, 8), events


# --- resuming costs O(1) -----------------------------------------------------------------------


class Indices(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return index


def _resume_work(monkeypatch, shuffle, fraction, n=10**6, batch_size=100):
    """Positions shuffled and lines of unbroken's code run to yield the first resumed batch."""
    encrypted = []
    original = IndexShuffle.at

    def counting_at(self, positions):
        encrypted.append(len(positions))
        return original(self, positions)

    monkeypatch.setattr(IndexShuffle, "at", counting_at)
    loader = unbroken.DataLoader(Indices(n), batch_size=batch_size, shuffle=shuffle, seed=3)
    state = loader.state_dict()
    state["batches"] = round(fraction * n / batch_size)
    state["samples"] = state["batches"] * batch_size
    loader.load_state_dict(state)
    package = os.path.dirname(unbroken.__file__)
    lines = [0]

    def trace_lines(frame, event, arg):
        lines[0] += 1
        return trace_lines

    def trace_calls(frame, event, arg):
        return trace_lines if frame.f_code.co_filename.startswith(package) else None

    previous = sys.gettrace()
    sys.settrace(trace_calls)
    try:
        batch = next(iter(loader))
    finally:
        sys.settrace(previous)
    start = state["samples"]
    if not shuffle:
        assert batch.tolist() == list(range(start, start + batch_size))
    return sum(encrypted), lines[0]


@pytest.mark.parametrize("shuffle", [True, False])
def test_resuming_late_in_an_epoch_costs_what_resuming_early_does(monkeypatch, shuffle):
    # Counted, not timed: positions fed to the shuffle and lines of unbroken's code executed,
    # for a resume at 1% and at 99% of an epoch of 10**6 samples in batches of 100.
    early_positions, early_lines = _resume_work(monkeypatch, shuffle, 0.01)
    late_positions, late_lines = _resume_work(monkeypatch, shuffle, 0.99)
    assert late_positions == early_positions <= (_BLOCK + 100 if shuffle else 0)
    assert late_lines <= early_lines + 200, (early_lines, late_lines)


# --- CombinedLoader ----------------------------------------------------------------------------


class ListChild:
    """A resumable child whose epochs are plain lists: batch i of epoch e is (name, e, i)."""

    def __init__(self, name, length):
        self.name, self.length, self.epoch = name, length, 0

    def __len__(self):
        return self.length

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        epoch = self.epoch
        for i in range(self.length):
            yield (self.name, epoch, i)
        self.epoch = epoch + 1  # only an epoch iterated to its end moves on by itself

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


def _combined_reference(mode, keys, epoch_of, lengths, combined_epochs, pack):
    """Each mode's definition (Lightning's) over ``epoch_of(i, e)``, child i's epoch e."""
    out, next_epoch = [], [0] * len(keys)
    for combined in range(combined_epochs):
        if mode == "sequential":
            out += [
                (batch, j, key)
                for i, key in enumerate(keys)
                for j, batch in enumerate(epoch_of(i, combined))
            ]
        elif mode == "min_size":
            out += [pack(step) for step in zip(*(epoch_of(i, combined) for i in range(len(keys))))]
        elif mode == "max_size":
            out += [
                pack(step)
                for step in itertools.zip_longest(
                    *(epoch_of(i, combined) for i in range(len(keys)))
                )
            ]
        else:  # max_size_cycle: the longest runs once, the others restart until it ends
            longest, columns = max(lengths), []
            for i, length in enumerate(lengths):
                cycles = math.ceil(longest / length)
                flat = [
                    b for e in range(next_epoch[i], next_epoch[i] + cycles) for b in epoch_of(i, e)
                ]
                columns.append(flat[:longest])
                next_epoch[i] += cycles  # one cut short begins its next epoch
            out += [pack(step) for step in zip(*columns)]
    return out


@given(
    mode=st.sampled_from(MODES),
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    as_dict=st.booleans(),
)
@settings(max_examples=60)
def test_a_combined_stream_is_each_modes_definition(mode, lengths, as_dict):
    if mode == "max_size_cycle":
        lengths = [max(1, length) for length in lengths]  # an empty child cannot be cycled
    names = "abc"[: len(lengths)]
    children = [ListChild(name, length) for name, length in zip(names, lengths)]
    keys = list(names) if as_dict else list(range(len(children)))
    loader = CombinedLoader(dict(zip(names, children)) if as_dict else children, mode=mode)
    pack = (lambda step: dict(zip(names, step))) if as_dict else list
    expected = _combined_reference(
        mode, keys, lambda i, e: [(names[i], e, k) for k in range(lengths[i])], lengths, 3, pack
    )
    assert [batch for _ in range(3) for batch in loader] == expected


@pytest.mark.parametrize("mode", MODES)
def test_a_combined_stream_of_data_loaders_is_each_modes_definition(mode):
    specs = [(3, 1, True), (7, 2, False), (5, 2, True)]  # 3, 4 and 3 batches an epoch

    def child(i):
        n, batch_size, shuffle = specs[i]
        return unbroken.DataLoader(Indices(n), batch_size=batch_size, shuffle=shuffle, seed=10 + i)

    def epoch_of(i, epoch):  # a plain list of the child's batches, from a loader of its own
        loader = child(i)
        loader.set_epoch(epoch)
        return [batch.tolist() for batch in loader]

    loader = CombinedLoader({"a": child(0), "b": child(1), "c": child(2)}, mode=mode)
    expected = _combined_reference(
        mode, ["a", "b", "c"], epoch_of, [3, 4, 3], 3, lambda step: dict(zip("abc", step))
    )
    got = [batch for _ in range(3) for batch in loader]
    if mode == "sequential":
        got = [(batch.tolist(), j, key) for batch, j, key in got]
    else:
        got = [{k: None if v is None else v.tolist() for k, v in step.items()} for step in got]
    assert got == expected
