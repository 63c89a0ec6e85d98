import pytest
import torch
from pipelines import Augmented

import unbroken
from unbroken.data.rng import check_global_rngs
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
def test_a_sample_draws_the_same_whatever_batch_it_is_in(shuffle):
    def samples(batch_size):
        loader = unbroken.DataLoader(Augmented(10), batch_size=batch_size, shuffle=shuffle, seed=3)
        rows = {}
        for batch in loader:
            for i, index in enumerate(batch["index"].tolist()):
                rows[index] = {key: value[i] for key, value in batch.items()}
        return rows

    by_one, by_four = samples(1), samples(4)
    assert sorted(by_one) == list(range(10))
    for index in range(10):
        assert_same(by_four[index], by_one[index], f"sample {index}")
    assert len({row["torch"][0].item() for row in by_one.values()}) == 10
