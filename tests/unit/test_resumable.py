"""unbroken.resumable: any iterable resumes exactly, through its own state or by skipping."""

import io
import json
import random
import threading
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken.data.iterable as resumable_module
from unbroken.data.iterable import Resumable, resumable
from unbroken.testing import assert_resumes_exactly, assert_same

SKIP_WARNING = r"ignore:.*costs O\(k\):UserWarning"


def epoch_batches(n, seed, epoch):
    """A list of n batches whose values depend on (seed, epoch): a reshuffled epoch."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(n, generator=g)
    return [{"index": order[i], "x": torch.rand(2, generator=g), "epoch": epoch} for i in range(n)]


def generator_batches(n, seed, epoch):
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    for i in range(n):
        yield (i, torch.randint(0, 100, (3,), generator=g))


class FakeDali:
    """A DALI-style loader: an iterator that must be reset() each epoch, with torch's Stateful
    methods. Its state holds a torch.Generator's state (a uint8 tensor)."""

    def __init__(self, n, seed, log):
        self.n, self.seed, self.log = n, seed, log
        self.generator = torch.Generator()
        self.reset(0)

    def reset(self, epoch):
        self.epoch, self.position, self.reads = epoch, 0, 0
        self.generator.manual_seed(self.seed * 31 + epoch)
        self.log.append(("reset", epoch))

    def __iter__(self):
        return self

    def __next__(self):
        if self.position >= self.n:
            raise StopIteration
        self.position += 1
        self.log.append(("read", self.epoch, self.position - 1))
        return {
            "position": self.position - 1,
            "epoch": self.epoch,
            "augment": torch.rand(2, generator=self.generator),
        }

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position, "rng": self.generator.get_state()}

    def load_state_dict(self, state):
        self.log.append(("load", state["epoch"], state["position"]))
        self.epoch, self.position = state["epoch"], state["position"]
        self.generator.set_state(state["rng"])


def dali_stream(n, seed, log):
    loader = FakeDali(n, seed, log)

    def for_epoch(epoch):
        loader.reset(epoch)
        return loader

    return resumable(for_epoch)


def cut_points(lengths):
    return 1 + sum(n + 1 for n in lengths)


@given(
    n=st.integers(0, 12),
    seed=st.integers(0, 2**32),
    epochs=st.integers(1, 3),
    reshuffle=st.booleans(),
)
@settings(max_examples=100)
@pytest.mark.filterwarnings(SKIP_WARNING)
def test_a_list_of_batches_resumes_at_every_cut(n, seed, epochs, reshuffle):
    if reshuffle:
        make = lambda: resumable(lambda epoch: epoch_batches(n, seed, epoch))
    else:
        batches = epoch_batches(n, seed, 0)
        make = lambda: resumable(batches)
    assert assert_resumes_exactly(make, epochs=epochs) == cut_points([n] * epochs)


@given(n=st.integers(0, 12), seed=st.integers(0, 2**32), epochs=st.integers(1, 3))
@settings(max_examples=100)
@pytest.mark.filterwarnings(SKIP_WARNING)
def test_a_generator_function_resumes_at_every_cut(n, seed, epochs):
    make = lambda: resumable(lambda epoch: generator_batches(n, seed, epoch))
    assert assert_resumes_exactly(make, epochs=epochs) == cut_points([n] * epochs)


@given(n=st.integers(0, 12), seed=st.integers(0, 2**32), epochs=st.integers(1, 3))
@settings(max_examples=100)
def test_a_stateful_loader_resumes_through_its_own_state(n, seed, epochs):
    log = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no skip warning
        assert_resumes_exactly(lambda: dali_stream(n, seed, log), epochs=epochs)
    # Every mid-epoch resume loaded the loader's state; none re-read what it had yielded.
    loads = [entry for entry in log if entry[0] == "load"]
    assert len(loads) == sum(max(n - 1, 0) for _ in range(epochs))  # cuts after non-last items
    assert all(position >= 1 for _, _, position in loads)


def test_a_stateful_resume_reads_only_what_remains():
    log = []
    stream = dali_stream(1000, 0, log)
    for i, _ in enumerate(stream):
        if i == 899:
            state = stream.state_dict()
            break
    assert state["items"] == 900 and state["inner"]["position"] == 900
    json.dumps(state)
    fresh_log = []
    resumed = dali_stream(1000, 0, fresh_log)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    rest = list(resumed)
    assert [b["position"] for b in rest] == list(range(900, 1000))
    assert [e for e in fresh_log if e[0] == "read"] == [("read", 0, p) for p in range(900, 1000)]


class CheckpointingPipeline:
    """A loader with another API (DALI's checkpoint()/restore() style): a serialized string."""

    def __init__(self, n, seed, epoch):
        self.items = epoch_batches(n, seed, epoch)
        self.position = 0

    def __iter__(self):
        while self.position < len(self.items):
            self.position += 1
            yield self.items[self.position - 1]

    def checkpoint(self):
        return json.dumps({"position": self.position})

    def restore(self, checkpoint):
        self.restored = True
        self.position = json.loads(checkpoint)["position"]


class Adapter:
    """The few lines a user writes to give such a loader torch's Stateful protocol."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def __iter__(self):
        return iter(self.pipeline)

    def state_dict(self):
        return {"checkpoint": self.pipeline.checkpoint()}

    def load_state_dict(self, state):
        self.pipeline.restore(state["checkpoint"])


def test_another_checkpoint_api_needs_only_a_tiny_adapter():
    made = []

    def make():
        def for_epoch(epoch):
            made.append(CheckpointingPipeline(5, 1, epoch))
            return Adapter(made[-1])

        return resumable(for_epoch)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_resumes_exactly(make, epochs=2)
    assert any(getattr(pipeline, "restored", False) for pipeline in made)


def test_a_non_deterministic_generator_is_caught():
    def noisy(epoch):
        for _ in range(4):
            yield random.random()

    with pytest.raises(AssertionError, match="saved before the first batch.*batch 0: 0\\."):
        assert_resumes_exactly(lambda: resumable(noisy), epochs=2)
    with pytest.warns(UserWarning, match=r"costs O\(k\).*exact only if"):  # a mid-epoch cut
        with pytest.raises(AssertionError, match="saved inside epoch 0 after its batch 1"):
            assert_resumes_exactly(lambda: resumable(noisy), epochs=2, cuts=[2])


@pytest.mark.filterwarnings(SKIP_WARNING)
def test_skipping_past_the_end_of_a_shorter_iterable_is_a_clear_error():
    stream = resumable(lambda epoch: range(10))
    for i, _ in enumerate(stream):
        if i == 6:
            state = stream.state_dict()
            break
    shorter = resumable(lambda epoch: range(5))
    shorter.load_state_dict(state)
    with pytest.raises(
        ValueError,
        match="7 items of epoch 0 were received, but the re-made "
        "range yields only 5; the iterable is not deterministic",
    ):
        list(shorter)


def test_skipping_warns_once_and_shows_a_bar_only_on_a_terminal_for_long_skips(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    def resumed_at(k, progress):
        stream = resumable(lambda epoch: range(3000), progress=progress)
        stream.load_state_dict({**stream.state_dict(), "items": k})
        return stream

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with pytest.warns(UserWarning) as caught:
        stream = resumed_at(2000, progress=True)
        assert next(iter(stream)) == 2000 and list(stream) == list(range(3000))
    assert len(caught) == 1 and "re-reads the 2000 items" in str(caught[0].message)
    assert "skipping" in terminal.getvalue()
    for k, progress in [(900, True), (2000, False)]:
        terminal.seek(0), terminal.truncate()
        with pytest.warns(UserWarning, match=r"costs O\(k\)"):
            assert next(iter(resumed_at(k, progress))) == k
        assert terminal.getvalue() == ""
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal: no bar even when long
    with pytest.warns(UserWarning, match=r"costs O\(k\)"):
        next(iter(resumed_at(2000, True)))


def test_epoch_boundary_inside_versus_after_the_loop():
    log = []
    stream = dali_stream(3, 0, log)
    for _ in stream:
        inside = stream.state_dict()
    after = stream.state_dict()
    assert (inside["epoch"], inside["items"], inside["end"]) == (0, 3, True)
    assert (after["epoch"], after["items"], after["inner"]) == (1, 0, None)

    resumed_log = []
    resumed = dali_stream(3, 0, resumed_log)
    resumed.load_state_dict(inside)
    assert resumed.epoch == 0 and list(resumed) == [] and resumed.epoch == 1
    assert not [e for e in resumed_log if e[0] in ("read", "load")]  # nothing made or re-read
    resumed.load_state_dict(after)
    assert [b["epoch"] for b in resumed] == [1, 1, 1]


def test_break_ends_the_epoch_at_once_and_an_unused_iter_starts_nothing():
    make = lambda: resumable(lambda epoch: [(epoch, i) for i in range(3)])
    stream = make()
    for _ in stream:
        break
    state = stream.state_dict()  # as with unbroken.DataLoader: the next epoch
    assert (stream.epoch, state["epoch"], state["items"]) == (1, 1, 0)
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == list(stream) == [(1, 0), (1, 1), (1, 2)]

    stream = make()
    held = iter(stream)
    next(held)  # an iterator still held ends its epoch at the next iter()
    assert stream.epoch == 0
    iter(stream)
    assert stream.epoch == 1
    iter(stream)  # an iter() that yielded nothing starts nothing
    assert list(stream) == [(1, 0), (1, 1), (1, 2)] and stream.epoch == 2
    del held  # dropping an old iterator changes nothing
    assert stream.epoch == 2


def test_callables_iterables_and_one_shot_iterators():
    assert list(resumable(lambda: iter("ab"))) == ["a", "b"]  # no epoch argument: allowed
    assert list(resumable(range(2))) == [0, 1]
    with pytest.raises(TypeError, match="one-shot iterator.*resumable\\(lambda epoch"):
        resumable(x for x in range(3))
    with pytest.raises(TypeError, match="must take the epoch as its only argument"):
        resumable(lambda a, b: [])
    with pytest.raises(TypeError, match="expects make_iterable"):
        resumable(42)
    with pytest.raises(TypeError, match="name must be a str"):
        resumable([], name=3)


def test_len_is_the_epoch_iterables_and_makes_nothing_twice():
    made = []

    def make(epoch):
        made.append(epoch)
        return list(range(4 + epoch))

    stream = resumable(make)
    assert len(stream) == 4 and list(stream) == [0, 1, 2, 3] and made == [0]
    assert len(stream) == 5 and made == [0, 1]
    with pytest.raises(TypeError, match="a generator has no len"):
        len(resumable(lambda epoch: generator_batches(3, 0, epoch)))


def test_set_epoch_starts_that_epoch_from_its_first_item():
    stream = resumable(lambda epoch: [(epoch, i) for i in range(2)])
    next(iter(stream))
    stream.set_epoch(4)
    assert stream.state_dict()["epoch"] == 4 and list(stream) == [(4, 0), (4, 1)]
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        stream.set_epoch(-1)


class Locked:
    """A loader whose state holds something JSON cannot."""

    def __iter__(self):
        return iter([1, 2])

    def state_dict(self):
        return {"position": 1, "lock": threading.Lock()}

    def load_state_dict(self, state):
        pass


def test_a_state_that_json_cannot_hold_fails_at_state_dict_naming_the_key():
    stream = resumable(Locked())
    iterator = iter(stream)
    assert next(iterator) == 1  # iterating works; only saving fails
    with pytest.raises(
        ValueError,
        match=r"Locked\.state_dict\(\)\.lock: a _thread\.lock cannot "
        "be saved as JSON",
    ):
        stream.state_dict()


def test_state_format():
    stream = resumable(lambda epoch: range(3), name="train")
    iterator = iter(stream)
    next(iterator)
    assert stream.state_dict() == {
        "format": "unbroken.resumable",
        "version": 1,
        "name": "train",
        "epoch": 0,
        "items": 1,
        "end": False,
        "inner": None,
    }


@pytest.mark.parametrize(
    "change, match",
    [
        ({"format": "unbroken.DataLoader"}, "saved with format='unbroken.DataLoader'"),
        ({"version": 9}, "saved with version=9 but this loader has version=1"),
        ({"name": "val"}, "saved with name='val' but this loader has name='train'"),
        ({"items": -1}, "field 'items': expected an int >= 0"),
        ({"epoch": "1"}, "field 'epoch': expected an int"),
        ({"end": 1}, "field 'end': expected a bool"),
        ({"items": 0, "end": True}, "inconsistent: items=0"),
        ({"items": 0, "inner": {"position": 0}}, "inconsistent: items=0"),
        ({"extra": 1}, r"unexpected fields \['extra'\]"),
        ({"inner": {1, 2}}, "not plain JSON"),
    ],
)
def test_bad_states_are_refused_naming_the_field_and_change_nothing(change, match):
    stream = resumable(lambda epoch: range(3), name="train")
    iterator = iter(stream)
    next(iterator)
    good = stream.state_dict()
    with pytest.raises(ValueError, match=match):
        stream.load_state_dict({**good, **change})
    assert stream.state_dict() == good
    with pytest.raises(ValueError, match="expected the dict returned by state_dict"):
        stream.load_state_dict([good])
    missing = dict(good)
    del missing["end"]
    with pytest.raises(ValueError, match=r"missing fields \['end'\]"):
        stream.load_state_dict(missing)


def test_an_inner_state_needs_an_iterable_that_can_load_it():
    log = []
    stream = dali_stream(4, 0, log)
    iterator = iter(stream)
    next(iterator)
    plain = resumable(lambda epoch: range(4))
    plain.load_state_dict(stream.state_dict())
    with pytest.raises(ValueError, match="the range made now has no load_state_dict"):
        list(plain)


def test_tensors_in_an_inner_state_round_trip():
    log = []
    stream = dali_stream(4, 5, log)
    iterator = iter(stream)
    first = next(iterator)
    state = json.loads(json.dumps(stream.state_dict()))
    assert set(state["inner"]["rng"]) == {"__tensor__"}
    resumed = dali_stream(4, 5, [])
    resumed.load_state_dict(state)
    assert_same(list(resumed), [first, *iterator][1:])
    assert isinstance(resumable_module.take_state(FakeDali(1, 0, []), "x")["rng"], dict)
    assert isinstance(stream, Resumable)
