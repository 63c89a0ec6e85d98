"""Bad input: every malformed or mismatched state is a ValueError naming what differs."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pipelines import Counting

import unbroken
from unbroken._state import from_jsonable, to_jsonable


def _loader(n=10, **kw):
    kw = {"batch_size": 3, "shuffle": True, "seed": 7, **kw}
    return unbroken.DataLoader(Counting(n), **kw)


def _mid_epoch_state(**kw):
    loader = _loader(**kw)
    iterator = iter(loader)
    next(iterator)
    return loader.state_dict()


@pytest.mark.parametrize(
    "field, saved_kw, current_kw, saved, current",
    [
        ("dataset_length", {"n": 10}, {"n": 11}, "10", "11"),
        ("seed", {"seed": 7}, {"seed": 8}, "7", "8"),
        ("batch_size", {"batch_size": 3}, {"batch_size": 4}, "3", "4"),
        ("drop_last", {"drop_last": False}, {"drop_last": True}, "False", "True"),
        ("shuffle", {"shuffle": True}, {"shuffle": False}, "True", "False"),
        ("global_rngs", {}, {"global_rngs": ("torch",)}, "'numpy'", "['torch']"),
    ],
)
def test_a_changed_setting_names_the_field_the_saved_and_the_current_value(
    field, saved_kw, current_kw, saved, current
):
    state = json.loads(json.dumps(_mid_epoch_state(**saved_kw)))
    loader = _loader(**current_kw)
    with pytest.raises(ValueError) as error:
        loader.load_state_dict(state)
    message = str(error.value)
    assert f"{field}=" in message and saved in message and current in message, message
    assert loader.state_dict()["samples"] == 0  # nothing changed
    assert len(list(loader)) == len(loader)  # and it still starts from the beginning


def test_a_loader_without_a_seed_adopts_the_saved_one():
    state = _mid_epoch_state(seed=12345)
    loader = unbroken.DataLoader(Counting(10), batch_size=3, shuffle=True)
    loader.load_state_dict(state)
    reference = _loader(seed=12345)
    iterator = iter(reference)
    next(iterator)
    assert [b.tolist() for b in loader] == [b.tolist() for b in iterator]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s.update(version=99), "version=99"),
        (lambda s: s.update(format="torchdata"), "format='torchdata'"),
        (lambda s: s.pop("samples"), r"missing fields \['samples'\]"),
        (lambda s: s.update(extra=1), r"unexpected fields \['extra'\]"),
        (lambda s: s.update(samples=-3), "'samples': expected an int >= 0, got -3"),
        (lambda s: s.update(samples="3"), "'samples': expected an int"),
        (lambda s: s.update(epoch=1.5), "'epoch': expected an int"),
        (lambda s: s.update(seed=True), "'seed': expected an int"),
        (lambda s: s.update(samples=4), "inconsistent: samples=4 and batches=1"),
        (lambda s: s.update(samples=30, batches=10), "inconsistent"),
        (lambda s: s.update(fingerprint=[]), "'fingerprint': expected a dict"),
        (lambda s: s["fingerprint"].pop("shuffle"), "fingerprint lacks 'shuffle'"),
        (lambda s: s.update(source=object()), "not plain JSON"),
    ],
)
def test_malformed_states_are_refused_before_anything_changes(mutate, match):
    state = _mid_epoch_state()
    mutate(state)
    loader = _loader()
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
    assert loader.state_dict()["samples"] == 0


@pytest.mark.parametrize("bad", [None, "state", [1, 2], 3])
def test_a_state_of_the_wrong_type_is_a_value_error(bad):
    with pytest.raises(ValueError, match="expected the dict returned by state_dict"):
        _loader().load_state_dict(bad)


def test_wrong_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        _loader(seed=-1)
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):  # torch's
        _loader(batch_size=0)
    with pytest.raises(ValueError, match="in_order=True"):
        _loader(in_order=False)
    with pytest.raises(ValueError, match="mutually exclusive"):
        unbroken.DataLoader(Counting(3), sampler=[0, 1], shuffle=True)
    with pytest.raises(TypeError, match="IterableDataset"):
        unbroken.DataLoader(torch.utils.data.IterableDataset())


def test_user_states_with_tensors_round_trip_through_json():
    state = {"gen": torch.Generator().manual_seed(3).get_state(), "a": np.arange(4.0), "t": (1, 2)}
    restored = from_jsonable(json.loads(json.dumps(to_jsonable(state))))
    assert torch.equal(restored["gen"], state["gen"]) and restored["gen"].dtype == torch.uint8
    assert np.array_equal(restored["a"], state["a"]) and restored["t"] == [1, 2]


@pytest.mark.parametrize(
    "value, match",
    [
        ({"fn": print}, r"state\.fn: a builtins\.builtin_function_or_method cannot be saved"),
        (
            {"a": {frozenset(): 2}},
            r"state\.a: key frozenset\(\) is a frozenset; a state's keys may "
            "be str, int",
        ),
        ({(1, object()): 2}, "key <object object at .*> is a object"),
        ({float("inf"): 2}, "key inf is a float"),
        ({"x": [float("nan")]}, r"state\.x\[0\]: nan is not valid JSON"),
    ],
)
def test_unserializable_user_state_names_its_key(value, match):
    with pytest.raises(ValueError, match=match):
        to_jsonable(value)


_SCALAR_KEYS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.sampled_from(["__items__", "__tensor__"]),
)
_KEYS = st.recursive(
    _SCALAR_KEYS, lambda inner: st.tuples(inner, inner) | st.tuples(inner), max_leaves=4
)
_STATES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.text(max_size=4),
        st.floats(allow_nan=False, allow_infinity=False),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


def _strictly_equal(a, b):
    """==, and also the same types of keys and values all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            type(ka) is type(kb) and _strictly_equal(ka, kb) and _strictly_equal(a[ka], b[kb])
            for ka, kb in zip(a, b)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_strictly_equal(x, y) for x, y in zip(a, b))
    return a == b


@given(state=_STATES)
@settings(max_examples=200)
def test_states_with_any_hashable_json_keys_round_trip_through_json_keeping_key_types(state):
    # torchdata's test datasets return {0: 0, 1: 0}; keys may also be floats, None, tuples, and
    # str keys that look like unbroken's own tags.
    encoded = json.dumps(to_jsonable(state), allow_nan=False)
    assert _strictly_equal(from_jsonable(json.loads(encoded)), state)


def test_int_keys_are_tagged_and_str_keys_stay_plain():
    assert to_jsonable({"a": {0: 0, 1: 0}}) == {"a": {"__items__": [[0, 0], [1, 0]]}}
    assert to_jsonable({"a": 1}) == {"a": 1}
    assert from_jsonable(to_jsonable({(1, (2, None)): "x"})) == {(1, (2, None)): "x"}
