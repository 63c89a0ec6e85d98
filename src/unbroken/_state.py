"""Plain, JSON-able, versioned state: encoding user states and checking what is loaded.

Every state unbroken produces passes ``json.dumps``. States of user objects (samplers, datasets)
may hold tensors or numpy arrays, e.g. a generator's state; ``to_jsonable`` turns those into
tagged dicts ``{"__tensor__": ...}`` and ``from_jsonable`` turns them back. Anything else that
JSON cannot hold is refused when the state is *taken*, naming its key, so that a state that
saved is a state that loads.

Loading checks every field before anything changes, and a mismatch is a ``ValueError`` that
names the field, the saved value and the current one: never a bare ``KeyError``, and never a
silent restart from zero.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import torch

_TENSOR_TAG = "__tensor__"
_NDARRAY_TAG = "__ndarray__"


def has_state(obj: Any) -> bool:
    """Whether ``obj`` follows torch's Stateful protocol (``state_dict``/``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


def to_jsonable(value: Any, path: str = "state") -> Any:
    """A copy of ``value`` made only of dict/list/str/int/float/bool/None."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # also turns IntEnum and numpy-like ints into plain ints
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: {value!r} is not valid JSON; keep states finite")
        return value
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, np.floating):
        return to_jsonable(value.item(), path)
    if isinstance(value, torch.Tensor):
        return {_TENSOR_TAG: _encode_array(value.detach().cpu().contiguous().numpy(), str(value.dtype))}
    if isinstance(value, np.ndarray):
        return {_NDARRAY_TAG: _encode_array(np.ascontiguousarray(value), str(value.dtype))}
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(
                    f"{path}: key {key!r} is a {type(key).__name__}; JSON keys must be str"
                )
            out[key] = to_jsonable(item, f"{path}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise ValueError(
        f"{path}: a {type(value).__module__}.{type(value).__qualname__} cannot be saved as JSON; "
        "a state may hold dicts, lists, str, int, float, bool, None, tensors and numpy arrays"
    )


def _encode_array(array: np.ndarray, dtype: str) -> dict:
    return {
        "dtype": dtype,
        "shape": list(array.shape),
        "data": base64.b64encode(array.tobytes()).decode("ascii"),
    }


def _decode_array(spec: dict) -> np.ndarray:
    dtype = spec["dtype"].removeprefix("torch.")
    raw = base64.b64decode(spec["data"])
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(spec["shape"]).copy()


def from_jsonable(value: Any) -> Any:
    """Inverse of ``to_jsonable`` (tuples come back as lists)."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_TAG}:
            return torch.from_numpy(_decode_array(value[_TENSOR_TAG]))
        if set(value) == {_NDARRAY_TAG}:
            return _decode_array(value[_NDARRAY_TAG])
        return {key: from_jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [from_jsonable(item) for item in value]
    return value


class StateReader:
    """Reads fields of a loaded state, raising ``ValueError`` that names what is wrong."""

    def __init__(self, state: Any, what: str, fields: set[str], fmt: str, version: int) -> None:
        if not isinstance(state, dict):
            raise ValueError(
                f"{what}.load_state_dict expected the dict returned by state_dict(), "
                f"got a {type(state).__name__}"
            )
        if state.get("format") != fmt:
            raise mismatch(what, "format", state.get("format"), fmt,
                           f"This state does not come from {what}.state_dict().")
        if state.get("version") != version:
            raise mismatch(what, "version", state.get("version"), version,
                           "This state comes from another version of unbroken; resume with "
                           "the version that saved it.")
        try:
            json.dumps(state)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{what} state is not plain JSON data ({error})") from None
        unexpected = sorted(set(state) - fields)
        missing = sorted(fields - set(state))
        if missing or unexpected:
            raise ValueError(
                f"{what} state is malformed: missing fields {missing}, unexpected fields "
                f"{unexpected}; pass the dict that {what}.state_dict() returned"
            )
        self.state, self.what = state, what

    def int(self, field: str, minimum: int = 0, maximum: int | None = None) -> int:
        value = self.state[field]
        bad = not isinstance(value, int) or isinstance(value, bool) or value < minimum
        if bad or (maximum is not None and value > maximum):
            upper = "" if maximum is None else f" and <= {maximum}"
            raise ValueError(
                f"{self.what} state field '{field}': expected an int >= {minimum}{upper}, "
                f"got {value!r}"
            )
        return value

    def dict(self, field: str) -> dict:
        value = self.state[field]
        if not isinstance(value, dict):
            raise ValueError(
                f"{self.what} state field '{field}': expected a dict, got {value!r}"
            )
        return value


def mismatch(what: str, field: str, saved: Any, current: Any, hint: str = "") -> ValueError:
    return ValueError(
        f"{what}: the state was saved with {field}={saved!r} but this loader has "
        f"{field}={current!r}. {hint or 'Resume with the same setting, or start a new run.'}"
    )
