"""Datasets that each rank iterates on its own (a stateful iterable, a user sampler, a Hugging
Face stream split by node, a CombinedLoader of such loaders): every cut point of every rank
resumes exactly on that rank, and its state is refused, naming the field, on another rank, on
another world size and in a single process. The globally split sources record no rank."""

import json
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pipelines import Augmented

import unbroken
from unbroken.errors import CorruptState, StateMismatch
from unbroken.testing import assert_resumes_exactly

HINT = "resumes only on the rank and world size that saved it"


class RankShard(torch.utils.data.IterableDataset):
    """Rank r of W's items r, r + W, ... of range(n), split again over the loader's workers.
    Its state (items read) is its own; each item draws from torch's global RNG."""

    def __init__(self, n, rank, world):
        self.n, self.rank, self.world, self.read = n, rank, world, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(self.rank + worker * self.world, self.n, self.world * workers)
        while self.read < len(mine):
            self.read += 1
            yield torch.tensor([mine[self.read - 1], int(torch.randint(0, 1 << 30, ()))])

    def state_dict(self):
        return {"read": self.read}

    def load_state_dict(self, state):
        self.read = state["read"]


class RankSampler(torch.utils.data.Sampler):
    """A stateful sampler of rank r of W's indices of range(n), shuffled by (seed, epoch)."""

    def __init__(self, n, rank, world, seed=7):
        self.n, self.rank, self.world, self.seed = n, rank, world, seed
        self.epoch, self.yielded = 0, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _order(self):
        generator = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return torch.randperm(self.n, generator=generator).tolist()[self.rank :: self.world]

    def __len__(self):
        return len(range(self.rank, self.n, self.world))

    def __iter__(self):
        order = self._order()
        while self.yielded < len(order):
            self.yielded += 1
            yield order[self.yielded - 1]
        self.yielded = 0

    def state_dict(self):
        return {"yielded": self.yielded, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.yielded, self.epoch = state["yielded"], state["epoch"]


def _ranks(rank, world):
    """The DataLoader's rank arguments: a world of one is a plain single-process loader."""
    return {} if world == 1 else {"rank": rank, "world_size": world}


def _stream(rank, world, workers=0, n=13):
    return unbroken.DataLoader(
        RankShard(n, rank, world), batch_size=2, num_workers=workers, seed=5, **_ranks(rank, world)
    )


class OwnDistributedSampler(torch.utils.data.DistributedSampler):
    pass


def _sampled(kind, rank, world, workers=0, n=12):
    dataset = Augmented(n)
    if kind == "distributed":  # a subclass of torch's, stateless: resumed by skipping
        # (torch's own DistributedSampler becomes unbroken's global order: test_dropin.py)
        sampler = OwnDistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=3
        )
        options = {"sampler": sampler, "batch_size": 2}
    elif kind == "stateful":
        options = {"sampler": RankSampler(n, rank, world), "batch_size": 2}
    else:  # a batch sampler over a stateful sampler
        batches = torch.utils.data.BatchSampler(RankSampler(n, rank, world), 3, drop_last=False)
        options = {"batch_sampler": batches}
    return unbroken.DataLoader(
        dataset, num_workers=workers, seed=5, **options, **_ranks(rank, world)
    )


def _cut_states(loader, epochs=2):
    """The state at every cut point assert_resumes_exactly checks, as JSON round-trips."""
    states = [json.loads(json.dumps(loader.state_dict()))]
    for _ in range(epochs):
        for _batch in loader:
            states.append(json.loads(json.dumps(loader.state_dict())))
        states.append(json.loads(json.dumps(loader.state_dict())))
    return states


def _refused(loader, state, field, saved, current):
    before = json.dumps(loader.state_dict())
    with pytest.raises(StateMismatch, match=HINT) as error:
        loader.load_state_dict(state)
    assert (error.value.field, error.value.saved, error.value.current) == (field, saved, current)
    assert f"saved with {field}={saved}" in str(error.value)
    assert json.dumps(loader.state_dict()) == before  # nothing changed


def _check_refusals(make, world=2, epochs=2):
    """Every cut point of every rank: accepted on its own rank; refused on the other ranks (on
    ``rank``), on one more rank (on ``world_size``) and in a single process (likewise)."""
    checked = 0
    for rank in range(world):
        for state in _cut_states(make(rank, world), epochs):
            for other in range(world):
                if other != rank:
                    _refused(make(other, world), state, "rank", rank, other)
            _refused(make(rank, world + 1), state, "world_size", world, world + 1)
            _refused(make(0, 1), state, "world_size", world, 1)
            make(rank, world).load_state_dict(state)
            assert (state["fingerprint"]["rank"], state["fingerprint"]["world_size"]) == (
                rank,
                world,
            )
            checked += 1
    return checked


def _ids(batches):
    return [int(i) for batch in batches for i in batch[:, 0]]


# (a) a stateful iterable dataset


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_iterable_resumes_exactly_at_every_cut_point_of_each_rank(workers):
    for rank in range(2):
        make = lambda rank=rank: _stream(rank, 2, workers)
        batches = len(list(make()))
        assert assert_resumes_exactly(make, epochs=2) == 1 + 2 * (batches + 1)
    # the ranks' streams are disjoint halves of the data
    assert sorted(_ids(_stream(0, 2, workers)) + _ids(_stream(1, 2, workers))) == list(range(13))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_iterables_state_is_refused_on_another_rank_or_world_size(workers):
    assert _check_refusals(lambda rank, world: _stream(rank, world, workers)) >= 20
    # and a single process's state is refused on every rank of two
    single = _stream(0, 1, workers)
    for state in _cut_states(single, epochs=1):
        assert "rank" not in state["fingerprint"] and "world_size" not in state["fingerprint"]
        for rank in range(2):
            _refused(_stream(rank, 2, workers), state, "world_size", 1, 2)
        _stream(0, 1, workers).load_state_dict(state)  # and loads in one process, as before


# (b) a user sampler or batch sampler


@pytest.mark.parametrize("kind", ["distributed", "stateful", "batch_sampler"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_user_sampler_per_rank_resumes_exactly_and_only_on_its_rank(kind, workers):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "unbroken: .* resuming skips", UserWarning)  # stateless
        for rank in range(2):
            make = lambda rank=rank: _sampled(kind, rank, 2, workers)
            total = 1 + 2 * (len(make()) + 1)
            cuts = range(total) if workers == 0 else range(rank, total, 2)  # workers: slower
            assert assert_resumes_exactly(make, epochs=2, cuts=cuts) == len(cuts)
        if workers == 0:
            assert _check_refusals(lambda rank, world: _sampled(kind, rank, world)) > 10
    every = [i for rank in range(2) for b in _sampled(kind, rank, 2) for i in b["index"].tolist()]
    assert sorted(every) == list(range(12))  # the ranks' samplers split the data


# (c) Hugging Face streaming, split by node


@pytest.fixture(scope="module")
def parquet_rows(tmp_path_factory):
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = tmp_path_factory.mktemp("parquet")
    files, rows = [], []
    for shard in range(4):  # 4 shards: split_dataset_by_node gives each of 2 ranks 2 shards
        path = directory / f"part-{shard}.parquet"
        xs = list(range(shard * 100, shard * 100 + 23 + shard))
        pq.write_table(pa.table({"x": xs, "y": [x / 7 for x in xs]}), path)
        files.append(str(path))
        rows += xs
    return files, rows


def _hf(files, rank, world, workers=0):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    if world > 1:
        stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    return unbroken.DataLoader(
        stream.with_format("torch"),
        batch_size=8,
        num_workers=workers,
        seed=2,
        **_ranks(rank, world),
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hugging_face_stream_split_by_node_resumes_exactly_per_rank(parquet_rows, workers):
    files, rows = parquet_rows
    seen = []
    for rank in range(2):
        make = lambda rank=rank: _hf(files, rank, 2, workers)
        batches = [batch["x"].tolist() for batch in make()]
        seen += [x for batch in batches for x in batch]
        n = len(batches)
        cuts = [0, 1, n // 2, n - 1, n, n + 1, n + 2, n + 1 + n // 2, 2 * n + 1, 2 * n + 2]
        cuts = cuts if workers == 0 else cuts[rank::2]  # with workers, half of them per rank
        assert assert_resumes_exactly(make, epochs=2, cuts=cuts) == len(cuts)
    assert sorted(seen) == sorted(rows)  # the two ranks together: every row written, once


def test_a_hugging_face_stream_split_by_node_refuses_another_world_size(parquet_rows):
    files, _ = parquet_rows
    saved = _hf(files, 1, 2)
    iterator = iter(saved)
    for _ in range(3):
        next(iterator)
    state = json.loads(json.dumps(saved.state_dict()))
    _refused(_hf(files, 1, 3), state, "world_size", 2, 3)
    _refused(_hf(files, 0, 2), state, "rank", 1, 0)
    _refused(_hf(files, 0, 1), state, "world_size", 2, 1)
    resumed = _hf(files, 1, 2)
    resumed.load_state_dict(state)
    assert [b["x"].tolist() for b in resumed] == [b["x"].tolist() for b in iterator]


# (d) CombinedLoader of a globally split loader and a per-rank one


def _combined(rank, world=2):
    return unbroken.CombinedLoader(
        {
            "map": unbroken.DataLoader(
                Augmented(10), batch_size=2, shuffle=True, seed=3, rank=rank, world_size=world
            ),
            "stream": _stream(rank, world, n=9),
        },
        mode="max_size_cycle",
    )


def test_a_combined_loader_of_rank_split_loaders_resumes_exactly_per_rank():
    for rank in range(2):
        make = lambda rank=rank: _combined(rank)
        assert assert_resumes_exactly(make, epochs=3) == 1 + 3 * (3 + 1)
    # after the same step, the globally split child's state is the same on both ranks, the
    # per-rank child's is its rank's
    states = []
    for rank in range(2):
        combined = _combined(rank)
        next(iter(combined))
        states.append(combined.state_dict())
    assert states[0]["loaders"][0] == states[1]["loaders"][0]
    assert "rank" not in states[0]["loaders"][0]["state"]["fingerprint"]
    assert [s["loaders"][1]["state"]["fingerprint"]["rank"] for s in states] == [0, 1]
    with pytest.raises(StateMismatch, match=f"loader 'stream': .*rank=0.*{HINT}") as error:
        _combined(1).load_state_dict(states[0])
    assert (error.value.field, error.value.saved, error.value.current) == ("rank", 0, 1)
    with pytest.raises(StateMismatch, match="loader 'stream': .*world_size=2") as error:
        _combined(0, 3).load_state_dict(states[0])
    assert error.value.field == "world_size"


# What is recorded, and states that no run saves


def test_only_per_rank_sources_on_several_ranks_record_the_rank():
    class Ranged(torch.utils.data.IterableDataset):  # a global-cursor stream with len()
        def __len__(self):
            return 8

        def read_range(self, start, stop):
            return iter(range(start, stop))

        def __iter__(self):
            return iter(range(8))

    split_globally = [
        unbroken.DataLoader(Augmented(8), batch_size=2, seed=1, rank=1, world_size=2),
        unbroken.DataLoader(Ranged(), batch_size=2, seed=1, rank=1, world_size=2),
    ]
    one_rank = unbroken.DataLoader(RankShard(13, 0, 1), batch_size=2, seed=5, rank=0, world_size=1)
    for loader in [*split_globally, one_rank, _stream(0, 1)]:
        assert not {"rank", "world_size"} & set(loader.state_dict()["fingerprint"])
    one_rank.load_state_dict(_stream(0, 1).state_dict())  # world_size=1 is a single process
    _stream(0, 1).load_state_dict(one_rank.state_dict())


@given(
    edit=st.sampled_from(["drop rank", "drop world_size", "rank", "world_size"]),
    value=st.one_of(st.integers(-2, 4), st.booleans(), st.none(), st.just("1")),
)
@settings(max_examples=40)
def test_edited_rank_fields_are_refused_with_a_named_error(edit, value):
    saved = _stream(1, 2)
    state = json.loads(json.dumps(saved.state_dict()))
    if edit.startswith("drop"):
        del state["fingerprint"][edit.split()[1]]
    else:
        state["fingerprint"][edit] = value
    loader = _stream(1, 2)
    before = json.dumps(loader.state_dict())
    if edit.startswith("drop"):
        with pytest.raises(CorruptState, match="without"):
            loader.load_state_dict(state)
        return
    if type(value) is int and (edit, value) in (("rank", 1), ("world_size", 2)):
        loader.load_state_dict(state)  # unchanged: loads
        return
    is_int = isinstance(value, int) and not isinstance(value, bool)
    # what a run could have saved: world_size >= 2, rank < the saved world_size (2)
    possible = is_int and (0 <= value < 2 if edit == "rank" else value >= 2)
    with pytest.raises((StateMismatch, CorruptState)) as error:
        loader.load_state_dict(state)
    if possible:
        assert isinstance(error.value, StateMismatch) and error.value.field == edit
    else:
        assert isinstance(error.value, CorruptState) and "fingerprint" in str(error.value)
    assert json.dumps(loader.state_dict()) == before
