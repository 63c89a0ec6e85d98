"""unbroken.shuffle_buffer: a windowed stream shuffle that resumes exactly, re-reading < 1 window."""

import json
import random
import threading
import warnings
import weakref
from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pipelines import Counting

import unbroken
from unbroken.data.buffered_shuffle import ShuffleBuffer, shuffle_buffer
from unbroken.data.iterable import resumable
from unbroken.testing import assert_resumes_exactly

SKIP_WARNING = r"ignore:.*costs O\(k\):UserWarning"


def generator_items(n, epoch):
    g = torch.Generator().manual_seed(epoch)
    for i in range(n):
        yield {"i": i, "x": torch.rand(2, generator=g)}


class Reader:
    """A DALI-style stateful loader (reset() per epoch, torch's Stateful protocol) that counts
    the items it reads."""

    def __init__(self, n):
        self.n, self.reads, self.epoch, self.position = n, 0, 0, 0

    def reset(self, epoch):
        self.epoch, self.position = epoch, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.position >= self.n:
            raise StopIteration
        self.position += 1
        self.reads += 1
        return (self.epoch, self.position - 1)

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.loaded = True
        self.epoch, self.position = state["epoch"], state["position"]


def reader_buffer(n, size, seed, reader=None):
    reader = reader or Reader(n)

    def for_epoch(epoch):
        reader.reset(epoch)
        return reader

    return shuffle_buffer(for_epoch, size, seed=seed)


def cut_points(n, epochs):
    return 1 + epochs * (n + 1)


@given(
    n=st.integers(0, 16),
    size=st.integers(1, 6),
    seed=st.integers(0, 2**64 - 1),
    epochs=st.integers(1, 3),
    kind=st.sampled_from(["list", "generator", "stateful", "own epochs"]),
)
@settings(max_examples=200)
@example(n=41, size=7, seed=2**64 - 1, epochs=3, kind="stateful")
@example(n=40, size=8, seed=0, epochs=3, kind="generator")
@pytest.mark.filterwarnings(SKIP_WARNING)
def test_every_cut_resumes_exactly(n, size, seed, epochs, kind):
    if kind == "list":
        items = [torch.tensor([i, 2 * i]) for i in range(n)]
        make = lambda: shuffle_buffer(items, size, seed=seed)
    elif kind == "generator":
        make = lambda: shuffle_buffer(lambda e: generator_items(n, e), size, seed=seed)
    elif kind == "stateful":
        make = lambda: reader_buffer(n, size, seed)
    else:
        make = lambda: shuffle_buffer(OwnEpochs(n), size, seed=seed)
    with warnings.catch_warnings():
        if kind in ("stateful", "own epochs"):
            warnings.simplefilter("error")  # restored through its state: no skip warning
        assert assert_resumes_exactly(make, epochs=epochs) == cut_points(n, epochs)


@given(n=st.integers(0, 30), size=st.integers(1, 8), seed=st.integers(0, 2**64 - 1))
@settings(max_examples=60)
def test_each_epoch_is_a_permutation_that_keeps_items_in_their_window(n, size, seed):
    buffer = shuffle_buffer(list(range(n)), size, seed=seed)
    for _ in range(2):
        out = list(buffer)
        assert sorted(out) == list(range(n))
        for start in range(0, n, size):  # the trade-off: no item leaves its window
            assert sorted(out[start : start + size]) == list(range(start, min(start + size, n)))


def test_epochs_and_seeds_give_different_orders():
    for seed in range(20):
        buffer = shuffle_buffer(list(range(20)), 10, seed=seed)
        orders = [tuple(buffer) for _ in range(3)]
        assert len(set(orders)) == 3
        assert orders[0] != tuple(shuffle_buffer(list(range(20)), 10, seed=seed + 100))


def test_every_order_of_a_window_is_equally_likely():
    counts = Counter(tuple(shuffle_buffer(range(4), 4, seed=seed)) for seed in range(2400))
    assert len(counts) == 24
    chi2 = sum((c - 100) ** 2 / 100 for c in counts.values())
    assert chi2 < 49.7  # the 99.9% quantile of chi-square with 23 degrees of freedom


@given(n=st.integers(1, 40), size=st.integers(1, 10), seed=st.integers(0, 2**32), data=st.data())
@settings(max_examples=150)
def test_a_resume_re_reads_less_than_one_window(n, size, seed, data):
    epochs = 2
    saved, stream = [], []
    buffer = reader_buffer(n, size, seed)
    for _ in range(epochs):
        for item in buffer:
            stream.append(item)
            saved.append((len(stream), json.dumps(buffer.state_dict())))
    cut = data.draw(st.integers(0, len(saved) - 1), label="cut")
    received, state = saved[cut]
    reader = Reader(n)
    resumed = reader_buffer(n, size, seed, reader)
    resumed.load_state_dict(json.loads(state))
    rest = [item for _ in range(resumed.epoch, epochs) for item in resumed]
    assert rest == stream[received:]
    replayed = reader.reads - len(rest)
    state = json.loads(state)
    assert replayed == (0 if state["end"] else state["emitted"]) and replayed <= size - 1


@pytest.mark.filterwarnings(SKIP_WARNING)
def test_buffers_of_other_resumable_things():
    def make_loader():
        loader = unbroken.DataLoader(Counting(7), batch_size=2, shuffle=True, seed=5)
        return shuffle_buffer(loader, 3, seed=1)

    assert assert_resumes_exactly(make_loader, epochs=2) == cut_points(4, 2)
    nested = lambda: shuffle_buffer(shuffle_buffer(range(9), 4, seed=1), 3, seed=2)
    assert assert_resumes_exactly(nested, epochs=2) == cut_points(9, 2)
    named = lambda: shuffle_buffer(resumable(lambda e: range(5), name="a"), 2, seed=0)
    assert assert_resumes_exactly(named, epochs=2) == cut_points(5, 2)


@pytest.mark.filterwarnings(SKIP_WARNING)
def test_a_non_deterministic_upstream_is_caught():
    def noisy(epoch):
        for _ in range(6):
            yield random.random()

    with pytest.raises(AssertionError, match="resumed from the state saved"):
        assert_resumes_exactly(lambda: shuffle_buffer(noisy, 4, seed=0), epochs=2)

    buffer = shuffle_buffer(lambda epoch: range(10), 4, seed=0)
    for i, _ in enumerate(buffer):
        if i == 6:  # 3 of window 1 emitted
            state = buffer.state_dict()
            break
    shorter = shuffle_buffer(lambda epoch: range(6), 4, seed=0)
    shorter.load_state_dict(state)
    with pytest.raises(
        ValueError,
        match="3 items of window 1 of epoch 0 were emitted, but the upstream now yields 2 for it",
    ):
        list(shorter)


def test_epoch_boundary_inside_versus_after_the_loop():
    for n, end in [(5, True), (6, False)]:  # a short last window, then a full one
        buffer = reader_buffer(n, 3, seed=1)
        epochs = [list(buffer) for _ in range(2)]
        buffer = reader_buffer(n, 3, seed=1)
        for _ in buffer:
            inside = buffer.state_dict()
        after = buffer.state_dict()
        assert (inside["epoch"], inside["end"], after["epoch"]) == (0, end, 1)
        reader = Reader(n)
        resumed = reader_buffer(n, 3, 1, reader)
        resumed.load_state_dict(inside)
        assert list(resumed) == [] and resumed.epoch == 1 and reader.reads == 0
        assert list(resumed) == epochs[1]
        resumed.load_state_dict(after)
        assert list(resumed) == epochs[1]


class OwnEpochs:
    """Stateful like torchdata's StatefulDataLoader: each iter() starts its next epoch (unless a
    loaded state is pending), dropping an iterator ends nothing, and it has no ``epoch``."""

    def __init__(self, n):
        self.n, self.next_epoch, self.current, self.position = n, 0, None, 0
        self.in_epoch = self.resume = False

    def __iter__(self):
        if not self.resume:
            self.current, self.position, self.next_epoch = self.next_epoch, 0, self.next_epoch + 1
        self.resume, self.in_epoch = False, True
        return self._items()

    def _items(self):
        while self.position < self.n:
            self.position += 1
            yield (self.current, self.position - 1)
        self.in_epoch = False

    def state_dict(self):
        return {
            "next_epoch": self.next_epoch,
            "current": self.current,
            "position": self.position,
            "in_epoch": self.in_epoch,
        }

    def load_state_dict(self, state):
        self.next_epoch, self.current = state["next_epoch"], state["current"]
        self.position, self.in_epoch = state["position"], state["in_epoch"]
        self.resume = self.in_epoch


@pytest.mark.parametrize("upstream", ["resumable", "own epochs"])
@pytest.mark.parametrize("n", [7, 5])  # the break falls in a full window, or in the last one
def test_break_ends_the_epoch_at_once_for_the_upstream_too(upstream, n):
    def make():
        if upstream == "resumable":
            return reader_buffer(n, 3, seed=4)
        return shuffle_buffer(OwnEpochs(n), 3, seed=4)

    reference = make()
    epochs = [list(reference) for _ in range(3)]
    assert all(item[0] == epoch for epoch, items in enumerate(epochs) for item in items)
    for cut in range(n):
        buffer = make()
        for i, _ in enumerate(buffer):
            if i == cut:
                break
        state = buffer.state_dict()  # as with unbroken.DataLoader: the next epoch
        assert (buffer.epoch, state["epoch"], state["window"], state["emitted"]) == (1, 1, 0, 0)
        assert list(buffer) == epochs[1]
        resumed = make()
        resumed.load_state_dict(state)
        assert [list(resumed) for _ in range(2)] == epochs[1:]

    buffer = make()
    held = iter(buffer)
    next(held)  # an iterator still held ends its epoch at the next iter()
    iterator = iter(buffer)
    state = buffer.state_dict()
    assert buffer.epoch == 1 and list(iterator) == epochs[1]
    resumed = make()
    resumed.load_state_dict(state)
    assert [list(resumed) for _ in range(2)] == epochs[1:]


def test_an_unused_iter_starts_nothing_and_len_is_the_upstreams():
    buffer = shuffle_buffer(list(range(5)), 2, seed=0)
    iter(buffer)
    assert buffer.epoch == 0 and len(buffer) == 5
    assert sorted(buffer) == list(range(5)) and buffer.epoch == 1
    with pytest.raises(TypeError, match="has no len"):
        len(shuffle_buffer(lambda e: generator_items(3, e), 2, seed=0))


def test_set_epoch_goes_through_the_upstream():
    reference = shuffle_buffer(list(range(6)), 4, seed=2)
    epochs = [list(reference) for _ in range(3)]
    buffer = shuffle_buffer(list(range(6)), 4, seed=2)
    next(iter(buffer))
    buffer.set_epoch(2)
    assert list(buffer) == epochs[2]

    class NoSetEpoch(Reader):
        def __iter__(self):
            self.reset(self.epoch)
            return self

    with pytest.raises(TypeError, match="needs an upstream with set_epoch"):
        shuffle_buffer(NoSetEpoch(3), 2, seed=0).set_epoch(1)


class LockedStream:
    """An upstream whose state holds something JSON cannot."""

    def __iter__(self):
        return iter(range(4))

    def state_dict(self):
        return {"position": 0, "lock": threading.Lock()}

    def load_state_dict(self, state):
        pass


def test_an_upstream_state_that_json_cannot_hold_fails_at_state_dict_naming_the_key():
    buffer = shuffle_buffer(LockedStream(), 2, seed=0)
    match = r"LockedStream\.state_dict\(\)\.lock: a _thread\.lock cannot be saved as JSON"
    with pytest.raises(ValueError, match=match):
        buffer.state_dict()
    iterator = iter(buffer)
    next(iterator)  # iterating works; only saving fails
    with pytest.raises(ValueError, match=match):
        buffer.state_dict()


def test_state_format():
    buffer = shuffle_buffer(range(5), 2, seed=3)
    iterator = iter(buffer)
    next(iterator)
    state = buffer.state_dict()
    assert {k: v for k, v in state.items() if k != "upstream"} == {
        "format": "unbroken.shuffle_buffer",
        "version": 2,
        "size": 2,
        "seed": 3,
        "epoch": 0,
        "window": 0,
        "emitted": 1,
        "end": False,
    }
    assert state["upstream"]["format"] == "unbroken.resumable" and state["upstream"]["items"] == 0


@pytest.mark.parametrize(
    "change, match",
    [
        ({"size": 3}, "saved with size=3 but this loader has size=2"),
        ({"seed": 4}, "saved with seed=4 but this loader has seed=3"),
        ({"format": "unbroken.resumable"}, "saved with format='unbroken.resumable'"),
        ({"version": 1}, "saved with version=1"),
        ({"emitted": 2}, r"field 'emitted': expected an int >= 0 and <= 1"),
        ({"end": True, "emitted": 0}, r"field 'emitted': expected an int >= 1"),
        ({"end": "no"}, "field 'end': expected a bool"),
        ({"window": -1}, "field 'window': expected an int >= 0"),
        (
            {"upstream": {"format": "x"}},
            "field 'upstream': unbroken.resumable: the state was saved with format='x'",
        ),
        ({"other": 1}, r"unexpected fields \['other'\]"),
    ],
)
def test_bad_states_are_refused_naming_the_field_and_change_nothing(change, match):
    buffer = shuffle_buffer(range(5), 2, seed=3)
    iterator = iter(buffer)
    next(iterator)
    good = buffer.state_dict()
    with pytest.raises(ValueError, match=match):
        buffer.load_state_dict({**good, **change})
    assert buffer.state_dict() == good


@pytest.mark.parametrize(
    "size, seed, match",
    [
        (0, 1, "size must be an int >= 1"),
        (2.0, 1, "size must be an int"),
        (2, None, r"seed must be an int in \[0, 2\*\*64\)"),
        (2, -1, "seed must be an int"),
    ],
)
def test_bad_arguments(size, seed, match):
    with pytest.raises(ValueError, match=match):
        shuffle_buffer([1, 2], size, seed=seed)
    with pytest.raises(TypeError):
        shuffle_buffer([1, 2], 2, 3)  # the seed is keyword-only


def test_emitted_items_are_released():
    class Item:
        pass

    refs = []

    def items(epoch):
        for _ in range(4):
            refs.append(weakref.ref(item := Item()))
            yield item

    buffer = shuffle_buffer(items, 4, seed=0)
    assert isinstance(buffer, ShuffleBuffer)
    iterator = iter(buffer)
    first = next(iterator)
    assert sum(ref() is not None for ref in refs) == 4
    del first
    assert sum(ref() is not None for ref in refs) == 3  # the buffer keeps only what it holds
