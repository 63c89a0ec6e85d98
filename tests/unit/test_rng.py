import random

import numpy as np
import pytest
import torch
from pipelines import Augmented

import unbroken
from unbroken.data.keys import derive_key
from unbroken.data.rng import (
    batch_seeds,
    check_global_rngs,
    sample_rng_seed,
    sample_seed_at,
    stream32,
)
from unbroken.testing import assert_same


def _stream(num_workers, **kwargs):
    loader = unbroken.DataLoader(
        Augmented(13), batch_size=4, shuffle=True, num_workers=num_workers, seed=11, **kwargs
    )
    return [batch for _ in range(2) for batch in loader]


def test_per_sample_randomness_does_not_depend_on_workers():
    reference = _stream(0)
    for workers in (1, 2, 3):
        assert_same(_stream(workers), reference, f"num_workers={workers}")


def test_randomness_depends_on_seed_epoch_and_position_only():
    loader = unbroken.DataLoader(Augmented(8), batch_size=8, seed=1)
    epoch0, epoch1 = list(loader), list(loader)
    assert torch.equal(epoch0[0]["index"], epoch1[0]["index"])  # unshuffled: same indices
    for name in ("torch", "numpy", "random", "own"):
        assert not torch.equal(epoch0[0][name], epoch1[0][name]), name  # new epoch, new draws
        rows = epoch0[0][name]
        assert len({tuple(row.tolist()) for row in rows}) == 8, name  # each sample its own
    other_seed = list(unbroken.DataLoader(Augmented(8), batch_size=8, seed=2))
    assert not torch.equal(other_seed[0]["torch"], epoch0[0]["torch"])


def test_sample_rng_repeats_within_a_sample_and_restarts_on_refetch():
    class TwoDraws(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, index):
            first = torch.rand(1, generator=unbroken.sample_rng())
            assert unbroken.sample_rng() is unbroken.sample_rng()
            return torch.cat([first, torch.rand(1, generator=unbroken.sample_rng())])

    loader = unbroken.DataLoader(TwoDraws(), batch_size=3, seed=4)
    (batch,) = list(loader)
    assert all(row[0] != row[1] for row in batch)
    loader.load_state_dict(unbroken.DataLoader(TwoDraws(), batch_size=3, seed=4).state_dict())
    (again,) = list(loader)
    assert torch.equal(batch, again)


def test_opting_out_leaves_the_global_generator_alone():
    class Peek(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return torch.rand(1), torch.rand(1, generator=unbroken.sample_rng())

    torch.manual_seed(0)
    loader = unbroken.DataLoader(Peek(), batch_size=2, seed=4, global_rngs=())
    ((globals_, own),) = list(loader)
    torch.manual_seed(0)
    expected = torch.rand(2, 1)
    assert torch.equal(globals_, expected)  # not re-seeded: it just continued the global stream
    seeded = list(unbroken.DataLoader(Peek(), batch_size=2, seed=4))[0]
    assert torch.equal(seeded[1], own)  # sample_rng() is exact with or without global seeding


def test_sample_seed_outside_a_fetch_is_an_error():
    with pytest.raises(RuntimeError, match="inside your dataset's __getitem__"):
        unbroken.sample_seed()
    with pytest.raises(RuntimeError):
        unbroken.sample_rng()


def test_global_rngs_are_checked():
    assert check_global_rngs(["random", "torch"]) == ("torch", "random")
    assert check_global_rngs("numpy") == ("numpy",)
    with pytest.raises(ValueError, match="unknown generator"):
        check_global_rngs(("torch", "jax"))


@pytest.mark.parametrize("shuffle", [False, True])
def test_sample_rng_and_sample_seed_do_not_depend_on_the_batch(shuffle):
    def samples(batch_size):
        loader = unbroken.DataLoader(Augmented(10), batch_size=batch_size, shuffle=shuffle, seed=3)
        rows = {}
        for batch in loader:
            for i, index in enumerate(batch["index"].tolist()):
                rows[index] = {key: value[i] for key, value in batch.items()}
        return rows

    by_one, by_four = samples(1), samples(4)
    assert sorted(by_one) == list(range(10))
    for index in range(10):  # the global generators are seeded per batch: those differ
        assert_same(by_four[index]["own"], by_one[index]["own"], f"sample {index}")
    assert len({row["torch"][0].item() for row in by_one.values()}) == 10
    assert len({row["torch"][0].item() for row in by_four.values()}) == 10


def test_seeds_are_a_bijection_of_the_position_within_an_epoch():
    # The issue that made them so: an epoch of 1,281,167 samples seeded from a 64-bit hash
    # truncated to 32 bits had 164 pairs of positions drawing identical numbers.
    key = derive_key(123, 4)
    positions = range(1_281_167)
    assert len({stream32(key, p) for p in positions}) == len(positions)
    assert len({sample_rng_seed(key, p) for p in positions}) == len(positions)
    assert all(0 <= stream32(key, p) < 2**32 for p in (0, 1, 2**32 - 1, 2**40 + 7))
    assert stream32(key, 5) != stream32(derive_key(123, 5), 5)  # another epoch, another seed
    torch_seed, numpy_seed, random_seed = batch_seeds(key, 8)
    assert len({torch_seed, numpy_seed, random_seed, sample_rng_seed(key, 8)}) == 4


def test_torch_and_numpy_do_not_draw_one_stream():
    # torch's CPU generator and numpy's legacy one are both MT19937: seeded with the same 32
    # bits they emit the same raw numbers, which correlates a torch flip with a numpy crop.
    class Raw(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.randint(0, 2**31, (16,)), torch.from_numpy(np.random.randint(0, 2**31, 16))

    for batch_torch, batch_numpy in unbroken.DataLoader(Raw(), batch_size=2, seed=0):
        assert not set(batch_torch.flatten().tolist()) & set(batch_numpy.flatten().tolist())


class _Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 11

    def __getitem__(self, index):
        return {
            "torch": torch.rand(2),
            "numpy": torch.from_numpy(np.random.rand(2)),
            "random": torch.tensor(random.random(), dtype=torch.float64),
            "own": torch.rand(2, generator=unbroken.sample_rng()),
            "seed": torch.tensor(unbroken.sample_seed() >> 1),  # 63 bits fit an int64
        }


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_draws_what_the_documented_derivation_gives(workers):
    """Checked against the README's derivation computed here, without the loader: the batch's
    generators seeded from its first position, its samples drawing in turn."""
    loader = unbroken.DataLoader(_Probe(), batch_size=3, shuffle=True, seed=6, num_workers=workers)
    for epoch in range(2):
        key = derive_key(6, epoch)
        for number, batch in enumerate(loader):
            first = 3 * number
            torch_seed, numpy_seed, random_seed = batch_seeds(key, first)
            torch_gen = torch.Generator().manual_seed(torch_seed)
            numpy_gen = np.random.RandomState(numpy_seed)
            random_gen = random.Random(random_seed)
            for i in range(len(batch["torch"])):
                position = first + i
                assert torch.equal(batch["torch"][i], torch.rand(2, generator=torch_gen))
                assert batch["numpy"][i].tolist() == numpy_gen.rand(2).tolist()
                assert batch["random"][i].item() == random_gen.random()
                own = torch.Generator().manual_seed(sample_rng_seed(key, position))
                assert torch.equal(batch["own"][i], torch.rand(2, generator=own))
                assert batch["seed"][i].item() == sample_seed_at(key, position) >> 1
