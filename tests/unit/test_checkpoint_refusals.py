"""What ``Checkpointer.save`` refuses, so that every save that commits also loads.

Checkpoints are read with ``torch.load(weights_only=True)``. Its unpickler rebuilds ints only up
to 255 bytes (pickle's LONG1; LONG4 is not allowed), tensors only with their data, and so on;
each case here is checked against the installed torch, not against a list of beliefs.
"""

import io
import struct
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from unbroken.checkpoint import Checkpointer

# The widest ints this torch's weights_only unpickler rebuilds: two's complement in 255 bytes.
_LOW, _HIGH = -(2**2039), 2**2039 - 1


def _torch_loads(value):
    """Whether torch saves ``value`` and loads it back with weights_only=True; for bytes, also
    whether it does so for b"" (a type is refused if any of its values does not load)."""
    if type(value) is bytes and value and not _torch_loads(b""):
        return False
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


def _same(a, b):
    """Equal, with floats compared bit for bit (nan, -0.0) and containers by exact type."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, torch.Tensor):  # by bytes: torch.equal lacks sub-byte and bits dtypes
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bytes(a.contiguous().untyped_storage()) == bytes(b.contiguous().untyped_storage())
        )
    if isinstance(a, dict):  # by position: a nan key is not found by lookup
        return len(a) == len(b) and all(
            _same(k, j) and _same(v, w) for (k, v), (j, w) in zip(a.items(), b.items())
        )
    if isinstance(a, (set, frozenset)):
        return len(a) == len(b) and all(any(_same(x, y) for y in b) for x in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _saves_and_loads_back(directory, value, blocking):
    """Save ``value``; if save accepts it, it must come back equal. Returns whether it saved."""
    checkpointer = Checkpointer(directory)
    try:
        checkpointer.save(0, {"value": value}, blocking=blocking)
        checkpointer.wait()
    except ValueError as error:
        assert str(error).startswith("state['value']"), str(error)
        assert not directory.exists() or list(directory.iterdir()) == []
        return False
    restored = checkpointer.load_latest({"value": None})  # no warning: it must not be skipped
    assert restored is not None and restored.step == 0, "a save that committed did not load"
    assert _same(value, restored.values["value"]), (value, restored.values["value"])
    return True


# ------------------------------------------------------------------------------- plain values


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize(
    "state, where",
    [
        ({"counter": 2**3000}, "state['counter']"),
        ({"counter": _HIGH + 1}, "state['counter']"),
        ({"counter": _LOW - 1}, "state['counter']"),
        ({"h": [1, (2, {"n": -(2**5000)})]}, "state['h'][1][1]['n']"),
        ({"h": {2**2040: "key"}}, "state['h'] (the key"),
    ],
    ids=["2**3000", "2**2039", "-2**2039-1", "nested -2**5000", "a key 2**2040"],
)
def test_an_int_too_wide_for_weights_only_is_refused_at_save_naming_its_path(
    tmp_path, blocking, state, where
):
    with pytest.raises(ValueError) as error:
        Checkpointer(tmp_path / "ckpt").save(1, state, blocking=blocking)
    message = str(error.value)
    assert message.startswith(where) and "int" in message and "2039" in message, message
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "value",
    [_HIGH, _LOW, 2**63, -(2**63) - 1, 2**31, -(2**31) - 1],
    ids=["2**2039-1", "-2**2039", "2**63", "-2**63-1", "2**31", "-2**31-1"],
)
def test_the_widest_ints_that_load_are_saved(tmp_path, value):
    assert _torch_loads(value)  # the limit above is this torch's, not a guess
    assert _saves_and_loads_back(tmp_path / "ckpt", {"n": value, value: 1}, blocking=True)


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        -float("inf"),
        -0.0,
        5e-324,
        sys.float_info.max,
        "\ud800",
        "a\x00b\n\r\t",
        "\U0010ffff\ufeff",
        "",
        b"\x00\xff" * 3,
        bytearray(b"\x00"),
        ((1,), ((2, ()),)),
        {(1, 2): 3, None: 1, 1.5: 2, True: 3, -(2**100): 4, "": 5},
        {float("nan"): 0},
        [[[[[[[[[[1]]]]]]]]]],
    ],
    ids=repr,
)
@pytest.mark.parametrize("blocking", [True, False])
def test_odd_plain_values_save_and_load_back_bit_for_bit(tmp_path, value, blocking):
    assert _saves_and_loads_back(tmp_path / "ckpt", value, blocking) == _torch_loads(value)


def test_containers_nested_beyond_a_depth_limit_are_refused_not_a_recursion_error(tmp_path):
    deep = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match=r"state\['deep'\]\[0\]\[0\].*nested more than"):
        Checkpointer(tmp_path / "ckpt").save(1, {"deep": deep})
    assert not (tmp_path / "ckpt").exists()


_atoms = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**2100), 2**2100)
    | st.sampled_from([_HIGH, _HIGH + 1, _LOW, _LOW - 1])
    | st.floats()
    | st.text(st.characters(codec=None), max_size=4)
    | st.binary(max_size=4)
    | st.binary(min_size=1, max_size=4).map(bytearray)
    | st.complex_numbers(max_magnitude=10)
    | st.sampled_from(
        list({getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)})
        + [torch.Size([2, 3]), torch.device("cpu"), torch.strided]
    )
)
_hashable = st.recursive(
    _atoms.filter(lambda v: not isinstance(v, bytearray)),
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=2),
    max_leaves=3,
)
_plain = st.recursive(
    _atoms,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.tuples()
        | st.dictionaries(_hashable, inner, max_size=3)
        | st.sets(_hashable, max_size=2)
    ),
    max_leaves=8,
)


@given(value=_plain, blocking=st.booleans())
@settings(max_examples=60)
def test_every_plain_value_is_refused_at_save_or_loads_back_equal(
    tmp_path_factory, value, blocking
):
    _saves_and_loads_back(tmp_path_factory.mktemp("ckpt") / "c", value, blocking)


@pytest.mark.parametrize(
    "dtype",
    sorted(
        {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)},
        key=str,
    ),
    ids=str,
)
def test_every_dtype_saves_exactly_when_this_torch_loads_it(tmp_path, dtype):
    assert _saves_and_loads_back(tmp_path / "a", dtype, True) == _torch_loads(dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is experimental, quantized deprecated
            tensor = torch.zeros(2, dtype=dtype)
    except Exception:
        return
    assert _saves_and_loads_back(tmp_path / "b", tensor, True) == _torch_loads(tensor)


# -------------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("blocking", [True, False])
def test_a_meta_tensor_is_refused_at_save_naming_its_path(tmp_path, blocking):
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    checkpointer = Checkpointer(tmp_path / "ckpt")
    for state, where in [
        ({"model": model}, "state['model']['weight']"),
        ({"x": [torch.empty(3, device="meta")]}, "state['x'][0]"),
    ]:
        with pytest.raises(ValueError) as error:
            checkpointer.save(1, state, blocking=blocking)
        message = str(error.value)
        assert message.startswith(where) and "meta" in message and "no data" in message, message
    assert not (tmp_path / "ckpt").exists()


class _Sub(torch.Tensor):
    pass


def _mkldnn():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no mkldnn")
    return torch.ones(2, 3).to_mkldnn()


@pytest.mark.parametrize(
    "make, what",
    [
        (_mkldnn, "layout torch._mkldnn"),
        (lambda: torch.ones(2).as_subclass(_Sub), "_Sub"),
        (lambda: nn.Parameter(torch.ones(2)).as_subclass(_Sub), "_Sub"),
    ],
)
@pytest.mark.parametrize("blocking", [True, False])
def test_tensors_that_cannot_round_trip_are_refused_at_save(tmp_path, make, what, blocking):
    with pytest.raises(ValueError) as error:
        Checkpointer(tmp_path / "ckpt").save(1, {"x": {"t": make()}}, blocking=blocking)
    assert str(error.value).startswith("state['x']['t']") and what in str(error.value)
    assert not (tmp_path / "ckpt").exists()


def _dense(t):
    if t.is_quantized:
        return (t.int_repr(), t.qscheme())
    if t.is_nested:
        return [_dense(x) for x in t.unbind()]
    return t.to_dense() if t.layout != torch.strided else t


_MATRIX = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -3.0]])
_KINDS = {
    "sparse_coo": lambda: _MATRIX.to_sparse(),
    "sparse_coo uncoalesced": lambda: torch.sparse_coo_tensor([[0, 0, 2]], [1.0, 2.0, 3.0], (4,)),
    "sparse_csr": lambda: _MATRIX.to_sparse_csr(),
    "sparse_csc": lambda: _MATRIX.to_sparse_csc(),
    "quantized per tensor": lambda: torch.quantize_per_tensor(_MATRIX, 0.5, 2, torch.quint8),
    "quantized per channel": lambda: torch.quantize_per_channel(
        _MATRIX, torch.tensor([0.5, 0.25]), torch.tensor([0, 1]), 0, torch.qint8
    ),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)]),
    "conjugate view": lambda: torch.tensor([1 + 2j, 3 - 1j]).conj(),
    "expanded": lambda: torch.arange(2.0).expand(3, 2),
    "parameter": lambda: nn.Parameter(_MATRIX.clone(), requires_grad=False),
}


@pytest.mark.parametrize("kind", _KINDS, ids=list(_KINDS))
@pytest.mark.parametrize("blocking", [True, False])
def test_other_tensor_kinds_that_weights_only_rebuilds_round_trip(tmp_path, kind, blocking):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in recent torch
        tensor = _KINDS[kind]()
        checkpointer = Checkpointer(tmp_path)
        checkpointer.save(1, {"t": tensor}, blocking=blocking)
        loaded = checkpointer.load_latest({"t": None}).values["t"]
    assert type(loaded) is type(tensor) and loaded.layout == tensor.layout
    assert loaded.is_quantized == tensor.is_quantized and loaded.is_nested == tensor.is_nested
    expected, actual = _dense(tensor), _dense(loaded)
    if isinstance(expected, tuple):
        assert torch.equal(expected[0], actual[0]) and expected[1] == actual[1]
    elif isinstance(expected, list):
        assert all(torch.equal(x, y) for x, y in zip(expected, actual))
    else:
        assert torch.equal(expected.resolve_conj(), actual.resolve_conj())
