"""What ``torch.load(weights_only=True)`` can rebuild, checked when a checkpoint is *taken*.

Checkpoints are loaded with ``weights_only=True``, which runs no code from the file and so
rebuilds only plain data and tensors. ``snapshot`` walks a state before it is written, copies
its containers (and, for a background write, its tensors to CPU memory) and refuses anything
such a load would not give back, naming its key path: what saves, loads. Types that only some
torch versions load (sets since 2.6; ``bytes`` never when empty) are probed once per process
with the installed torch (~8 ms).
"""

from __future__ import annotations

import functools
import io
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import torch

# What torch.load(weights_only=True) rebuilds, by exact type: subclasses such as IntEnum,
# numpy.float64 or defaultdict pickle as their own class, which it refuses.
_ATOMS = {type(None), bool, int, float, str, torch.Size, torch.device, torch.dtype, bytes,
          bytearray, complex, torch.layout}  # the last four if _PROBED says so
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


def snapshot(value: Any, path: str, clone: bool, active: frozenset = frozenset()) -> Any:
    """A copy of the containers of ``value`` (and of its tensors, on CPU, if ``clone``).

    Raises ``ValueError`` naming ``path`` for anything ``torch.load(weights_only=True)``
    could not rebuild.
    """
    kind = type(value)
    if kind in _PROBED and kind not in _loadable():
        raise ValueError(f"{path}: a {kind.__name__} does not load with torch.load(weights_only="
                         f"True) in torch {torch.__version__}; use {_PROBED[kind][1]} instead")
    if kind in _ATOMS:
        return bytearray(value) if clone and kind is bytearray else value
    if kind in (torch.Tensor, torch.nn.Parameter):
        if vars(value):
            raise ValueError(f"{path}: this tensor carries Python attributes {sorted(vars(value))},"
                             " which a weights_only load refuses; save a plain tensor")
        if not clone:
            return value
        copy = value.detach().to("cpu", copy=True)
        return torch.nn.Parameter(copy, value.requires_grad) if kind is not torch.Tensor else copy
    if kind in _MAPPINGS or kind in _SEQUENCES:
        if id(value) in active:
            raise ValueError(f"{path}: this {kind.__name__} contains itself")
        active = active | {id(value)}
        if kind in _SEQUENCES:
            return kind(snapshot(v, f"{path}[{i}]", clone, active) for i, v in enumerate(value))
        out = kind()
        for key, item in value.items():
            key = snapshot(key, f"{path} (the key {key!r})", False, active)
            out[key] = snapshot(item, f"{path}[{key!r}]", clone, active)
        for attr, item in getattr(value, "__dict__", {}).items():  # a state_dict's _metadata
            setattr(out, attr, snapshot(item, f"{path}.{attr}", clone, active))
        return out
    if isinstance(value, (np.ndarray, np.generic)):
        raise ValueError(
            f"{path}: a numpy {kind.__name__} does not load with torch.load(weights_only=True); "
            "return torch.from_numpy(array) or scalar.item() from state_dict() instead")
    raise ValueError(
        f"{path}: a {kind.__module__}.{kind.__qualname__} cannot be checkpointed. Checkpoints "
        "are loaded with torch.load(weights_only=True), which runs no code and so rebuilds only "
        "plain data (dicts, lists, tuples, str, int, float, bool, None) and tensors; give the "
        "object state_dict()/load_state_dict() methods that return those, or leave it out")


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
        except Exception:  # noqa: BLE001 - refused, in whichever way this torch refuses
            pass
    return frozenset(loadable)
