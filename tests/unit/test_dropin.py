"""``unbroken.DataLoader`` as a drop-in for ``torch.utils.data.DataLoader``, checked against
torch's own loader built with the same arguments: ``isinstance``, the attributes code reads
(Lightning re-creates loaders from them), ``len``, torch's argument errors, re-instantiation
from the attributes, ``sampler.set_epoch``, and the default seed taken from torch's global
generator."""

from __future__ import annotations

import inspect
import multiprocessing
import re

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

import unbroken
from unbroken.testing import assert_resumes_exactly


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {"index": i, "noise": torch.rand(())}  # a random augmentation


def indices(batches) -> list[int]:
    return [int(i) for b in batches for i in b["index"]]


def collate_pairs(batch):
    return default_collate(batch)


def init_worker(worker_id: int) -> None:
    pass


ARGUMENTS = [
    {"batch_size": 4},
    {"batch_size": 3, "shuffle": True, "drop_last": True},
    {"batch_size": None},
    {"batch_size": 4, "collate_fn": collate_pairs, "pin_memory": False, "timeout": 5.0},
    {"batch_size": 4, "num_workers": 2, "worker_init_fn": init_worker},
    {
        "batch_size": 2,
        "num_workers": 1,
        "prefetch_factor": 3,
        "persistent_workers": True,
        "multiprocessing_context": "spawn",
    },
    {"batch_size": 4, "shuffle": True, "generator": torch.Generator().manual_seed(7)},
]
SAME = (
    "batch_size",
    "drop_last",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "pin_memory_device",
    "timeout",
    "worker_init_fn",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "in_order",
)


@pytest.mark.parametrize("kwargs", ARGUMENTS)
def test_attributes_and_len_are_torchs(kwargs):
    dataset = Indexed()
    ours, torchs = (
        unbroken.DataLoader(dataset, **kwargs),
        torch.utils.data.DataLoader(dataset, **kwargs),
    )
    assert isinstance(ours, torch.utils.data.DataLoader)
    assert ours.dataset is dataset
    for name in SAME:
        assert getattr(ours, name) == getattr(torchs, name), name
    context = torchs.multiprocessing_context
    assert type(ours.multiprocessing_context) is type(context)
    if isinstance(context, multiprocessing.context.BaseContext):
        assert ours.multiprocessing_context.get_start_method() == context.get_start_method()
    assert len(ours) == len(torchs)
    # The sampler lists what this rank reads: torch's also lists what drop_last drops.
    dropped = len(dataset) % kwargs["batch_size"] if ours.drop_last else 0
    assert len(ours.sampler) == len(torchs.sampler) - dropped == len(list(ours.sampler))
    if torchs.batch_sampler is None:
        assert ours.batch_sampler is None
    else:
        assert (
            type(ours.batch_sampler) is BatchSampler and ours.batch_sampler.sampler is ours.sampler
        )
        assert ours.batch_sampler.batch_size == torchs.batch_sampler.batch_size
        assert ours.batch_sampler.drop_last == torchs.batch_sampler.drop_last
        assert len(ours.batch_sampler) == len(torchs.batch_sampler)
    assert isinstance(ours.sampler, DistributedSampler)  # this rank's share: all of it here
    assert (ours.sampler.num_replicas, ours.sampler.rank) == (1, 0)
    assert ours.sampler.shuffle == isinstance(torchs.sampler, RandomSampler)


def test_every_argument_of_torchs_loader_is_taken():
    # Code that passes torch's arguments by name or position works unchanged.
    theirs = inspect.signature(torch.utils.data.DataLoader.__init__).parameters
    ours = inspect.signature(unbroken.DataLoader.__init__).parameters
    for name, parameter in theirs.items():
        assert name in ours, name
        assert ours[name].default == parameter.default, name
    assert list(theirs)[:13] == list(ours)[:13]  # the positional ones, in torch's order


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(6))


class Listed(torch.utils.data.Sampler):
    def __init__(self) -> None:
        pass

    def __iter__(self):
        return iter(range(20))

    def __len__(self) -> int:
        return 20


_BATCHES = BatchSampler(SequentialSampler(range(20)), 4, False)
# Every combination torch's DataLoader refuses (torch 2.4-2.13), by what it refuses.
REFUSED = {
    "num_workers=-1": (Indexed, {"num_workers": -1}),
    "timeout=-1": (Indexed, {"timeout": -1}),
    "prefetch_factor without workers": (Indexed, {"prefetch_factor": 2}),
    "prefetch_factor=-1": (Indexed, {"num_workers": 2, "prefetch_factor": -1}),
    "persistent_workers without workers": (Indexed, {"persistent_workers": True}),
    "a stream with shuffle": (Stream, {"shuffle": True}),
    "a stream with a sampler": (Stream, {"sampler": Listed()}),
    "a stream with a batch_sampler": (Stream, {"batch_sampler": _BATCHES}),
    "a sampler with shuffle": (Indexed, {"sampler": Listed(), "shuffle": True}),
    "torch's sampler with shuffle": (
        Indexed,
        {"sampler": SequentialSampler(range(20)), "shuffle": True},
    ),
    "batch_sampler and batch_size": (Indexed, {"batch_sampler": _BATCHES, "batch_size": 4}),
    "batch_sampler and shuffle": (Indexed, {"batch_sampler": _BATCHES, "shuffle": True}),
    "batch_sampler and sampler": (Indexed, {"batch_sampler": _BATCHES, "sampler": Listed()}),
    "batch_sampler and drop_last": (Indexed, {"batch_sampler": [[0, 1]], "drop_last": True}),
    "batch_size=None and drop_last": (Indexed, {"batch_size": None, "drop_last": True}),
    "batch_size=0": (Indexed, {"batch_size": 0}),
    "batch_size=-1": (Indexed, {"batch_size": -1}),
    "batch_size='2'": (Indexed, {"batch_size": "2"}),
    "batch_size=True": (Indexed, {"batch_size": True}),
    "drop_last='yes'": (Indexed, {"drop_last": "yes"}),
    "an unknown start method": (Indexed, {"num_workers": 2, "multiprocessing_context": "nope"}),
    "a start method of another type": (Indexed, {"num_workers": 2, "multiprocessing_context": 5}),
    "a start method without workers": (Indexed, {"multiprocessing_context": "spawn"}),
}


@pytest.mark.parametrize("case", REFUSED)
def test_torchs_argument_errors_are_raised_with_torchs_type_and_message(case):
    make, kwargs = REFUSED[case]
    with pytest.raises(Exception) as theirs:
        torch.utils.data.DataLoader(make(), **kwargs)
    with pytest.raises(Exception) as ours:
        unbroken.DataLoader(make(), **kwargs)
    assert type(ours.value) is type(theirs.value)
    # Reprs of the arguments inside the message name objects by address: compare without them.
    strip = lambda error: re.sub(r" at 0x[0-9a-f]+", "", str(error))
    assert strip(ours.value) == strip(theirs.value)


@pytest.mark.parametrize(
    "name", ["batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_settings_are_fixed_once_built_as_in_torch(name):
    loader = unbroken.DataLoader(Indexed(), batch_size=4)
    with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
        setattr(loader, name, getattr(loader, name))
    loader.seed_note = "other attributes can be set"  # as on torch's loader


def test_the_sampler_is_the_loaders_order():
    # Reference without the loader's iteration: the sampler lists the epoch's indices, and the
    # loader delivers exactly them, in that order; another epoch is another permutation.
    loader = unbroken.DataLoader(Indexed(), batch_size=3, shuffle=True, seed=5)
    first = list(loader.sampler)
    assert sorted(first) == list(range(20)) and first != list(range(20))
    assert indices(loader) == first
    assert loader.sampler.epoch == 1 and loader.sampler.seed == 5
    second = list(loader.sampler)
    assert sorted(second) == list(range(20)) and second != first
    assert [list(b) for b in loader.batch_sampler][:2] == [second[:3], second[3:6]]
    assert indices(loader) == second
    sequential = unbroken.DataLoader(Indexed(), batch_size=3)
    assert list(sequential.sampler) == list(range(20)) == indices(sequential)


def test_sampler_of_each_rank_is_its_share():
    dataset = Indexed(21)
    shares = []
    for rank in range(3):
        loader = unbroken.DataLoader(
            dataset, batch_size=2, shuffle=True, seed=3, rank=rank, world_size=3
        )
        assert (loader.sampler.rank, loader.sampler.num_replicas) == (rank, 3)
        assert list(loader.sampler) == indices(loader)
        assert len(loader.sampler) == len(list(loader.sampler))
        shares.append(list(loader.sampler))
    assert sorted(sum(shares, [])) == list(range(21))


def test_sampler_set_epoch_keeps_a_restored_position_and_moves_to_another_epoch():
    def make():
        return unbroken.DataLoader(Indexed(), batch_size=4, shuffle=True, seed=2)

    whole = make()
    epochs = [indices(whole) for _ in range(3)]
    cut = make()
    iterator = iter(cut)
    next(iterator), next(iterator)
    state = cut.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    # Lightning (and loops written for DistributedSampler) call this at every epoch's start.
    resumed.sampler.set_epoch(0)
    assert indices(resumed) == epochs[0][8:]
    resumed.sampler.set_epoch(1)  # the epoch it is on now: nothing changes
    assert indices(resumed) == epochs[1]
    resumed.sampler.set_epoch(0)  # another epoch: it starts from its first batch
    assert indices(resumed) == epochs[0]


def test_sampler_set_epoch_after_iter_as_lightning_calls_it_when_resuming():
    # Lightning resumed from a checkpoint at an epoch's last batch loads the state (epoch 0,
    # nothing left), calls iter(), then sampler.set_epoch(1): the iterator must give epoch 1
    # (it used to be bound to epoch 0's empty remainder, and the resumed run lost an epoch).
    def make():
        return unbroken.DataLoader(Indexed(), batch_size=4, shuffle=True, seed=2)

    whole = make()
    epochs = [indices(whole) for _ in range(2)]
    cut = make()
    for _ in cut:
        state = cut.state_dict()  # inside the loop, after the last batch: epoch 0, all received
    assert (state["epoch"], state["batches"]) == (0, len(cut))
    resumed = make()
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    resumed.sampler.set_epoch(1)
    assert indices(iterator) == epochs[1]
    # Without a load (Lightning's per-epoch checkpoint, whose states it does not load): the same.
    fresh = make()
    iterator = iter(fresh)
    fresh.sampler.set_epoch(1)
    assert indices(iterator) == epochs[1]


def test_sampler_set_epoch_restarts_an_epoch_it_did_not_restore():
    # As torch's DistributedSampler: set_epoch(n) then iter() reads epoch n from its start,
    # whatever was iterated before (Lightning calls it before every validation).
    loader = unbroken.DataLoader(Indexed(), batch_size=4, shuffle=True, seed=2)
    first = indices(loader)
    loader.sampler.set_epoch(0)
    held = iter(loader)
    next(held)  # Lightning's validation holds its iterator after the last batch it asks for
    loader.sampler.set_epoch(0)  # the epoch the loader is on: again from its start
    assert indices(loader) == first


def re_create(loader, **changes):
    """What Lightning does to inject a sampler: a new loader of the same type from the old
    one's attributes, with torch's rule that a sampler excludes shuffle and batch_sampler."""
    names = inspect.signature(torch.utils.data.DataLoader.__init__).parameters
    kwargs = {n: getattr(loader, n) for n in names if n not in ("self", "shuffle")}
    kwargs.update(batch_sampler=None, **changes)
    return type(loader)(**kwargs)


@pytest.mark.parametrize("shuffle", [False, True])
def test_re_created_from_its_attributes_it_is_the_same_loader(shuffle):
    loader = unbroken.DataLoader(Indexed(), batch_size=3, shuffle=shuffle, drop_last=True)
    torch.rand(3)  # a draw in between: the copy's seed must come from the sampler, not be drawn
    copy = re_create(loader)
    assert copy.seed == loader.seed and copy.sampler.shuffle == shuffle
    assert indices(copy) == indices(re_create(loader))
    # The same order, and each one's state resumes the other (same fingerprint: O(1) resume).
    iterator = iter(copy)
    next(iterator)
    loader.load_state_dict(copy.state_dict())
    assert indices(loader) == indices(iterator)
    # Through torch's BatchSampler too (torch's other way to pass an order).
    batched = type(loader)(loader.dataset, batch_sampler=loader.batch_sampler)
    assert batched.batch_size == 3 and batched.drop_last and batched.seed == loader.seed
    assert batched.state_dict()["fingerprint"] == loader.state_dict()["fingerprint"]


def test_lightning_re_creates_it_with_its_own_sampler_kept():
    # Lightning's own re-creation (what it runs to inject a sampler), from the attributes.
    from lightning.pytorch.utilities.data import _update_dataloader

    loader = unbroken.DataLoader(Indexed(), batch_size=4, shuffle=True, seed=9)
    copy = _update_dataloader(loader, loader.sampler)
    assert type(copy) is unbroken.DataLoader and copy.seed == 9
    assert indices(copy) == indices(
        unbroken.DataLoader(Indexed(), batch_size=4, shuffle=True, seed=9)
    )


@pytest.mark.parametrize(
    "make_sampler, expected",
    [
        (lambda d: SequentialSampler(d), {"shuffle": False}),
        (lambda d: RandomSampler(d, generator=torch.Generator().manual_seed(11)), {"seed": 11}),
        (
            lambda d: DistributedSampler(d, num_replicas=2, rank=1, shuffle=True, seed=4),
            {"seed": 4, "rank": 1, "world_size": 2},
        ),
    ],
)
def test_torchs_samplers_of_the_whole_dataset_become_unbrokens_order(make_sampler, expected):
    dataset = Indexed()
    loader = unbroken.DataLoader(dataset, batch_size=2, sampler=make_sampler(dataset))
    assert loader.state_dict()["fingerprint"]["sampler"] == "unbroken"  # O(1), not replayed
    reference = unbroken.DataLoader(
        dataset,
        batch_size=2,
        shuffle=expected.get("shuffle", True),
        **{k: v for k, v in expected.items() if k != "shuffle"}
        | ({"seed": loader.seed} if "seed" not in expected else {}),
    )
    assert indices(loader) == indices(reference)


def test_a_sampler_of_another_dataset_stays_a_user_sampler():
    loader = unbroken.DataLoader(Indexed(), batch_size=2, sampler=SequentialSampler(range(20)))
    assert loader.state_dict()["fingerprint"]["sampler"] != "unbroken"


def test_default_seed_comes_from_torchs_global_generator_without_consuming_it():
    def run():
        loader = unbroken.DataLoader(Indexed(), batch_size=4, shuffle=True)
        return loader.seed, indices(loader), torch.rand(())

    torch.manual_seed(0)
    first = run()
    torch.manual_seed(0)
    second = run()
    torch.manual_seed(1)
    third = run()
    assert first[0] == second[0] and first[1] == second[1]  # torch.manual_seed reproduces it
    assert third[0] != first[0] and third[1] != first[1]
    torch.manual_seed(0)
    # The draw torch's RandomSampler would make, read without moving the generator: building a
    # loader (maybe lazily, as Lightning builds a val loader) leaves the training draws alone.
    assert first[0] == int(torch.empty((), dtype=torch.int64).random_().item())
    torch.manual_seed(0)
    assert torch.equal(first[2], torch.rand(()))


def test_a_default_seed_is_adopted_from_the_saved_state():
    torch.manual_seed(0)
    saved = unbroken.DataLoader(Indexed(), batch_size=4, shuffle=True)
    next(iter(saved))
    torch.manual_seed(1)
    resumed = unbroken.DataLoader(Indexed(), batch_size=4, shuffle=True)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.seed == saved.seed


@pytest.mark.parametrize("shuffle", [False, True])
def test_resumes_exactly_when_re_created(shuffle):
    base = unbroken.DataLoader(Indexed(10), batch_size=3, shuffle=shuffle, seed=1)
    assert assert_resumes_exactly(lambda: re_create(base), epochs=2)


def test_the_sampler_outlives_its_loader_which_is_freed_at_once():
    import gc
    import weakref

    gc.disable()  # freed by reference counting alone: no cycle through the sampler
    try:
        loader = unbroken.DataLoader(Indexed(), batch_size=4, shuffle=True, seed=3)
        expected = indices(loader)  # epoch 0
        sampler, alive = loader.sampler, weakref.ref(loader)
        del loader
        assert alive() is None
        assert sampler.epoch == 1  # the last epoch it was told
        sampler.set_epoch(0)
        assert list(sampler) == expected
        assert (
            list(unbroken.DataLoader(Indexed(), batch_size=4, seed=3, shuffle=True).sampler)
            == expected
        )
    finally:
        gc.enable()


def test_a_random_sampler_of_fewer_samples_than_the_dataset_stays_torchs():
    # RandomSampler(num_samples < len(dataset)) draws a subset: not a shuffle of the whole
    # dataset, so it must not become unbroken's order (which reads all of it).
    dataset = Indexed(20)
    sampler = RandomSampler(dataset, num_samples=6, generator=torch.Generator().manual_seed(1))
    loader = unbroken.DataLoader(dataset, batch_size=2, sampler=sampler, seed=0)
    assert loader.state_dict()["fingerprint"]["sampler"] != "unbroken"
    assert len(indices(loader)) == 6
