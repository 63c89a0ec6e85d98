import random

import numpy as np
import pytest
import torch

from unbroken.globalrng import GlobalRNG


def _draws():
    return (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)],
            np.random.normal(), random.gauss(0, 1))


def test_restoring_continues_every_global_stream():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    np.random.normal(), random.gauss(0, 1)  # leave cached gaussians behind: they are state too
    state = GlobalRNG().state_dict()
    expected = _draws()
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    GlobalRNG().load_state_dict(state)
    got = _draws()
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2:] == expected[2:]


def test_the_state_saves_with_weights_only(tmp_path):
    state = GlobalRNG().state_dict()
    torch.save(state, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)
    expected = _draws()
    GlobalRNG().load_state_dict(loaded)
    assert torch.equal(_draws()[0], expected[0])


def test_a_malformed_state_is_a_value_error():
    with pytest.raises(ValueError, match="expected the keys"):
        GlobalRNG().load_state_dict({"torch": torch.get_rng_state()})
