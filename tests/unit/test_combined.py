"""CombinedLoader: every mode resumes exactly, and children cut short begin their next epoch."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.data.combined import MODES, CombinedLoader
from unbroken.testing import assert_resumes_exactly, assert_same


class Draws(torch.utils.data.Dataset):
    """Each sample is its index and a draw from torch's global RNG (seeded per sample)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return torch.tensor(index), torch.rand(1)


def _child(n, batch_size=1, shuffle=True, seed=0, workers=0):
    # No persistent_workers: a loader holding them stalls 5 s per worker when gc frees it.
    return unbroken.DataLoader(
        Draws(n), batch_size=batch_size, shuffle=shuffle, seed=seed, num_workers=workers
    )


def _factory(mode, specs, as_dict=True, workers=0):
    """specs: (n, batch_size, shuffle) per child; seeds differ per child."""

    def make():
        children = [
            _child(n, b, shuffle, seed=10 + i, workers=workers)
            for i, (n, b, shuffle) in enumerate(specs)
        ]
        loaders = dict(zip("abc", children)) if as_dict else children
        return CombinedLoader(loaders, mode=mode)

    return make


def _epochs(n, count, **kw):
    """The batches of a child's epochs 0..count-1, from a loader of its own."""
    out = []
    for epoch in range(count):
        loader = _child(n, **kw)
        loader.set_epoch(epoch)
        out.append(list(loader))
    return out


SPECS = [(3, 1, True), (7, 2, False), (4, 1, True)]  # lengths 3, 4, 4 batches


@pytest.mark.parametrize("as_dict", [True, False], ids=["dict", "list"])
@pytest.mark.parametrize("mode", MODES)
def test_every_cut_point_resumes_exactly(mode, as_dict):
    make = _factory(mode, SPECS, as_dict)
    length = {"max_size_cycle": 4, "min_size": 3, "max_size": 4, "sequential": 11}[mode]
    assert len(make()) == length
    assert assert_resumes_exactly(make, epochs=3) == 1 + 3 * (length + 1)


@given(
    mode=st.sampled_from(MODES),
    sizes=st.lists(st.integers(0, 8), min_size=2, max_size=3),
    batch_sizes=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    shuffles=st.lists(st.booleans(), min_size=3, max_size=3),
    as_dict=st.booleans(),
)
@settings(max_examples=50)
def test_any_children_resume_exactly(mode, sizes, batch_sizes, shuffles, as_dict):
    if mode == "max_size_cycle" and 0 in sizes:
        sizes = [max(1, n) for n in sizes]  # an empty child cannot be cycled (tested below)
    specs = list(zip(sizes, batch_sizes, shuffles))
    make = _factory(mode, specs, as_dict)
    assert assert_resumes_exactly(make, epochs=3) == 1 + 3 * (len(make()) + 1)


def test_a_cut_resumes_exactly_with_workers():
    # Cut inside combined epoch 1 right after 'a' was cycled into its epoch 3; saved with two
    # workers per child, resumed in-process.
    make = _factory("max_size_cycle", SPECS[:2], workers=2)
    assert len(make()) == 4
    assert (
        assert_resumes_exactly(
            make, epochs=3, resume_with=_factory("max_size_cycle", SPECS[:2]), cuts=[1 + 5 + 4]
        )
        == 1
    )


def test_cycled_children_begin_their_next_epoch_when_the_longest_ends():
    # a: 2 batches, b: 5. a runs its epochs 0, 1 and the first batch of 2 in combined epoch 0;
    # combined epoch 1 begins a's epoch 3 (not the rest of 2), and so on.
    a, b = _epochs(2, 9), _epochs(5, 3)
    expected = []
    for combined in range(3):
        a_batches = [(3 * combined + k // 2, k % 2) for k in range(5)]
        expected += [{"a": a[e][i], "b": b[combined][k]} for k, (e, i) in enumerate(a_batches)]
    make = lambda: CombinedLoader({"a": _child(2), "b": _child(5)})
    loader = make()
    got = [batch for _ in range(3) for batch in loader]
    assert_same(got, expected)
    assert assert_resumes_exactly(make, epochs=3) == 1 + 3 * 6


def test_children_cut_short_begin_their_next_epoch_in_min_size():
    a, b = _epochs(2, 3), _epochs(3, 3)
    expected = [{"a": a[e][i], "b": b[e][i]} for e in range(3) for i in range(2)]
    make = lambda: CombinedLoader({"a": _child(2), "b": _child(3)}, mode="min_size")
    loader = make()
    assert_same([batch for _ in range(3) for batch in loader], expected)
    assert (loader.epoch, loader.loaders["a"].epoch, loader.loaders["b"].epoch) == (3, 3, 3)
    assert assert_resumes_exactly(make, epochs=3) == 1 + 3 * 3


@pytest.mark.parametrize(
    "mode, lengths, b_epoch",
    [
        ("min_size", {"b": 3, "a": 2}, 1),  # b is cut short in its epoch 0
        ("max_size_cycle", {"b": 2, "a": 3}, 2),  # b is cycled and cut short in its epoch 1
    ],
)
def test_a_child_resumed_and_never_advanced_moves_on_like_an_abandoned_one(mode, lengths, b_epoch):
    # Saved after the last combined batch: b is mid-epoch. The uninterrupted run abandons b's
    # open iteration; the resumed b only holds a loaded state and yields nothing more. Both
    # must have b at its next epoch when combined epoch 1 starts.
    def make():
        return CombinedLoader({k: _child(n, seed=n) for k, n in lengths.items()}, mode=mode)

    uninterrupted = make()
    for _ in uninterrupted:
        state = json.loads(json.dumps(uninterrupted.state_dict()))
        b_epoch_inside = uninterrupted.loaders["b"].epoch
    assert state["batches"] == (2 if mode == "min_size" else 3)
    assert state["loaders"][0]["open"]
    assert state["loaders"][0]["exhausted"] == (mode == "max_size_cycle")
    assert uninterrupted.loaders["b"].epoch == b_epoch
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.loaders["b"].epoch == b_epoch_inside == b_epoch - 1
    assert list(resumed) == [] and resumed.epoch == 1
    assert resumed.loaders["b"].epoch == b_epoch
    assert_same(list(resumed), list(uninterrupted))


def test_max_size_gives_none_for_exhausted_children():
    loader = CombinedLoader([_child(1, shuffle=False), _child(3, shuffle=False)], mode="max_size")
    got = list(loader)
    assert [batch[0] is None for batch in got] == [False, True, True]
    assert [int(batch[1][0]) for batch in got] == [0, 1, 2]


def test_sequential_items_are_batch_index_and_key():
    loader = CombinedLoader(
        [_child(2, shuffle=False), _child(0), _child(3, 2, False)], mode="sequential"
    )
    items = [(index.tolist(), batch_idx, key) for (index, _), batch_idx, key in loader]
    assert items == [([0], 0, 0), ([1], 1, 0), ([0, 1], 0, 2), ([2], 1, 2)]
    named = CombinedLoader({"x": _child(1), "y": _child(1)}, mode="sequential")
    assert [(batch_idx, key) for _, batch_idx, key in named] == [(0, "x"), (0, "y")]


def test_tuples_give_tuples_and_len_follows_the_mode():
    loaders = (_child(5), _child(2, 1))
    assert all(isinstance(b, tuple) and len(b) == 2 for b in CombinedLoader(loaders, "min_size"))
    assert [len(CombinedLoader((_child(5), _child(2)), m)) for m in MODES] == [5, 2, 5, 7]

    class NoLen:
        def __iter__(self):
            return iter([])

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    with pytest.raises(TypeError, match="loader 1 has none"):
        len(CombinedLoader([_child(1), NoLen()], mode="sequential"))


def test_iter_that_yields_nothing_starts_nothing_and_break_ends_the_epoch():
    # min_size runs every child's epoch e in combined epoch e, also after a break.
    make = _factory("min_size", SPECS)
    reference = make()
    epochs = [list(reference) for _ in range(3)]
    loader = make()
    iter(loader)
    iter(loader)
    assert_same(list(loader), epochs[0])
    next(iter(loader))  # a break after one batch: combined epoch 1 is over at once
    assert loader.epoch == 2
    assert_same(list(loader), epochs[2])
    assert loader.epoch == 3

    saved = make()
    held = iter(saved)
    next(held)
    resumed = make()
    resumed.load_state_dict(saved.state_dict())
    iter(resumed)  # a loaded state waits for the iter() that yields
    assert_same(list(resumed), epochs[0][1:])


def test_a_state_taken_after_a_break_resumes_at_the_next_epoch_like_the_uninterrupted_run():
    # The uninterrupted run breaks, saves, and goes on with its next iter(): the next epoch. A
    # run resumed from that state must do the same (not finish the broken epoch).
    make = _factory("min_size", SPECS)
    reference = make()
    epochs = [list(reference) for _ in range(3)]
    loader = make()
    for _ in loader:
        break
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 0
    resumed = make()
    resumed.load_state_dict(state)
    assert_same(list(resumed), epochs[1])
    assert_same(list(loader), epochs[1])


def test_children_without_set_epoch_work_in_max_size_and_sequential():
    class Plain:
        """Resumable, but with no epoch/set_epoch: relies on its own "abandoned ends" rule."""

        def __init__(self, n):
            self.inner = _child(n, seed=n)

        def __iter__(self):
            return iter(self.inner)

        def __len__(self):
            return len(self.inner)

        def state_dict(self):
            return self.inner.state_dict()

        def load_state_dict(self, state):
            self.inner.load_state_dict(state)

    for mode in ("max_size", "sequential"):
        make = lambda mode=mode: CombinedLoader({"a": Plain(2), "b": Plain(3)}, mode=mode)
        assert assert_resumes_exactly(make, epochs=2)
        loader, reference = make(), make()
        expected = [list(reference) for _ in range(2)]
        next(iter(loader))  # a break: 'a' moves to its epoch 1 ('b' has not begun its epoch 0)
        if mode == "sequential":
            expected[1][2:] = expected[0][2:]
        assert_same(list(loader), expected[1])
    with pytest.raises(TypeError, match=r"needs `epoch` and set_epoch\(\).*mode='max_size'"):
        CombinedLoader({"a": Plain(2), "b": _child(1)}, mode="min_size")


def test_state_is_json_and_says_what_was_received():
    loader = _factory("sequential", SPECS)()
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert {
        k: state[k] for k in ("format", "version", "mode", "keys", "epoch", "batches", "current")
    } == {
        "format": "unbroken.CombinedLoader",
        "version": 1,
        "mode": "sequential",
        "keys": ["a", "b", "c"],
        "epoch": 0,
        "batches": 4,
        "current": 1,
    }
    assert [(e["batches"], e["exhausted"], e["open"]) for e in state["loaders"]] == [
        (3, True, False),
        (1, False, True),
        (0, False, False),
    ]
    assert state["loaders"][1]["state"]["batches"] == 1
    list(iterator)
    after = loader.state_dict()
    assert (after["epoch"], after["batches"], after["current"]) == (1, 0, 0)
    assert [e["state"]["epoch"] for e in after["loaders"]] == [1, 1, 1]
    assert CombinedLoader([_child(1)]).state_dict()["keys"] == 1


def _saved(mode="max_size_cycle"):
    loader = _factory(mode, SPECS)()
    next(iter(loader))
    return json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda s: s.update(mode="min_size"),
            r"saved with mode='min_size' but this loader has "
            r"mode='max_size_cycle'",
        ),
        (
            lambda s: s.update(keys=["a", "b", "d"]),
            r"keys=\['a', 'b', 'd'\] but .* keys=\['a', 'b', 'c'\]",
        ),
        (lambda s: s.update(version=2), "version=2"),
        (lambda s: s.update(format="unbroken.DataLoader"), "format='unbroken.DataLoader'"),
        (lambda s: s.pop("current"), r"malformed: missing fields \['current'\]"),
        (lambda s: s.update(epoch=-1), "field 'epoch'"),
        (lambda s: s["loaders"].pop(), "field 'loaders': expected a list of 3 entries"),
        (lambda s: s["loaders"][1].pop("open"), "entry 'b': expected a dict with fields"),
        (lambda s: s["loaders"][2].update(exhausted=1), "entry 'c': 'exhausted' must be a bool"),
        (lambda s: s.update(batches=2), "state is inconsistent"),
        (lambda s: s.update(current=0), "state is inconsistent"),
        (lambda s: s["loaders"][1]["state"].update(batches=2), "loader 'b': .*inconsistent"),
    ],
)
def test_bad_states_are_refused_and_change_nothing(change, match):
    state = _saved()
    change(state)
    loader = _factory("max_size_cycle", SPECS)()
    before = loader.state_dict()
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
    assert loader.state_dict() == before
    assert_same(list(loader), list(_factory("max_size_cycle", SPECS)()))


def test_states_of_other_loaders_or_containers_are_refused():
    state = _saved()
    with pytest.raises(ValueError, match="keys=3"):
        _factory("max_size_cycle", SPECS, as_dict=False)().load_state_dict(state)
    other = CombinedLoader(
        {"a": _child(3, seed=10), "b": _child(7, 3, seed=11), "c": _child(4, seed=12)}
    )
    with pytest.raises(
        ValueError,
        match=r"loader 'b': .* batch_size=2 but this loader has "
        r"batch_size=3",
    ):
        other.load_state_dict(state)
    assert other.loaders["a"].state_dict()["batches"] == 0  # 'a' loaded, then restored
    with pytest.raises(ValueError, match="expected the dict returned by state_dict"):
        other.load_state_dict([state])
    with pytest.raises(ValueError, match="state is inconsistent"):
        _factory("sequential", SPECS)().load_state_dict(dict(_saved("sequential"), current=2))


def test_bad_loaders_are_refused():
    with pytest.raises(
        TypeError,
        match=r"loader 'b' \(a torch.utils.data.dataloader.DataLoader\)"
        r" needs __iter__, state_dict\(\)",
    ):
        CombinedLoader({"a": _child(2), "b": torch.utils.data.DataLoader(Draws(3))})
    with pytest.raises(ValueError, match="mode must be one of"):
        CombinedLoader([_child(1)], mode="max_size_cyle")
    with pytest.raises(TypeError, match="dict or a list"):
        CombinedLoader(_child(1))
    with pytest.raises(ValueError, match="at least one loader"):
        CombinedLoader({})
    with pytest.raises(TypeError, match="keys must be str"):
        CombinedLoader({1: _child(1)})
    shared = _child(1)
    with pytest.raises(ValueError, match="same loader is passed as 'a' and 'b'"):
        CombinedLoader({"a": shared, "b": shared})
    with pytest.raises(ValueError, match="loader 1 yielded no batch right after a restart"):
        list(CombinedLoader([_child(3), _child(0)]))
    assert list(CombinedLoader([_child(0), _child(0)])) == []  # nothing to cycle, nothing yielded
