"""IterableDatasets resume exactly: per-worker states shipped with batches, round-robin kept."""

import json
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import IterableDataset, get_worker_info

import unbroken
from unbroken.data.keys import derive_key
from unbroken.data.rng import batch_seeds, sample_seed_at
from unbroken.testing import assert_resumes_exactly


def _shard(n):
    """This worker's share of range(n): every num_workers-th item (uneven when n doesn't divide)."""
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info else (0, 1)
    return list(range(worker, n, workers))


def _item(index):
    return {
        "index": torch.tensor(index),
        "torch": torch.rand(2),
        "numpy": torch.tensor(np.random.rand()),
        "random": torch.tensor(random.random()),
    }


class StatefulStream(IterableDataset):
    """torch's Stateful protocol: the state is the position in this worker's shard."""

    def __init__(self, n):
        self.n, self.position, self.epoch = n, 0, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        shard = _shard(self.n)
        if self.epoch % 2:  # a different order every other epoch, like a reshuffle
            shard = shard[::-1]
        while self.position < len(shard):
            self.position += 1
            yield _item(shard[self.position - 1])

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class SamplerPattern(IterableDataset):
    """Lightning's fault-tolerance pattern: self.sampler, self.sampler_iter and __next__."""

    def __init__(self, n):
        self.n = n
        self.sampler = None

    def __iter__(self):
        self.sampler = _shard(self.n)
        self.sampler_iter = iter(self.sampler)
        return self

    def __next__(self):
        return _item(next(self.sampler_iter))


class Replayed(IterableDataset):
    """No state at all, but deterministic: resumed by re-reading (with a warning)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return (_item(i) for i in _shard(self.n))


def _make(cls, n, batch_size, drop_last, workers, seed=3):
    return lambda: unbroken.DataLoader(
        cls(n), batch_size=batch_size, drop_last=drop_last, num_workers=workers, seed=seed
    )


@given(
    n=st.integers(0, 23),
    batch_size=st.integers(1, 4),
    drop_last=st.booleans(),
    cls=st.sampled_from([StatefulStream, SamplerPattern]),
)
@settings(max_examples=40)
def test_every_cut_point_resumes_exactly_in_process(n, batch_size, drop_last, cls):
    assert assert_resumes_exactly(_make(cls, n, batch_size, drop_last, 0), epochs=3)


@given(
    n=st.integers(0, 23),
    batch_size=st.integers(1, 3),
    drop_last=st.booleans(),
    workers=st.integers(1, 3),
    cls=st.sampled_from([StatefulStream, SamplerPattern]),
    data=st.data(),
)
@settings(max_examples=20)
def test_a_cut_resumes_exactly_with_workers(n, batch_size, drop_last, workers, cls, data):
    make = _make(cls, n, batch_size, drop_last, workers)
    loader = make()
    cut_points = 1 + sum(1 + sum(1 for _ in loader) for _ in range(2))
    cut = data.draw(st.integers(0, cut_points - 1), label="cut")
    assert assert_resumes_exactly(make, epochs=2, cuts=[cut]) == 1


@pytest.mark.parametrize("workers", [2, 3])
def test_all_cut_points_with_uneven_shards_and_exhausted_workers(workers):
    # 11 items over 3 workers: shards of 4, 4, 3 -> with batch 2 the third worker ends first.
    assert assert_resumes_exactly(_make(StatefulStream, 11, 2, False, workers), epochs=2)


def test_state_is_what_was_received_not_what_was_prefetched():
    loader = unbroken.DataLoader(
        StatefulStream(40), batch_size=2, num_workers=2, prefetch_factor=4, seed=0
    )
    iterator = iter(loader)
    next(iterator), next(iterator), next(iterator)
    state = loader.state_dict()
    positions = [w["state"]["position"] for w in state["source"]["workers"]]
    assert positions == [4, 2] and state["source"]["next"] == 1 and state["samples"] == 6


def test_a_replayed_dataset_warns_once_and_resumes_exactly():
    with pytest.warns(UserWarning, match=r"Replayed has no state_dict.*O\(k\)"):
        assert assert_resumes_exactly(_make(Replayed, 9, 2, False, 2), epochs=2, cuts=[3, 6])


class Drifting(IterableDataset):
    """No state, and each item carries what every earlier one drew (a random walk over the
    global generators), so a replay must draw exactly as the first read did: seeded once per
    batch of the loader, at the batch's first item."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        walk = 0.0
        for i in _shard(self.n):
            walk += random.random() + float(torch.rand(())) + float(np.random.rand())
            yield {"index": torch.tensor(i), "walk": torch.tensor(walk, dtype=torch.float64)}


@pytest.mark.parametrize("batch_size, workers", [(3, 0), (2, 2)])
def test_a_replay_draws_as_the_first_read_did(batch_size, workers):
    with pytest.warns(UserWarning, match="re-reads"):
        assert assert_resumes_exactly(
            _make(Drifting, 11, batch_size, False, workers), epochs=1, cuts=[1, 2, 3]
        )


class SeedProbe(StatefulStream):
    """Each item also carries its sample_seed(), as two 32-bit halves."""

    def __iter__(self):
        for item in super().__iter__():
            seed = unbroken.sample_seed()
            item["seed"] = torch.tensor([seed >> 32, seed & 0xFFFFFFFF])
            yield item


def _seeds_and_draws(seed, epochs=2):
    loader = unbroken.DataLoader(SeedProbe(8), batch_size=2, num_workers=2, seed=seed)
    return [
        [
            item
            for batch in loader
            for item in ({k: v[i] for k, v in batch.items()} for i in range(len(batch["index"])))
        ]
        for _ in range(epochs)
    ]


def test_per_item_randomness_is_derived_from_seed_epoch_worker_and_item_count():
    # The README: an item's randomness derives from (seed, epoch, worker, item count). Checked
    # against that derivation computed here, not against a second run of the same loader.
    epochs = _seeds_and_draws(3)
    for epoch, items in enumerate(epochs):
        for item in items:
            index = int(item["index"])
            worker = index % 2  # _shard: worker w holds w, w + 2, ...
            count = index // 2 if epoch % 2 == 0 else 3 - index // 2  # reversed on odd epochs
            # Worker w's key tuple is (seed, epoch, 3, w) since state version 2 (data/keys.py).
            key = derive_key(3, epoch, 3, worker)
            expected = sample_seed_at(key, count)
            high, low = item["seed"].tolist()
            assert (high << 32) | low == expected, f"epoch {epoch} item {index}"
            # The worker's batch of 2 is seeded from its first item's count; items draw in turn.
            first, offset = count - count % 2, count % 2
            torch_seed, numpy_seed, random_seed = batch_seeds(key, first)
            generator = torch.Generator().manual_seed(torch_seed)
            torch_draws = [torch.rand(2, generator=generator) for _ in range(offset + 1)]
            assert torch.equal(item["torch"], torch_draws[offset])
            numpy_draw = float(np.random.RandomState(numpy_seed).rand(offset + 1)[offset])
            assert torch.equal(item["numpy"], torch.tensor(numpy_draw))
            random_gen = random.Random(random_seed)
            random_draw = [random_gen.random() for _ in range(offset + 1)][offset]
            assert torch.equal(item["random"], torch.tensor(random_draw))
    seeds = {tuple(item["seed"].tolist()) for items in epochs for item in items}
    assert len(seeds) == 16  # every (epoch, worker, count) its own: epochs and workers differ
    other = {tuple(item["seed"].tolist()) for items in _seeds_and_draws(4) for item in items}
    assert not seeds & other  # another seed, other numbers


def test_changing_num_workers_is_refused_before_any_batch():
    loader = _make(StatefulStream, 10, 2, False, 2)()
    iterator = iter(loader)
    next(iterator)
    other = _make(StatefulStream, 10, 2, False, 3)()
    with pytest.raises(ValueError, match="same num_workers"):
        other.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    # 0 and 1 workers both have one replica: interchangeable, both ways, the same stream
    in_process = _make(StatefulStream, 10, 2, False, 0)
    one_worker = _make(StatefulStream, 10, 2, False, 1)
    assert assert_resumes_exactly(in_process, epochs=2, resume_with=one_worker, cuts=[2, 6, 8]) == 3
    assert assert_resumes_exactly(one_worker, epochs=2, resume_with=in_process, cuts=[3, 7]) == 2


def test_unserializable_dataset_state_names_its_key():
    class Bad(StatefulStream):
        def state_dict(self):
            return {"position": self.position, "handle": object()}

    loader = unbroken.DataLoader(Bad(4), batch_size=2, seed=0)
    iterator = iter(loader)
    next(iterator)  # iterating works: only asking for the state fails
    with pytest.raises(ValueError, match=r"dataset\.state_dict\(\)\.handle"):
        loader.state_dict()


def test_shuffle_and_samplers_are_refused_for_streams():
    with pytest.raises(ValueError, match="expected unspecified shuffle option"):  # torch's
        unbroken.DataLoader(StatefulStream(4), shuffle=True)
    # An iterable that torch would take for a map-style dataset: unbroken's own refusal.
    with pytest.raises(ValueError, match="orders itself"):
        unbroken.DataLoader(unbroken.shuffle_buffer(StatefulStream(4), 2, seed=0), shuffle=True)


class Ranged(IterableDataset):
    """A global-cursor stream: read_range(start, stop) reads items [start, stop) of the epoch."""

    def __init__(self, n):
        self.n, self.epoch, self.reads = n, 0, []

    def set_epoch(self, epoch):
        self.epoch = epoch

    def read_range(self, start, stop):
        self.reads.append((start, stop))
        order = range(self.n) if self.epoch % 2 == 0 else range(self.n - 1, -1, -1)
        return (_item(order[i]) for i in range(start, min(stop, self.n)))

    def __iter__(self):  # plain torch use still works
        return self.read_range(0, self.n)


@given(
    n=st.integers(0, 23),
    batch_size=st.integers(1, 4),
    drop_last=st.booleans(),
    saved=st.integers(0, 3),
    resumed=st.integers(0, 3),
    data=st.data(),
)
@settings(max_examples=15)
def test_a_global_cursor_stream_resumes_with_any_number_of_workers(
    n, batch_size, drop_last, saved, resumed, data
):
    make = _make(Ranged, n, batch_size, drop_last, saved)
    cut_points = 1 + sum(1 + sum(1 for _ in make()) for _ in range(1)) * 2
    cut = data.draw(st.integers(0, cut_points - 1), label="cut")
    assert (
        assert_resumes_exactly(
            make, epochs=2, resume_with=_make(Ranged, n, batch_size, drop_last, resumed), cuts=[cut]
        )
        == 1
    )


def test_a_global_cursor_stream_is_read_once_and_resumes_without_rereading():
    assert assert_resumes_exactly(_make(Ranged, 10, 3, False, 0), epochs=2)
    dataset = Ranged(100)
    loader = unbroken.DataLoader(dataset, batch_size=10, seed=0)
    iterator = iter(loader)
    for _ in range(7):
        next(iterator)
    resumed_dataset = Ranged(100)
    resumed = unbroken.DataLoader(resumed_dataset, batch_size=10, seed=0)
    resumed.load_state_dict(loader.state_dict())
    assert len(list(resumed)) == 3 and resumed_dataset.reads[0] == (70, 80)


class EagerRanged(Ranged):
    """read_range builds its items at once (a list): they draw when it is called."""

    def read_range(self, start, stop):
        return list(super().read_range(start, stop))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_whose_read_range_returns_a_list_draws_from_the_seeded_generators(workers):
    # Each batch's items must be built after its generators are seeded: otherwise their draws
    # depend on what ran before (another epoch's end, a restore), and a resume repeats no sample.
    make = _make(EagerRanged, 10, 3, False, workers)
    assert assert_resumes_exactly(make, epochs=2)
    restarted = make()
    restarted.set_epoch(1)
    epoch_1 = next(iter(restarted))["torch"]
    assert not torch.equal(epoch_1, next(iter(make()))["torch"])  # epochs differ
    ended = make()
    list(ended)  # epoch 0 read to its end: epoch 1's first batch as set_epoch(1) gives it
    assert torch.equal(next(iter(ended))["torch"], epoch_1)


@pytest.mark.parametrize("cls", [StatefulStream, Ranged])
def test_iterating_a_stream_in_process_leaves_the_torch_rng_alone(cls):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    list(unbroken.DataLoader(cls(9), batch_size=2, seed=0))
    assert torch.equal(torch.rand(3), expected)


def test_the_epoch_is_set_in_the_main_process_before_workers_start():
    # Hugging Face keeps its epoch in shared memory and updates it with a non-atomic +=: workers
    # setting it at once raced (seen under load). Set first in the main process, theirs are no-ops.
    import os

    class Recording(StatefulStream):
        calls = []

        def set_epoch(self, epoch):
            Recording.calls.append((os.getpid(), epoch))
            super().set_epoch(epoch)

    loader = unbroken.DataLoader(Recording(6), batch_size=2, num_workers=2, seed=0)
    list(loader), list(loader)
    assert (os.getpid(), 0) in Recording.calls and (os.getpid(), 1) in Recording.calls
