"""load_state_dict refuses every malformed state before anything changes, for every loader kind.

A mutated state is either refused (a ValueError naming the mutated field, the loader's state as
before) or a state that some run saves, and then it resumes exactly as that run continues.
"""

import copy
import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pipelines import Counting, Positioned
from torch.utils.data import IterableDataset, get_worker_info

import unbroken
from unbroken.testing import assert_same

# Specific states an independent trial found accepted.


def _mid_epoch(loader, batches=1):
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return json.loads(json.dumps(loader.state_dict())), iterator


def _refused(loader, state, match):
    before = json.dumps(loader.state_dict())
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
    assert json.dumps(loader.state_dict()) == before


@pytest.mark.parametrize(
    "change, match",
    [
        ({"version": True}, "version=True"),
        ({"source": "garbage"}, "'source': expected null"),
        ({"source": [1, 2]}, "'source': expected null"),
        ({"epoch": 10**30}, r"'epoch': expected an int >= 0, got 10{30}"),
        ({"samples": 2**64, "batches": 2**64}, "'samples': expected an int"),
    ],
)
def test_a_loader_refuses_what_no_run_saves(change, match):
    def make():
        return unbroken.DataLoader(Counting(10), batch_size=3, shuffle=True, seed=7)

    state, _ = _mid_epoch(make())
    _refused(make(), {**state, **change}, match)


def test_a_fingerprint_compares_strictly():
    make = lambda: unbroken.DataLoader(Counting(10), batch_size=1, seed=7)
    state, _ = _mid_epoch(make())
    state["fingerprint"]["batch_size"] = True  # True == 1 in Python, not in a state
    _refused(make(), state, "batch_size=True")


@pytest.mark.filterwarnings(r"ignore:.*costs O\(k\):UserWarning")
def test_a_shuffle_buffer_refuses_a_window_its_upstream_is_not_at():
    make = lambda: unbroken.shuffle_buffer(list(range(40)), 4, seed=1)
    state, iterator = _mid_epoch(make(), 10)  # window 2, 2 of it emitted
    assert (state["window"], state["emitted"]) == (2, 2)
    _refused(make(), {**state, "window": 7}, "field 'window': window=7 .* items=8")
    rest = list(iterator)
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == rest and sorted(rest) == sorted(set(rest))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"items": 10**30}, "'items': expected an int"),
        ({"inner": "x"}, r"'inner': expected the object's state_dict\(\) \(a dict\), got 'x'"),
        ({"inner": {"__tensor__": {"dtype": "int8"}}}, "'inner': a tagged value"),
        ({"name": None, "epoch": 2**63}, "'epoch'"),
    ],
)
def test_a_resumable_refuses_at_load_not_at_iter(change, match):
    make = lambda: unbroken.resumable(lambda epoch: range(5))
    state, _ = _mid_epoch(make(), 2)
    _refused(make(), {**state, **change}, match)


def test_a_combined_loader_refuses_out_of_range_counters_and_loose_keys():
    make = lambda: unbroken.CombinedLoader(
        [unbroken.DataLoader(Counting(4), batch_size=1, seed=0)], mode="max_size"
    )
    state, _ = _mid_epoch(make())
    _refused(make(), {**state, "epoch": 10**30}, "'epoch'")
    _refused(make(), {**state, "keys": True}, "keys=True")
    entry = state["loaders"][0]
    _refused(make(), {**state, "loaders": [{**entry, "batches": 2**63}]}, "'batches'")


# Every field of every loader kind, mutated.


class SamplerPattern(IterableDataset):
    """Lightning's pattern: its state, the sampler indices drawn, is wholly unbroken's."""

    def __init__(self, n):
        self.n, self.sampler = n, None

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        self.sampler = list(range(worker, self.n, workers))
        self.sampler_iter = iter(self.sampler)
        return self

    def __next__(self):
        return next(self.sampler_iter)


class Ranged(IterableDataset):
    def __init__(self, n):
        self.n = n

    def read_range(self, start, stop):
        return iter(range(start, min(stop, self.n)))

    def __iter__(self):
        return self.read_range(0, self.n)


class Stateless(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


class Batches(torch.utils.data.Sampler):
    def __iter__(self):
        return iter([[0, 1, 2], [3], [4, 5], [6]])

    def __len__(self):
        return 4


def _dataloader(**kw):
    return lambda: unbroken.DataLoader(Counting(7), **{"batch_size": 2, "seed": 5, **kw})


# name: (make, {type of value not drawn: paths, or a function of the state giving them;
# "inside": keys whose contents are not mutated}). The
# loader cannot tell these from a real position without the user's data, as no state holds an
# epoch's length: a user sampler's or a resumable's `end` (whether the last item was the
# epoch's last: only reading on tells) and a user sampler's count in its last batch, a
# resumable's `items` or a buffer's `emitted` (any count is a position in some stream; one
# past its end is an error when the resume reads), a
# buffer's window once its epoch ended (its upstream's state then starts the next epoch), a
# global-cursor stream's `samples` (a partial batch, the epoch's last), the indices in a user
# batch sampler's batches (any number), how many sampler indices a dataset drew for its items
# (`sampler_indices`: one per item, or more, or fewer), and the state of the user's own
# dataset or iterable (`state`, `inner`: only its load_state_dict knows).
KINDS = {
    "native": (_dataloader(shuffle=True), {}),
    "native drop_last": (_dataloader(shuffle=False, drop_last=True, batch_size=3), {}),
    "user sampler": (
        _dataloader(sampler=Stateless(7)),
        {
            bool: [("source", "end")],
            int: lambda state: [("samples",)] if state["source"] and state["source"]["end"] else [],
        },
    ),
    "user batch sampler": (
        _dataloader(batch_sampler=Batches(), batch_size=1),
        {bool: [("source", "end")], int: [("samples",), ("batches",)]},
    ),
    "stateful stream": (
        lambda: unbroken.DataLoader(Positioned(7), batch_size=2, seed=1),
        {"inside": ["state"], dict: [("state",)]},
    ),
    "sampler pattern": (
        lambda: unbroken.DataLoader(SamplerPattern(7), batch_size=2, seed=1),
        {int: [("sampler_indices",)]},
    ),
    "global cursor": (
        lambda: unbroken.DataLoader(Ranged(7), batch_size=2, seed=1),
        {int: [("samples",)]},
    ),
    "resumable": (
        lambda: unbroken.resumable(lambda epoch: [epoch * 10 + i for i in range(5)]),
        {bool: [("end",)], int: [("items",)], dict: [("inner",)]},
    ),
    "shuffle_buffer": (
        lambda: unbroken.shuffle_buffer(lambda epoch: range(epoch, epoch + 7), 3, seed=2),
        {
            bool: [("upstream", "end")],
            dict: [("upstream", "inner")],
            int: lambda state: [("emitted",)] + [("window",)] * state["end"],
        },
    ),
}
# A CombinedLoader's children may be at any epoch of their own (a cycled child goes through
# many); in max_size_cycle, whether a child already ran out and was restarted in this combined
# epoch is not in its state, which says where it is, not how it got there.
COMBINED_UNVERIFIABLE = {
    int: [("state", "epoch")],
    bool: lambda state: [("exhausted",)] if state["mode"] == "max_size_cycle" else [],
}
COMBINED_MODES = ["max_size_cycle", "min_size", "max_size", "sequential"]

GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 9),
    st.just("garbage"),
    st.text(max_size=2),
    st.sampled_from([2**63, 2**64, 10**30, -(2**63), 0.5, 1.0, [], [1, 2], {}, {"a": 1}]),
)


def _combined(mode):
    return lambda: unbroken.CombinedLoader(
        {
            "a": unbroken.DataLoader(Counting(3), batch_size=1, shuffle=True, seed=3),
            "b": unbroken.DataLoader(Counting(5), batch_size=2, seed=4),
        },
        mode=mode,
    )


def _record(loader, epoch=None):
    """Each cut of two epochs (from ``epoch``): its state and the batches that follow it until
    the end of the second epoch."""
    if epoch is not None:
        loader.set_epoch(epoch)
    cuts, batches = [(json.dumps(loader.state_dict()), 0)], []
    for _ in range(2):
        for batch in loader:
            batches.append(batch)
            cuts.append((json.dumps(loader.state_dict()), len(batches)))
        cuts.append((json.dumps(loader.state_dict()), len(batches)))
    return [(state, batches[received:]) for state, received in cuts], batches


def _paths(node, path=()):
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return
    for key, child in items:
        yield path + (key,)
        yield from _paths(child, path + (key,))


def _get(state, path):
    for key in path:
        state = state[key]
    return state


def _set(state, path, value):
    _get(state, path[:-1])[path[-1]] = value
    return state


def _mutations(original, excluded):
    values = GARBAGE
    if isinstance(original, int) and not isinstance(original, bool):
        values = st.one_of(values, st.sampled_from([original - 1, original + 1, original * 2]))
    if excluded:
        # bool is an int: excluding ints keeps bools, which the loader must refuse there
        values = values.filter(lambda v: not any(type(v) is kind for kind in excluded))
    return values


def _check_one_mutation(make, data, unverifiable=None, sets_epochs=True):
    cuts, _ = _record(make())
    state = json.loads(data.draw(st.sampled_from(cuts), label="cut")[0])
    owned = (unverifiable or {}).get("inside", ())  # the user's own state: not ours to check
    paths = [p for p in _paths(state) if not any(key in p[:-1] for key in owned)]
    path = data.draw(st.sampled_from(paths), label="path")
    excluded = [
        kind
        for kind, suffixes in (unverifiable or {}).items()
        if kind != "inside"
        and any(
            path[-len(suffix) :] == suffix
            for suffix in (suffixes(state) if callable(suffixes) else suffixes)
        )
    ]
    value = data.draw(_mutations(_get(state, path), excluded), label="value")
    mutated = _set(copy.deepcopy(state), path, value)

    loader = make()
    loader.load_state_dict(json.loads(data.draw(st.sampled_from(cuts), label="before")[0]))
    before = json.dumps(loader.state_dict())
    try:
        loader.load_state_dict(mutated)
    except ValueError as error:
        named = [key for key in path if isinstance(key, str)][-1]
        assert named in str(error), f"{path} = {value!r}: {error}"
        assert json.dumps(loader.state_dict()) == before, "a refused state changed the loader"
        return
    # Accepted: it must be a state that a run saves, and resume as that run continues.
    assert json.dumps(loader.state_dict()) == json.dumps(mutated)
    if sets_epochs:
        reference, _ = _record(make(), mutated["epoch"])
        key = json.dumps(mutated)
    else:  # a CombinedLoader's epoch only counts its passes: the same batches follow
        reference, _ = _record(make())
        reference = [(json.dumps({**json.loads(s), "epoch": 0}), rest) for s, rest in reference]
        key = json.dumps({**mutated, "epoch": 0})
    following = [rest for saved, rest in reference if saved == key]
    assert following, f"{path} = {value!r}: accepted a state that no run saves: {mutated}"
    resumed = [batch for _ in range(2) for batch in loader]
    # The reference continues to the end of the second epoch after its start; the resumed loader
    # ran two loops from the cut: compare what both have.
    assert_same(resumed[: len(following[0])], following[0][: len(resumed)], f"{path} = {value!r}")


@pytest.mark.parametrize("kind", list(KINDS))
@given(data=st.data())
@settings(max_examples=40)
def test_a_mutated_field_is_refused_naming_it_or_resumes_exactly(kind, data):
    make, unverifiable = KINDS[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipping warnings of the stateless kinds
        _check_one_mutation(make, data, unverifiable)


@pytest.mark.parametrize("mode", COMBINED_MODES)
@given(data=st.data())
@settings(max_examples=40)
def test_a_mutated_field_of_a_combined_loader_is_refused_naming_it_or_resumes_exactly(mode, data):
    _check_one_mutation(_combined(mode), data, COMBINED_UNVERIFIABLE, sets_epochs=False)


@given(data=st.data())
@settings(max_examples=10)
def test_a_mutated_field_of_a_stream_with_workers_is_refused_naming_it_or_resumes_exactly(data):
    def make():
        return unbroken.DataLoader(SamplerPattern(9), batch_size=2, num_workers=2, seed=1)

    _check_one_mutation(make, data, KINDS["sampler pattern"][1])
