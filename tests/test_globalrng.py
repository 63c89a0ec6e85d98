import random

import numpy as np
import pytest
import torch

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
