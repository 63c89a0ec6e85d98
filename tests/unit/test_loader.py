"""Resume equivalence of unbroken.DataLoader: every cut point, every setting that may change."""

import functools
import json
import os
import tracemalloc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pipelines import Augmented, Counting, Positioned

import unbroken
from unbroken.testing import assert_resumes_exactly, assert_same


def _factory(n, batch_size, shuffle, drop_last, seed, workers, persistent=False, **kw):
    def make():
        return unbroken.DataLoader(
            Augmented(n),
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=workers,
            persistent_workers=persistent and workers > 0,
            seed=seed,
            **kw,
        )

    return make


@given(
    n=st.integers(0, 40),
    batch_size=st.integers(1, 7),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
)
@settings(max_examples=60)
def test_every_cut_point_resumes_exactly_in_process(n, batch_size, shuffle, drop_last, seed):
    make = _factory(n, batch_size, shuffle, drop_last, seed, workers=0)
    checked = assert_resumes_exactly(make, epochs=2)
    batches = len(make())
    assert checked == 1 + 2 * (batches + 1)  # before, after every batch, after every epoch


@given(
    n=st.integers(1, 30),
    batch_size=st.integers(1, 5),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
    saved_workers=st.integers(0, 3),
    resumed_workers=st.integers(0, 3),
    persistent=st.booleans(),
    data=st.data(),
)
@settings(max_examples=25)
def test_a_cut_resumes_exactly_with_another_number_of_workers(
    n, batch_size, shuffle, drop_last, seed, saved_workers, resumed_workers, persistent, data
):
    make = _factory(n, batch_size, shuffle, drop_last, seed, saved_workers, persistent)
    resume = _factory(n, batch_size, shuffle, drop_last, seed, resumed_workers, persistent)
    cut_points = 1 + 3 * (len(make()) + 1)
    cut = data.draw(st.integers(0, cut_points - 1), label="cut")
    assert assert_resumes_exactly(make, epochs=3, resume_with=resume, cuts=[cut]) == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_fixed_edge_cuts_with_workers(workers):
    # Cut points: start, middle, last batch, exact end inside the loop, after the loop, and in
    # a later epoch, over three epochs of 10 samples in batches of 3 (the last one partial).
    make = _factory(10, 3, True, False, 5, workers, persistent=True)
    assert assert_resumes_exactly(make, epochs=3, resume_with=_factory(10, 3, True, False, 5, 1))
    assert assert_resumes_exactly(make, epochs=3) == 1 + 3 * 5


def test_epoch_boundary_inside_versus_after_the_loop():
    loader = unbroken.DataLoader(Counting(4), batch_size=2, shuffle=True, seed=3)
    for _ in loader:
        inside = loader.state_dict()
    after = loader.state_dict()
    assert (inside["epoch"], inside["samples"]) == (0, 4)
    assert (after["epoch"], after["samples"]) == (1, 0)

    resumed = unbroken.DataLoader(Counting(4), batch_size=2, shuffle=True, seed=3)
    resumed.load_state_dict(inside)
    assert resumed.epoch == 0 and list(resumed) == []  # the rest of epoch 0 is empty
    assert resumed.epoch == 1
    resumed.load_state_dict(after)
    assert resumed.epoch == 1 and len(list(resumed)) == 2


def test_state_is_what_was_received_not_what_was_prefetched():
    loader = unbroken.DataLoader(
        Counting(64), batch_size=4, num_workers=2, prefetch_factor=4, seed=0
    )
    iterator = iter(loader)
    first = next(iterator)
    state = loader.state_dict()
    assert (state["samples"], state["batches"]) == (4, 1)  # workers have prefetched far more
    resumed = unbroken.DataLoader(Counting(64), batch_size=4, seed=0)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed)), first + 4)


def test_an_abandoned_iteration_is_followed_by_the_next_epoch():
    loader = unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=9)
    reference = unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=9)
    epochs = [list(reference) for _ in range(2)]
    next(iter(loader))  # take one batch of epoch 0 and drop the iterator
    assert loader.epoch == 1
    assert_same(list(loader), epochs[1])
    assert loader.epoch == 2


def test_resume_reads_only_what_remains():
    dataset = Counting(1000)
    loader = unbroken.DataLoader(dataset, batch_size=10, shuffle=True, seed=1)
    for i, _ in enumerate(loader):
        if i == 98:
            state = loader.state_dict()
            break
    fresh = Counting(1000)
    resumed = unbroken.DataLoader(fresh, batch_size=10, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 1 and len(fresh.fetched) == 10  # the other 990 are never touched


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_size", [2, None])
def test_iterating_leaves_the_training_process_torch_rng_alone(workers, batch_size):
    # Dropout in the training step must not depend on the loader, nor on num_workers.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    loader = unbroken.DataLoader(
        Augmented(8), batch_size=batch_size, shuffle=True, num_workers=workers, seed=0
    )
    for _ in range(2):
        list(loader)
    assert torch.equal(torch.rand(3), expected)


def test_a_billion_samples_start_at_once_in_constant_memory():
    class Huge(torch.utils.data.Dataset):
        def __len__(self):
            return 10**9

        def __getitem__(self, index):
            return torch.tensor(index)

    tracemalloc.start()
    loader = unbroken.DataLoader(Huge(), batch_size=256, shuffle=True, seed=0)
    first = next(iter(loader))
    state = loader.state_dict()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert first.shape == (256,) and len(set(first.tolist())) == 256
    assert peak < 8 * 2**20, f"peak {peak} bytes"
    state["samples"], state["batches"] = 256 * 3_900_000, 3_900_000  # ~99.8% of the epoch
    loader.load_state_dict(state)
    assert next(iter(loader)).shape == (256,)


def test_unbatched_loading_resumes_exactly():
    make = _factory(9, None, True, False, 2, workers=0)
    assert assert_resumes_exactly(make, epochs=2) == 1 + 2 * 10
    sample = next(iter(make()))
    assert sample["index"].shape == ()


def test_sequential_sampler_on_the_dataset_is_native():
    dataset = Counting(5)
    loader = unbroken.DataLoader(dataset, sampler=torch.utils.data.SequentialSampler(dataset))
    assert loader.state_dict()["fingerprint"]["sampler"] == "unbroken"
    assert [int(b) for b in loader] == [0, 1, 2, 3, 4]


def test_state_dict_is_json():
    loader = _factory(10, 3, True, True, 1, 0)()
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state


def test_spawned_workers_resume_exactly():
    # spawn pickles the dataset wrapper and the batches: the path fork never exercises.
    make = _factory(7, 2, True, False, 3, workers=1, multiprocessing_context="spawn")
    assert (
        assert_resumes_exactly(
            make, epochs=2, resume_with=_factory(7, 2, True, False, 3, 0), cuts=[2]
        )
        == 1
    )


def _record_worker(directory, worker):
    """A worker_init_fn: one file per call, named by the id it got and the worker's own."""
    info = torch.utils.data.get_worker_info()
    path = directory / f"{worker}-{info.id}-{os.getpid()}"
    assert not path.exists()
    path.touch()


def test_torch_arguments_pass_through(tmp_path):
    loader = unbroken.DataLoader(
        Counting(7),
        batch_size=3,
        drop_last=True,
        collate_fn=lambda items: [int(i) for i in items],
        num_workers=2,
        worker_init_fn=functools.partial(_record_worker, tmp_path),
        seed=0,
    )
    assert len(loader) == 2 and [len(batch) for batch in loader] == [3, 3]
    assert list(loader)[0] == [0, 1, 2]
    # Called once per worker and epoch (workers restart each epoch), with the worker's own id,
    # though unbroken wraps it to shield workers from preemption signals.
    calls = sorted(path.name.split("-") for path in tmp_path.iterdir())
    assert [(worker, own) for worker, own, _ in calls] == [("0", "0")] * 2 + [("1", "1")] * 2
    assert len({pid for _, _, pid in calls}) == 4
    seeded = unbroken.DataLoader(
        Counting(7), shuffle=True, generator=torch.Generator().manual_seed(42)
    )
    assert seeded.seed == 42


@pytest.mark.parametrize(
    "kw",
    [{"shuffle": True}, {}, {"sampler": torch.utils.data.SequentialSampler(range(10))}],
    ids=["shuffled", "sequential", "sampler"],
)
def test_another_batch_size_is_refused_at_every_cut_point(kw):
    def make(batch_size):
        return unbroken.DataLoader(Counting(10), batch_size=batch_size, seed=7, **kw)

    # Before the first batch, mid-epoch, right after the epoch's last batch (inside the loop)
    # and after the loop: each state is refused naming batch_size, changing nothing.
    loader = make(3)
    states = [loader.state_dict()]
    for batch_number, _ in enumerate(loader):
        if batch_number == 1:
            states.append(loader.state_dict())
        inside = loader.state_dict()
    states += [inside, loader.state_dict()]
    assert [(s["epoch"], s["batches"]) for s in states] == [(0, 0), (0, 2), (0, 4), (1, 0)]
    for state in states:
        other = make(4)
        before = other.state_dict()
        with pytest.raises(
            ValueError, match="saved with batch_size=3 but this loader has batch_size=4"
        ):
            other.load_state_dict(json.loads(json.dumps(state)))
        assert other.state_dict() == before


def test_an_iterator_that_yields_nothing_starts_no_epoch_and_keeps_a_loaded_state():
    # tqdm.auto and other wrappers call iter() once more than they consume.
    reference = [
        b.tolist() for b in unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=9)
    ]
    loader = unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=9)
    iter(loader)
    assert [b.tolist() for b in loader] == reference and loader.epoch == 1

    saved = unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=9)
    iterator = iter(saved)
    next(iterator)
    resumed = unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=9)
    resumed.load_state_dict(saved.state_dict())
    iter(resumed)
    assert [b.tolist() for b in resumed] == reference[1:]


def test_set_epoch_starts_that_epoch_from_its_first_batch():
    reference = unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=9)
    epochs = [[b.tolist() for b in reference] for _ in range(3)]
    loader = unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=9)
    next(iter(loader))
    loader.set_epoch(2)
    assert loader.state_dict()["epoch"] == 2 and [b.tolist() for b in loader] == epochs[2]
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        loader.set_epoch(-1)


def test_a_state_taken_after_a_break_resumes_like_the_next_loop():
    make = lambda: unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=9)
    loader = make()
    for _ in loader:
        break
    state = loader.state_dict()
    assert (state["epoch"], state["samples"]) == (1, 0)
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in loader]


def test_freeing_a_loader_with_persistent_workers_needs_no_cycle_collection():
    import gc
    import weakref

    loader = unbroken.DataLoader(
        Counting(7), batch_size=2, num_workers=2, persistent_workers=True, seed=0
    )
    list(loader)
    gc.disable()
    try:
        alive = weakref.ref(loader)
        del loader
        assert alive() is None  # freed by reference counting, workers shut down now
    finally:
        gc.enable()


def test_public_docstrings_point_to_public_documentation_not_private_modules():
    import inspect
    import re

    for name in [
        "DataLoader",
        "CombinedLoader",
        "Resumable",
        "ShuffleBuffer",
        "resumable",
        "shuffle_buffer",
        "sample_rng",
        "sample_seed",
    ]:
        obj = getattr(unbroken, name)
        docs = [inspect.getdoc(obj) or ""]
        docs += (
            [
                inspect.getdoc(member) or ""
                for attribute, member in vars(obj).items()
                if not attribute.startswith("_") and callable(member)
            ]
            if inspect.isclass(obj)
            else []
        )
        for doc in docs:
            private = re.findall(r"unbroken\._\w+|``_[a-z]\w*``", doc)
            assert not private, f"unbroken.{name}'s documentation points to {private}"
    assert "docs/guides/randomness.md" in inspect.getdoc(unbroken.DataLoader)
    assert "unbroken.sample_rng()" in inspect.getdoc(unbroken.DataLoader)


@pytest.mark.parametrize("iterable, workers", [(False, 0), (True, 0), (True, 2)])
def test_the_state_before_the_last_batch_is_the_state_one_batch_earlier(iterable, workers):
    # For a consumer that fetches a batch ahead of its user (Lightning's prefetch of a loader
    # without len(), unbroken.lightning): the state as it was before the last batch.
    def make():
        dataset = Positioned(40) if iterable else Counting(40)
        return unbroken.DataLoader(dataset, batch_size=4, num_workers=workers, seed=1)

    loader = make()
    assert loader._state_before_last_batch() is None  # nothing received
    states, iterator = [loader.state_dict()], iter(loader)
    for _ in range(5):
        next(iterator)
        assert loader._state_before_last_batch() == states[-1]
        states.append(loader.state_dict())
    resumed = make()
    resumed.load_state_dict(states[3])
    assert resumed._state_before_last_batch() is None  # not received by this loader


@pytest.mark.parametrize("batch_size", [3, 7, 4095, 4097])
def test_batches_that_do_not_divide_the_internal_block_are_whole(batch_size):
    # The order is computed in blocks of positions (4096 at a time): a batch size that does not
    # divide it must still give whole batches across every block edge, in the shuffle's order.
    from unbroken.data.bijection import IndexShuffle
    from unbroken.data.keys import derive_key

    n = 3 * 4096 + 5
    loader = unbroken.DataLoader(Counting(n), batch_size=batch_size, shuffle=True, seed=2)
    sizes = [len(batch) for batch in loader]
    assert sizes[:-1] == [batch_size] * (len(sizes) - 1) and sum(sizes) == n
    loader.set_epoch(0)
    assert [int(i) for batch in loader for i in batch] == IndexShuffle(
        n, derive_key(2, 0, 1)
    ).range(0, n)
