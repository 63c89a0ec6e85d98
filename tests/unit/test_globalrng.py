import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.train.globalrng import GlobalRNG


def _draws():
    return (
        torch.rand(3),
        np.random.rand(3),
        [random.random() for _ in range(3)],
        np.random.normal(),
        random.gauss(0, 1),
    )


def _assert_same_draws(got, expected):
    """torch's, numpy's and random's streams (and their cached gaussians) all continued."""
    assert torch.equal(got[0], expected[0]), "torch"
    assert np.array_equal(got[1], expected[1]), "numpy"
    assert got[2] == expected[2], "random"
    assert got[3] == expected[3], "numpy's cached gaussian"
    assert got[4] == expected[4], "random's cached gaussian"


def _scramble():
    torch.manual_seed(99), np.random.seed(99), random.seed(99)


def test_restoring_continues_every_global_stream():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    np.random.normal(), random.gauss(0, 1)  # leave cached gaussians behind: they are state too
    state = GlobalRNG().state_dict()
    expected = _draws()
    _scramble()
    GlobalRNG().load_state_dict(state)
    _assert_same_draws(_draws(), expected)


def test_the_state_saves_with_weights_only(tmp_path):
    torch.manual_seed(2), np.random.seed(2), random.seed(2)
    np.random.normal(), random.gauss(0, 1)
    state = GlobalRNG().state_dict()
    torch.save(state, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)
    expected = _draws()
    _scramble()
    GlobalRNG().load_state_dict(loaded)
    _assert_same_draws(_draws(), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_restoring_continues_the_cuda_streams(tmp_path):
    torch.cuda.manual_seed_all(3)
    torch.rand(3, device="cuda")  # initializes CUDA: its generators are in the state from now on
    torch.save(GlobalRNG().state_dict(), tmp_path / "rng.pt")
    expected = [torch.rand(3, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    torch.cuda.manual_seed_all(99)
    GlobalRNG().load_state_dict(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = [torch.rand(3, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_malformed_state_is_a_value_error():
    with pytest.raises(ValueError, match="expected the keys"):
        GlobalRNG().load_state_dict({"torch": torch.get_rng_state()})


# The Trainer seeds the global generators before each validation batch from (seed, VAL, epoch,
# batch, rank): what a validation batch draws (dropout left on, a random crop) is the same
# whether the run was resumed, how many training steps came before, and on any number of ranks.
VAL_BATCHES = 3


def _validation_draws(directory, train_batches: int, seed: int = 5) -> dict:
    """What each validation batch drew from torch, numpy and ``random``, by (epoch, batch)."""
    import unbroken

    drawn: dict = {}
    trainer = unbroken.Trainer(
        directory, max_epochs=2, seed=seed, progress_bar=False, checkpoint_every_steps=None
    )

    def validation_step(model, batch):
        epoch, k = trainer.progress.epoch, int(batch[0])
        drawn[epoch, k] = (torch.rand(2).tolist(), float(np.random.rand()), random.random())
        return model(batch.float().unsqueeze(1)).sum()

    model = torch.nn.Linear(1, 1)
    trainer.fit(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        unbroken.DataLoader(torch.arange(train_batches), batch_size=1, seed=0),
        unbroken.DataLoader(torch.arange(VAL_BATCHES), batch_size=1, seed=0),
        training_step=lambda model, batch: model(batch.float().unsqueeze(1)).sum(),
        validation_step=validation_step,
    )
    return drawn


def test_each_validation_batch_draws_from_its_seed_epoch_and_index_not_the_training_step(tmp_path):
    from unbroken.train.globalrng import VAL, seed_step

    drawn = _validation_draws(tmp_path / "short", train_batches=2)
    assert sorted(drawn) == [(e, k) for e in range(2) for k in range(VAL_BATCHES)]
    for (epoch, k), draws in drawn.items():
        seed_step(5, VAL, epoch, k, 0)
        expected = (torch.rand(2).tolist(), float(np.random.rand()), random.random())
        assert draws == expected, (epoch, k)
    assert len({str(draws) for draws in drawn.values()}) == len(drawn)  # no two alike
    # Twice as many training steps before each validation: the same validation draws.
    assert _validation_draws(tmp_path / "long", train_batches=4) == drawn


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**70),
    phase=st.sampled_from([1, 2]),
    epoch=st.integers(0, 2**20),
    step=st.integers(0, 2**40),
    rank=st.integers(0, 4096),
)
def test_a_steps_seeds_are_the_documented_derivation_of_its_five_parts(
    seed, phase, epoch, step, rank
):
    """``seed_step`` seeds from ``derive_key(seed mod 2**64, phase, epoch, step, rank)``, however
    it computes it: another derivation would draw other numbers after an upgrade's resume. The
    same (seed, phase, epoch) is asked twice, with other steps between, to reach any cache."""
    from unbroken.data.keys import derive_key
    from unbroken.train.globalrng import seed_step

    key = derive_key(seed % 2**64, phase, epoch, step, rank)
    random.seed(key)
    np.random.seed(key % 2**32)
    torch.default_generator.manual_seed(key % 2**63)
    expected = _draws()
    for other in (step + 1, step):
        _scramble()
        seed_step(seed, phase, epoch, other, rank)
    _assert_same_draws(_draws(), expected)
    seed_step(seed, 3 - phase, epoch, step, rank)  # the other phase: other draws
    assert not torch.equal(_draws()[0], expected[0])
