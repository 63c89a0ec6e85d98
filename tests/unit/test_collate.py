"""A ``collate_fn`` that draws (masking, mixing) draws what its batch's seeds give: the same at
any ``num_workers``, after any resume, and as the documented derivation computed here without
the loader; in the training process it leaves the step's torch generator alone."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from pipelines import Augmented
from torch.utils.data import default_collate

import unbroken
from unbroken.data import keys
from unbroken.data.rng import GLOBAL_RNGS, batch_seeds, collate_seeds
from unbroken.data.sources.fetch import SeededCollate
from unbroken.testing import assert_resumes_exactly, assert_same


def masking(samples):
    """A collator that draws from torch's, numpy's and ``random``'s global generators, as
    transformers' ``DataCollatorForLanguageModeling`` draws torch's for its mask."""
    batch = default_collate(samples)
    n = len(samples)
    batch["mask"] = torch.rand(n) < 0.5
    batch["mask_torch"] = torch.rand(3)
    batch["mask_numpy"] = torch.from_numpy(np.random.rand(3))
    batch["mask_random"] = torch.tensor([random.random() for _ in range(3)], dtype=torch.float64)
    return batch


def collate_draws(batch_size: int, key: int, position: int) -> dict:
    """What ``masking`` draws for the batch at ``position``, from the documented seeds."""
    torch_seed, numpy_seed, random_seed = collate_seeds(key, position)
    torch_gen = torch.Generator().manual_seed(torch_seed)
    numpy_gen, random_gen = np.random.RandomState(numpy_seed), random.Random(random_seed)
    return {
        "mask": torch.rand(batch_size, generator=torch_gen) < 0.5,
        "mask_torch": torch.rand(3, generator=torch_gen),
        "mask_numpy": torch.from_numpy(numpy_gen.rand(3)),
        "mask_random": torch.tensor([random_gen.random() for _ in range(3)], dtype=torch.float64),
    }


class Positions(torch.utils.data.Dataset):
    """Sample i is i (so an unshuffled batch's first index is its position), drawing too."""

    def __len__(self) -> int:
        return 14

    def __getitem__(self, index: int) -> dict:
        return {"index": torch.tensor(index), "aug": torch.rand(1)}


class Range(torch.utils.data.IterableDataset):
    """A global-cursor stream: items [start, stop) of ``Positions``."""

    def __len__(self) -> int:
        return 14

    def read_range(self, start: int, stop: int) -> list[dict]:
        return [Positions()[i] for i in range(start, min(stop, 14))]

    def __iter__(self):
        return iter(self.read_range(0, 14))


class Replayed(torch.utils.data.IterableDataset):
    """Any other iterable: one replica per worker, resumed by replaying."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, 14, workers):
            yield Positions()[i]  # drawn as it is read, seeded for its batch


def _epochs(loader, epochs: int = 2) -> list:
    return [batch for _ in range(epochs) for batch in loader]


@pytest.mark.parametrize("dataset", ["map", "map-shuffled", "range-stream"])
def test_a_drawing_collate_fn_gives_the_same_batches_at_any_worker_count(dataset):
    def stream(workers: int) -> list:
        data = Range() if dataset == "range-stream" else Augmented(13)
        loader = unbroken.DataLoader(
            data,
            batch_size=4,
            shuffle=True if dataset == "map-shuffled" else None,
            num_workers=workers,
            seed=11,
            collate_fn=masking,
        )
        return _epochs(loader)

    reference = stream(0)
    assert_same(stream(2), reference, "num_workers=2")
    masks = {tuple(batch["mask_torch"].tolist()) for batch in reference}
    assert len(masks) == len(reference)  # each batch of each epoch draws its own


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dataset", ["map", "range-stream"])
def test_a_collate_fn_draws_what_the_documented_derivation_gives(workers, dataset):
    """The batch's generators seeded with ``collate_seeds(key, first position)`` right before
    ``collate_fn``: its draws do not depend on what the samples drew before it."""
    data = Range() if dataset == "range-stream" else Positions()
    loader = unbroken.DataLoader(
        data, batch_size=4, num_workers=workers, seed=5, collate_fn=masking
    )
    for epoch in range(2):
        key = keys.samples(5, epoch)
        batches = list(loader)
        assert len(batches) == 4
        for batch in batches:
            first = batch["index"][0].item()
            drawn = {
                name: batch[name] for name in ("mask", "mask_torch", "mask_numpy", "mask_random")
            }
            assert_same(drawn, collate_draws(len(batch["index"]), key, first), f"batch at {first}")


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_collates_with_the_seeds_of_its_own_positions(rank):
    loader = unbroken.DataLoader(
        Positions(), batch_size=3, seed=2, rank=rank, world_size=2, collate_fn=masking
    )
    key = keys.samples(2, 0)
    for number, batch in enumerate(loader):
        first = batch["index"][0].item()
        assert first == 6 * number + 3 * rank or number == 2  # the split tail: 14 = 2*6 + 2
        drawn = collate_draws(len(batch["index"]), key, first)
        assert_same(batch["mask_torch"], drawn["mask_torch"], f"rank {rank} batch {number}")


def test_without_automatic_batching_the_collate_fn_is_seeded_per_sample():
    def noisy(sample):
        return {"index": sample["index"], "noise": torch.rand(2)}

    key = keys.samples(3, 0)
    for workers in (0, 2):
        loader = unbroken.DataLoader(
            Positions(), batch_size=None, num_workers=workers, seed=3, collate_fn=noisy
        )
        for position, sample in enumerate(loader):
            expected = torch.Generator().manual_seed(collate_seeds(key, position)[0])
            assert torch.equal(sample["noise"], torch.rand(2, generator=expected)), position


@pytest.mark.filterwarnings("ignore:unbroken. Replayed has no state_dict")
@pytest.mark.parametrize(
    "dataset, workers, resumed_workers",
    [
        ("map-shuffled", 0, 2),
        ("map-shuffled", 2, 0),
        ("map-shuffled", 0, 0),
        ("range-stream", 0, 2),
        ("replay-stream", 0, 0),
        ("replay-stream", 2, 2),
    ],
)
def test_a_drawing_collate_fn_resumes_exactly(dataset, workers, resumed_workers):
    def make(num_workers: int):
        def build():
            data = {"map-shuffled": Augmented(13), "range-stream": Range()}.get(dataset, Replayed())
            return unbroken.DataLoader(
                data,
                batch_size=4,
                shuffle=True if dataset == "map-shuffled" else None,
                num_workers=num_workers,
                seed=9,
                collate_fn=masking,
            )

        return build

    cuts = None if workers == resumed_workers == 0 else [0, 2, 4, 5, 9]  # workers start slowly
    assert assert_resumes_exactly(make(workers), 2, resume_with=make(resumed_workers), cuts=cuts)


@pytest.mark.parametrize("dataset", ["map", "range-stream"])
def test_a_collate_fn_in_the_training_process_leaves_its_torch_generator_alone(dataset):
    """With ``num_workers=0`` the collate runs in the training process: the step's dropout must
    draw what it would have drawn with workers, or with no loader at all."""
    torch.manual_seed(0)
    expected = torch.rand(5)
    torch.manual_seed(0)
    data = Range() if dataset == "range-stream" else Augmented(8)
    loader = unbroken.DataLoader(data, batch_size=4, seed=1, collate_fn=masking)
    for _ in loader:
        pass
    assert torch.equal(torch.rand(5), expected)


def test_the_collate_leaves_numpy_and_random_as_its_seeds_give_them():
    """numpy's and ``random``'s generators are not put back (too costly): with
    ``num_workers=0`` the step finds them as the collate left them, the same after a resume."""
    loader = unbroken.DataLoader(Positions(), batch_size=4, seed=8, collate_fn=masking)
    next(iter(loader))
    _, numpy_seed, random_seed = collate_seeds(keys.samples(8, 0), 0)
    numpy_gen, random_gen = np.random.RandomState(numpy_seed), random.Random(random_seed)
    numpy_gen.rand(3)
    [random_gen.random() for _ in range(3)]
    assert np.random.rand() == numpy_gen.rand()
    assert random.random() == random_gen.random()


def test_torch_s_own_collate_functions_are_not_seeded():
    # They draw nothing: seeding them would cost ~8 us a batch for no change.
    assert SeededCollate(default_collate, GLOBAL_RNGS).seeds is None
    assert SeededCollate(masking, ()).seeds is None
    assert SeededCollate(masking, GLOBAL_RNGS).seeds is not None


def test_the_collate_stream_is_not_the_samples_stream():
    key = keys.samples(1, 0)
    for position in (0, 4, 2**31):
        assert not set(collate_seeds(key, position)) & set(batch_seeds(key, position))
    positions = range(100_000)
    assert len({collate_seeds(key, p)[0] for p in positions}) == len(positions)
