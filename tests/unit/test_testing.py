"""The public helper must catch loaders that do not resume exactly, and say where."""

import pytest
import torch
from pipelines import Counting

import unbroken
from unbroken.testing import assert_resumes_exactly, assert_same


class ForgetfulLoader:
    """Looks resumable but restarts every epoch from zero: the bug the helper exists to catch."""

    def __init__(self):
        self.inner = unbroken.DataLoader(Counting(6), batch_size=2, shuffle=True, seed=1)

    @property
    def epoch(self):
        return self.inner.epoch

    def __iter__(self):
        return iter(self.inner)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        state = dict(state, samples=0, batches=0)
        self.inner.load_state_dict(state)


class OffByOneEpoch(ForgetfulLoader):
    """Resumes the position but one epoch late, as torchdata did at epoch ends (#1437)."""

    def load_state_dict(self, state):
        self.inner.load_state_dict(dict(state, epoch=state["epoch"] + 1))


def test_a_loader_that_restarts_from_zero_is_caught():
    with pytest.raises(AssertionError, match=r"inside epoch 0 after its batch 0 \(1 batches"):
        assert_resumes_exactly(ForgetfulLoader, epochs=2)


def test_a_loader_that_skips_an_epoch_is_caught():
    with pytest.raises(AssertionError, match="got 3 batches, the uninterrupted run has 6"):
        assert_resumes_exactly(OffByOneEpoch, epochs=2)


def test_cut_points_are_counted_and_checked():
    make = lambda: unbroken.DataLoader(Counting(5), batch_size=2, seed=0)
    assert assert_resumes_exactly(make, epochs=3) == 1 + 3 * 4
    assert assert_resumes_exactly(make, epochs=3, cuts=[0, 4, 12]) == 3
    with pytest.raises(ValueError, match="out of range"):
        assert_resumes_exactly(make, epochs=1, cuts=[99])


@pytest.mark.parametrize(
    "got, want, match",
    [
        (torch.tensor([1, 2]), torch.tensor([1, 3]), "tensors differ"),
        (torch.tensor([1, 2]), torch.tensor([1.0, 2.0]), "tensors differ"),
        ({"a": 1}, {"b": 1}, "keys"),
        ([1, 2], (1, 2), "type list != tuple"),
        ([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)], "length 1 != 2"),
        ({"x": [1, "a"]}, {"x": [1, "b"]}, r"value\['x'\]\[1\]: 'a' != 'b'"),
    ],
)
def test_assert_same_names_the_difference(got, want, match):
    with pytest.raises(AssertionError, match=match):
        assert_same(got, want)
    assert_same(want, want)
