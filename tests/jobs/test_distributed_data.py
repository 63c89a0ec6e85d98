"""Data parallelism: every rank's share of one global order, checked against a global order
computed here; the state is the same on every rank; a job resumes on another world size with
every sample seen exactly once; torchrun (gloo) finds the ranks by itself."""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.data.bijection import IndexShuffle
from unbroken.data.keys import derive_key
from unbroken.data.rng import sample_seed_at


class Probe(torch.utils.data.Dataset):
    """Returns (index, the sample's seed as two 32-bit halves)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        seed = unbroken.sample_seed()
        return torch.tensor([index, seed >> 32, seed & 0xFFFFFFFF])


def _loaders(n, batch_size, world, shuffle=True, drop_last=False, seed=9):
    return [
        unbroken.DataLoader(
            Probe(n),
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed,
            rank=rank,
            world_size=world,
        )
        for rank in range(world)
    ]


def _global_order(n, seed, epoch, shuffle):
    return IndexShuffle(n, derive_key(seed, epoch, 1)).range(0, n) if shuffle else list(range(n))


@given(
    n=st.integers(1, 40),
    batch_size=st.integers(1, 4),
    world=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_each_rank_gets_its_share_of_every_global_batch(n, batch_size, world, shuffle, drop_last):
    loaders = _loaders(n, batch_size, world, shuffle, drop_last)
    order = _global_order(n, 9, 0, shuffle)
    size = batch_size * world
    per_rank = [list(loader) for loader in loaders]
    assert len({len(batches) for batches in per_rank}) == 1  # no rank waits alone
    whole, rest = divmod(n, size)
    for k in range(whole):
        for rank in range(world):
            positions = range(k * size + rank * batch_size, k * size + (rank + 1) * batch_size)
            batch = per_rank[rank][k]
            assert batch[:, 0].tolist() == [order[p] for p in positions]
            seeds = [(int(h) << 32) | int(lo) for h, lo in batch[:, 1:].tolist()]
            assert seeds == [sample_seed_at(derive_key(9, 0), p) for p in positions]
    if drop_last or not rest:
        assert len(per_rank[0]) == whole
    else:  # the tail split evenly; ranks past the end repeat samples of the last global batch
        share, first = -(-rest // world), whole * size
        for rank in range(world):  # positions past the end wrap to the last global batch's start
            wrapped = [first + (rank * share + i) % rest for i in range(share)]
            assert per_rank[rank][whole][:, 0].tolist() == [order[p] for p in wrapped]


def test_every_rank_saves_the_same_state_and_any_rank_resumes_any_other():
    loaders = _loaders(23, 2, 3)
    iterators = [iter(loader) for loader in loaders]
    for _ in range(2):
        for iterator in iterators:
            next(iterator)
        states = [json.dumps(loader.state_dict()) for loader in loaders]
        assert len(set(states)) == 1
    expected = [list(iterator) for iterator in iterators]
    for rank in range(3):  # rank 0's state resumes rank 2, and so on
        resumed = _loaders(23, 2, 3)[rank]
        resumed.load_state_dict(json.loads(states[(rank + 1) % 3]))
        assert all(torch.equal(a, b) for a, b in zip(list(resumed), expected[rank], strict=True))


@pytest.mark.parametrize("worlds", [(2, 1, 3), (3, 2, 1), (1, 4, 2)])
def test_a_job_resumed_on_other_world_sizes_sees_every_sample_exactly_once(worlds):
    n, batch_size, seen, state = 60, 2, collections.Counter(), None
    steps_per_world = (4, 5)  # then the last world size runs to the end of the epoch
    for i, world in enumerate(worlds):
        loaders = _loaders(n, batch_size, world)
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        iterators = [iter(loader) for loader in loaders]
        steps = steps_per_world[i] if i < len(worlds) - 1 else None
        taken = 0
        while steps is None or taken < steps:
            batches = [next(iterator, None) for iterator in iterators]
            if batches[0] is None:
                break
            seen.update(i for batch in batches for i in batch[:, 0].tolist())
            taken += 1
        state = loaders[0].state_dict()
    assert set(seen) == set(range(n))  # nothing skipped
    extra = sum(seen.values()) - n  # repeats only from padding the last global batch
    assert 0 <= extra < worlds[-1] * batch_size
    assert state["epoch"] == 1 and state["samples"] == 0


def test_the_global_order_does_not_depend_on_the_world_size():
    def flat(world):
        per_rank = [list(loader) for loader in _loaders(24, 2, world)]
        out = []
        for k in range(len(per_rank[0])):
            for rank in range(world):
                out.append(per_rank[rank][k])
        return torch.cat(out)

    one = flat(1)
    for world in (2, 3, 4):
        assert torch.equal(flat(world), one)  # the same samples, the same seeds, in order


def test_a_single_process_state_resumes_on_ranks_and_back():
    single = unbroken.DataLoader(Probe(20), batch_size=2, shuffle=True, seed=9)
    iterator = iter(single)
    for _ in range(3):
        next(iterator)
    state = single.state_dict()
    rest = torch.cat(list(iterator))
    loaders = _loaders(20, 2, 2)
    for loader in loaders:
        loader.load_state_dict(state)
    interleaved = torch.cat([b for pair in zip(*map(list, loaders), strict=True) for b in pair])
    assert torch.equal(interleaved, rest)
    # and back: two ranks' state, after 2 global batches, resumes one process of a world of one
    # (a plain loader refuses it, saying what it is: test_a_ranks_state_loaded_alone_...)
    loaders = _loaders(20, 2, 2)
    iterators = [iter(loader) for loader in loaders]
    for _ in range(2):
        for it in iterators:
            next(it)
    plain = unbroken.DataLoader(Probe(20), batch_size=2, shuffle=True, seed=9)
    with pytest.raises(unbroken.StateMismatch, match="samples=8 after batches=2"):
        plain.load_state_dict(loaders[1].state_dict())
    (single,) = _loaders(20, 2, 1)
    single.load_state_dict(loaders[1].state_dict())
    reference = unbroken.DataLoader(Probe(20), batch_size=2, shuffle=True, seed=9)
    assert torch.equal(torch.cat(list(single)), torch.cat(list(reference))[8:])


def test_bad_rank_arguments_and_a_missing_seed_are_refused():
    with pytest.raises(ValueError, match="needs seed="):
        unbroken.DataLoader(Probe(4), rank=0, world_size=2)
    with pytest.raises(ValueError, match="pass both rank= and world_size="):
        unbroken.DataLoader(Probe(4), rank=0, seed=1)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        unbroken.DataLoader(Probe(4), rank=2, world_size=2, seed=1)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        unbroken.DataLoader(Probe(4), rank=0, world_size=0, seed=1)


TORCHRUN_JOB = """
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
import unbroken
from test_distributed_data import Probe
dist.init_process_group("gloo")
loader = unbroken.DataLoader(Probe(17), batch_size=2, shuffle=True, seed=9, num_workers=1)
iterator = iter(loader)
ids = [next(iterator)[:, 0].tolist() for _ in range(3)]
states = [None] * dist.get_world_size()
dist.all_gather_object(states, loader.state_dict())
rest = [batch[:, 0].tolist() for batch in iterator]
out = {{"rank": dist.get_rank(), "world": dist.get_world_size(), "ids": ids, "rest": rest,
       "states": states}}
with open({out!r} + f"/rank{{dist.get_rank()}}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def test_under_torchrun_the_ranks_come_from_the_process_group(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_JOB.format(tests=str(Path(__file__).parent), out=str(tmp_path)))
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["states"][0] == ranks[0]["states"][1]  # the same state on both ranks
    seen = collections.Counter(i for r in ranks for batch in r["ids"] + r["rest"] for i in batch)
    assert set(seen) == set(range(17)) and sum(seen.values()) == 18  # one padded repeat


class RangedProbe(torch.utils.data.IterableDataset):
    """A global-cursor stream of n items (index, the item's seed halves), with len()."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return self.read_range(0, self.n)

    def read_range(self, start, stop):
        for index in range(start, min(stop, self.n)):
            seed = unbroken.sample_seed()
            yield torch.tensor([index, seed >> 32, seed & 0xFFFFFFFF])


def _stream_loaders(n, batch_size, world, workers=0, drop_last=False):
    return [
        unbroken.DataLoader(
            RangedProbe(n),
            batch_size=batch_size,
            num_workers=workers,
            drop_last=drop_last,
            seed=9,
            rank=rank,
            world_size=world,
        )
        for rank in range(world)
    ]


@given(
    n=st.integers(1, 30),
    batch_size=st.integers(1, 4),
    world=st.integers(1, 3),
    drop_last=st.booleans(),
)
@settings(max_examples=30, deadline=None)
def test_a_global_cursor_stream_is_split_like_a_map_style_dataset(n, batch_size, world, drop_last):
    streamed = [list(loader) for loader in _stream_loaders(n, batch_size, world, 0, drop_last)]
    mapped = [list(loader) for loader in _loaders(n, batch_size, world, False, drop_last)]
    assert len({len(batches) for batches in streamed}) == 1
    for rank in range(world):  # the same samples, the same positions' seeds, the same padding
        assert len(streamed[rank]) == len(mapped[rank])
        for a, b in zip(streamed[rank], mapped[rank], strict=True):
            assert torch.equal(torch.stack(list(a)) if isinstance(a, list) else a, b)


@pytest.mark.parametrize("worlds", [(2, 1, 3), (3, 2, 1)])
def test_a_global_cursor_stream_resumes_on_other_world_sizes(worlds):
    n, batch_size, seen, state = 40, 2, collections.Counter(), None
    for i, world in enumerate(worlds):
        loaders = _stream_loaders(n, batch_size, world, workers=2 if world == 2 else 0)
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        iterators = [iter(loader) for loader in loaders]
        for _ in range(3 if i < len(worlds) - 1 else 10**6):
            batches = [next(iterator, None) for iterator in iterators]
            if batches[0] is None:
                break
            seen.update(i for batch in batches for i in batch[:, 0].tolist())
        state = loaders[0].state_dict() if i < len(worlds) - 1 else None
        del iterators
    assert set(seen) == set(range(n))
    assert 0 <= sum(seen.values()) - n < worlds[-1] * batch_size


def test_a_global_cursor_stream_without_len_is_refused_on_several_ranks():
    class NoLen(RangedProbe):
        __len__ = None

    with pytest.raises(ValueError, match="needs len"):
        unbroken.DataLoader(NoLen(4), batch_size=2, seed=1, rank=0, world_size=2)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_every_cut_point_of_every_rank_resumes_exactly(stream, world):
    from unbroken.testing import assert_resumes_exactly

    for rank in range(world):
        dataset = RangedProbe(11) if stream else Probe(11)

        def make(rank=rank, dataset=dataset):
            return unbroken.DataLoader(
                dataset, batch_size=2, shuffle=not stream, seed=9, rank=rank, world_size=world
            )

        assert assert_resumes_exactly(make, epochs=2) == 1 + 2 * (len(make()) + 1)


@pytest.mark.parametrize("stream", [False, True])
def test_every_cut_point_resumes_on_another_world_size_with_each_sample_once(stream):
    n, batch_size = 13, 2
    make = _stream_loaders if stream else _loaders
    for cut in range(len(make(n, batch_size, 2)[0]) + 1):  # every global batch, and the end
        loaders = make(n, batch_size, 2)
        iterators = [iter(loader) for loader in loaders]
        seen = collections.Counter()
        for _ in range(cut):
            seen.update(i for it in iterators for i in next(it)[:, 0].tolist())
        state = loaders[0].state_dict()
        resumed = make(n, batch_size, 3)
        for loader in resumed:
            loader.load_state_dict(state)
        seen.update(i for loader in resumed for batch in loader for i in batch[:, 0].tolist())
        assert set(seen) == set(range(n)), f"cut {cut}"
        assert sum(seen.values()) - n < 3 * batch_size, f"cut {cut}"


@given(
    n=st.integers(1, 60),
    batch_size=st.integers(1, 4),
    before=st.integers(1, 3),
    after=st.integers(1, 3),
    global_batches=st.integers(0, 8),
    stream=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_drop_last_after_another_world_size_drops_the_least_it_can(
    n, batch_size, before, after, global_batches, stream
):
    # Resumed on another world size, the epoch's rest is cut into the new global batches from
    # the saved cursor: what is dropped is the rest modulo the new global batch, never more
    # (the end used to stay at n - n % new_global_batch: 1000 samples in batches of 16 moved
    # from 2 to 3 ranks could lose 56 samples where 8 was the least).
    make = _stream_loaders if stream else _loaders
    loaders = make(n, batch_size, before, **({} if stream else {"shuffle": True}), drop_last=True)
    iterators = [iter(loader) for loader in loaders]
    seen = []
    for _ in range(global_batches):
        batches = [next(iterator, None) for iterator in iterators]
        if batches[0] is None:
            break
        seen += [i for batch in batches for i in batch[:, 0].tolist()]
    cursor = len(seen)
    state = loaders[0].state_dict()
    resumed = make(n, batch_size, after, **({} if stream else {"shuffle": True}), drop_last=True)
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [i for loader in resumed for batch in loader for i in batch[:, 0].tolist()]
    size = batch_size * after
    if state["epoch"] == 0:  # still in the epoch: nothing twice, the least possible dropped
        assert len(set(seen + rest)) == len(seen + rest)
        assert len(rest) == (n - cursor) // size * size
    else:  # the cut came after the epoch ended: the resumed loader starts the next epoch
        assert len(rest) == n // size * size


@pytest.mark.parametrize("stream", [False, True])
def test_a_ranks_state_loaded_alone_says_what_it_is_and_how_to_load_it(stream):
    make = _stream_loaders if stream else _loaders
    loaders = make(20, 2, 3)
    held = iter(loaders[0])
    next(held)
    state = loaders[0].state_dict()
    assert (state["samples"], state["batches"]) == (6, 1)
    alone = make(20, 2, 1)[0]  # world 1 from _loaders passes rank=0, world_size=1: it loads
    alone.load_state_dict(state)
    plain = unbroken.DataLoader(
        RangedProbe(20) if stream else Probe(20), batch_size=2, shuffle=not stream, seed=9
    )
    with pytest.raises(unbroken.StateMismatch, match="rank=0, world_size=1") as refused:
        plain.load_state_dict(state)
    assert refused.value.field == "world_size"
    assert "global cursor of a data-parallel job of 3 ranks" in str(refused.value)
    with pytest.raises(unbroken.CorruptState, match="inconsistent"):  # no job of any size saved it
        plain.load_state_dict({**state, "samples": 0})
