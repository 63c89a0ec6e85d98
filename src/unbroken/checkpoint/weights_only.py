"""What ``torch.load(weights_only=True)`` can rebuild, checked when a checkpoint is *taken*.

Checkpoints are loaded with ``weights_only=True``, which runs no code from the file and so
rebuilds only plain data and tensors. ``checked_copy`` walks a state before it is written, copies
its containers (and, for a background write, its tensors to CPU memory) and refuses anything
such a load would not give back, naming its key path: what saves, loads. Its unpickler reads
ints of at most 255 bytes (pickle's LONG1, not LONG4), tensors only with their data (not on the
meta device, not mkldnn's opaque layout) and no tensor subclasses; floats (nan, inf, -0.0), str
(any code points) and dict keys of any loadable type round-trip. What varies between torch
versions (sets since 2.6; ``bytes`` never when empty; the widest int; each dtype) is probed once
per process with the installed torch (~10 ms).
"""

from __future__ import annotations

import functools
import io
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import torch

# Deeper nesting is refused: pickling recurses once per level, so Python's recursion limit
# (1000) would stop the save with a RecursionError instead of a message naming the path.
MAX_DEPTH = 100
# Layouts whose tensors weights_only rebuilds (mkldnn tensors cannot even be pickled).
_LAYOUTS = {
    torch.strided,
    torch.sparse_coo,
    torch.sparse_csr,
    torch.sparse_csc,
    torch.sparse_bsr,
    torch.sparse_bsc,
}
# What torch.load(weights_only=True) rebuilds, by exact type: subclasses such as IntEnum,
# numpy.float64 or defaultdict pickle as their own class, which it refuses.
_ATOMS = {
    type(None),
    bool,
    int,
    float,
    str,
    torch.Size,
    torch.device,
    torch.dtype,
    bytes,
    bytearray,
    complex,
    torch.layout,
}  # the last four if _PROBED says so
_MAPPINGS = {dict, OrderedDict, Counter}
_SEQUENCES = {list, tuple, set, frozenset}
# Types that only some torch versions load (sets since 2.6; bytes never when empty, as that
# pickles as a call to bytes()): probed once with the installed torch, with what to use instead.
_PROBED = {
    bytes: ((b"", b"a"), "a bytearray or a uint8 tensor"),
    bytearray: ((bytearray(), bytearray(b"a")), "a uint8 tensor"),
    complex: ((1j,), "a complex tensor or a (real, imag) tuple"),
    torch.layout: ((torch.strided,), "its name as a str"),
    Counter: ((Counter("ab"),), "a dict"),
    set: (({1},), "a sorted list"),
    frozenset: ((frozenset({1}),), "a sorted list"),
}


def checked_copy(value: Any, path: str, clone: bool, active: frozenset = frozenset()) -> Any:
    """A copy of the containers of ``value`` (and of its tensors, on CPU, if ``clone``).

    Raises ``ValueError`` naming ``path`` for anything ``torch.load(weights_only=True)``
    could not rebuild.
    """
    kind = type(value)
    if kind in _PROBED and kind not in _loadable():
        raise ValueError(
            f"{path}: a {kind.__name__} does not load with torch.load(weights_only="
            f"True) in torch {torch.__version__}; use {_PROBED[kind][1]} instead"
        )
    if kind is int:
        _check_int(value, path)
    if kind is torch.dtype and not _round_trips(value):
        raise ValueError(
            f"{path}: the dtype {value} does not load with torch.load(weights_only="
            f"True) in torch {torch.__version__}; save its name as a str instead"
        )
    if kind in _ATOMS:
        return bytearray(value) if clone and kind is bytearray else value
    if kind in (torch.Tensor, torch.nn.Parameter):
        return _tensor(value, path, clone)
    if isinstance(value, torch.Tensor):
        raise ValueError(
            f"{path}: a {kind.__module__}.{kind.__qualname__} (a tensor subclass) does not load "
            "with torch.load(weights_only=True), which rebuilds only torch.Tensor and "
            "nn.Parameter; save value.as_subclass(torch.Tensor), or the plain tensors it wraps"
        )
    if kind in _MAPPINGS or kind in _SEQUENCES:
        if id(value) in active:
            raise ValueError(f"{path}: this {kind.__name__} contains itself")
        if len(active) >= MAX_DEPTH:
            raise ValueError(
                f"{path}: containers nested more than {MAX_DEPTH} deep cannot be "
                "checkpointed (pickling recurses once per level); flatten it"
            )
        active = active | {id(value)}
        if kind in _SEQUENCES:
            return kind(checked_copy(v, f"{path}[{i}]", clone, active) for i, v in enumerate(value))
        out = kind()
        for key, item in value.items():
            key = checked_copy(key, f"{path} (the key {key!r})", False, active)
            out[key] = checked_copy(item, f"{path}[{key!r}]", clone, active)
        for attr, item in getattr(value, "__dict__", {}).items():  # a state_dict's _metadata
            setattr(out, attr, checked_copy(item, f"{path}.{attr}", clone, active))
        return out
    if isinstance(value, (np.ndarray, np.generic)):
        raise ValueError(
            f"{path}: a numpy {kind.__name__} does not load with torch.load(weights_only=True); "
            "return torch.from_numpy(array) or scalar.item() from state_dict() instead"
        )
    raise ValueError(
        f"{path}: a {kind.__module__}.{kind.__qualname__} cannot be checkpointed. Checkpoints "
        "are loaded with torch.load(weights_only=True), which runs no code and so rebuilds only "
        "plain data (dicts, lists, tuples, str, int, float, bool, None) and tensors; give the "
        "object state_dict()/load_state_dict() methods that return those, or leave it out"
    )


def _tensor(value: torch.Tensor, path: str, clone: bool) -> torch.Tensor:
    if value.is_meta:
        raise ValueError(
            f"{path}: a tensor on the meta device (shape {tuple(value.shape)}) has no data, so "
            "it would load as an empty meta tensor that no load_state_dict accepts; give it "
            "values first (module.to_empty(device=...), then initialize or load weights)"
        )
    if value.layout not in _LAYOUTS:
        raise ValueError(
            f"{path}: a tensor with layout {value.layout} cannot be saved and "
            "loaded with torch.load(weights_only=True); convert it to a dense one "
            "(.to_dense()) in state_dict()"
        )
    if vars(value):
        raise ValueError(
            f"{path}: this tensor carries Python attributes {sorted(vars(value))},"
            " which a weights_only load refuses; save a plain tensor"
        )
    if not _round_trips(value.dtype, tensor=True):
        raise ValueError(
            f"{path}: a tensor of dtype {value.dtype} does not load with torch.load("
            f"weights_only=True) in torch {torch.__version__}; convert it with .to()"
        )
    if not clone:
        return value
    try:
        copy = value.detach().to("cpu", copy=True)
    except Exception as error:  # whatever torch refuses, say which tensor
        raise ValueError(
            f"{path}: this tensor could not be copied to CPU memory for the "
            f"background save: {type(error).__name__}: {error}"
        ) from error
    if type(value) is torch.nn.Parameter:
        return torch.nn.Parameter(copy, value.requires_grad)
    return copy


def _check_int(value: int, path: str) -> None:
    bits, low, high = _int_range()
    if bits is not None and not low <= value <= high:
        raise ValueError(
            f"{path}: this int has {value.bit_length()} bits; torch.load(weights_only=True) in "
            f"torch {torch.__version__} rebuilds only ints from -2**{bits} to 2**{bits} - 1. "
            "Save it as hex(n) and read it back with int(s, 16)"
        )


@functools.cache
def _int_range() -> tuple[int | None, int, int]:
    """``(bits, -2**bits, 2**bits - 1)``: the ints that load; ``bits`` is None if all do."""
    if _round_trips(2**2039) and _round_trips(-(2**2039) - 1):  # pickle's LONG4 too
        return None, 0, 0
    bits = 2039 if _round_trips(2**2039 - 1) and _round_trips(-(2**2039)) else 31  # LONG1, BININT
    return bits, -(2**bits), 2**bits - 1


@functools.cache
def _round_trips(sample: Any, tensor: bool = False) -> bool:
    """Whether ``sample`` (or, with ``tensor``, a tensor of that dtype) loads back equal."""
    try:
        if tensor:
            sample = torch.zeros(1, dtype=sample)
    except Exception:  # no plain tensor of it can be made: nothing to refuse
        return True
    try:
        buffer = io.BytesIO()
        torch.save(sample, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        return type(loaded) is type(sample) and (
            loaded.dtype == sample.dtype if tensor else loaded == sample
        )
    except Exception:  # refused, in whichever way this torch refuses
        return False


@functools.cache
def _loadable() -> frozenset:
    """The types of ``_PROBED`` that this torch saves and loads back with weights_only=True."""
    loadable = set()
    for kind, (samples, _) in _PROBED.items():
        try:
            for sample in samples:
                buffer = io.BytesIO()
                torch.save(sample, buffer)
                buffer.seek(0)
                loaded = torch.load(buffer, weights_only=True)
                if type(loaded) is not kind or loaded != sample:
                    break
            else:
                loadable.add(kind)
        except Exception:  # refused, in whichever way this torch refuses
            pass
    return frozenset(loadable)
