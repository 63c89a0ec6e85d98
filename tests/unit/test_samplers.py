"""User samplers and batch samplers: restored through their own state, or skipped with a warning."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pipelines import Augmented, Stateless

import unbroken
from unbroken.testing import assert_resumes_exactly


class EpochShuffleSampler(torch.utils.data.Sampler):
    """Shuffles by (seed, epoch) with a torch.Generator; its state holds that generator's state."""

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch = n, seed, 0
        self.generator = torch.Generator()
        self.yielded, self.loads, self.epochs_set = 0, 0, []

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __len__(self):
        return self.n

    def __iter__(self):
        if self.yielded == 0:
            self.generator.manual_seed(self.seed * 1000 + self.epoch)
            self.order = torch.randperm(self.n, generator=self.generator).tolist()
        while self.yielded < self.n:
            self.yielded += 1
            yield self.order[self.yielded - 1]
        self.yielded = 0

    def state_dict(self):
        return {"yielded": self.yielded, "order": torch.tensor(self.order), "epoch": self.epoch}

    def load_state_dict(self, state):
        self.loads += 1
        self.yielded, self.epoch = state["yielded"], state["epoch"]
        self.order = state["order"].tolist()


class Batches(torch.utils.data.Sampler):
    """A batch sampler of uneven batches, with or without state."""

    def __init__(self, n, stateful):
        self.n, self.position = n, 0
        if stateful:
            self.state_dict = lambda: {"position": self.position}
            self.load_state_dict = lambda s: setattr(self, "position", s["position"])

    def __len__(self):
        return len(self._batches())

    def _batches(self):
        out, start, size = [], 0, 1
        while start < self.n:
            out.append(list(range(start, min(start + size, self.n)))[::-1])
            start, size = start + size, size % 3 + 1
        return out

    def __iter__(self):
        batches = self._batches()
        while self.position < len(batches):
            self.position += 1
            yield batches[self.position - 1]
        self.position = 0


@given(n=st.integers(1, 25), batch_size=st.integers(1, 4), drop_last=st.booleans())
@settings(max_examples=20)
def test_a_stateful_sampler_is_restored_through_its_state(n, batch_size, drop_last):
    samplers = []

    def make():
        samplers.append(EpochShuffleSampler(n, seed=5))
        return unbroken.DataLoader(
            Augmented(n), batch_size=batch_size, sampler=samplers[-1], drop_last=drop_last, seed=1
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no skipping warning: nothing is skipped
        assert_resumes_exactly(make, epochs=2)
    assert samplers[0].epochs_set == [0, 1]
    if len(samplers[0]) // batch_size >= 2:  # a cut inside an epoch restores the sampler's state
        assert any(s.loads for s in samplers)


def test_a_stateful_sampler_state_travels_as_json():
    loader = unbroken.DataLoader(
        Augmented(8), batch_size=2, sampler=EpochShuffleSampler(8, 1), seed=0
    )
    iterator = iter(loader)
    next(iterator)
    saved = loader.state_dict()["source"]
    assert saved["end"] is False
    assert saved["state"]["yielded"] == 2 and "__tensor__" in saved["state"]["order"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateless_sampler_is_skipped_with_one_warning(workers):
    make = lambda: unbroken.DataLoader(
        Augmented(11), batch_size=3, sampler=Stateless(11), num_workers=workers, seed=2
    )
    with pytest.warns(UserWarning, match=r"Stateless has no state_dict.*O\(k\)") as record:
        assert_resumes_exactly(make, epochs=2, cuts=[2, 3, 7])
    assert len([w for w in record if "Stateless" in str(w.message)]) == 3  # once per loader


@pytest.mark.parametrize("stateful", [True, False])
def test_a_user_batch_sampler_resumes_exactly(stateful):
    make = lambda: unbroken.DataLoader(Augmented(13), batch_sampler=Batches(13, stateful), seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if not stateful else "error")
        assert assert_resumes_exactly(make, epochs=2) == 1 + 2 * (len(Batches(13, False)) + 1)


def test_skipping_past_the_end_of_a_sampler_is_a_clear_error():
    loader = unbroken.DataLoader(Augmented(6), batch_size=2, sampler=Stateless(6), seed=0)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    short = unbroken.DataLoader(Augmented(6), batch_size=2, sampler=Stateless(1), seed=0)
    short.load_state_dict(state)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="yields only 1"):
        list(short)


def test_a_different_sampler_class_is_a_mismatch():
    loader = unbroken.DataLoader(Augmented(6), batch_size=2, sampler=Stateless(6), seed=0)
    other = unbroken.DataLoader(
        Augmented(6), batch_size=2, sampler=EpochShuffleSampler(6, 0), seed=0
    )
    with pytest.raises(ValueError, match="sampler='pipelines.Stateless'"):
        other.load_state_dict(loader.state_dict())
