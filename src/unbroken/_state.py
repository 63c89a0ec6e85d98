"""Plain, JSON-able, versioned state: encoding user states and checking what is loaded.

Every state unbroken produces passes ``json.dumps``. States of user objects (samplers, datasets)
may hold what JSON cannot: ``to_jsonable`` turns tensors and numpy arrays into tagged dicts
``{"__tensor__": ...}`` and a dict whose keys are not all str (torchdata's test datasets key
their states by int) into ``{"__items__": [[key, value], ...]}``, keys being str, int, float,
bool, None or tuples of these; ``from_jsonable`` turns them back, key types included. Anything
else is refused when the state is *taken*, naming its key path, so that a state that saved is a
state that loads. ``encode_or_defer`` takes an object's state that way but defers a refusal
(``Unsaveable``) to the moment the user asks for the state, so iterating never fails for it.

Loading checks every field before anything changes (``StateReader``, against the state's
``Format`` and ``TypedDict`` schema): a state saved under other settings is a ``StateMismatch``
naming the field, the saved value and the current one; a malformed or inconsistent one is a
``CorruptState``; never a bare ``KeyError``, and never a silent restart from zero.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._checks import is_int
from .errors import CorruptState, StateMismatch

_TENSOR_TAG = "__tensor__"
_NDARRAY_TAG = "__ndarray__"
_ITEMS_TAG = "__items__"
_TAGS = (_TENSOR_TAG, _NDARRAY_TAG, _ITEMS_TAG)
# Counters in states (epochs, positions) stay below this: any real run does, and a larger value
# is a corrupt or edited state.
COUNT_LIMIT = (1 << 63) - 1


def has_state(obj: Any) -> bool:
    """Whether ``obj`` follows torch's Stateful protocol (``state_dict``/``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


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
        return {
            _TENSOR_TAG: _encode_array(value.detach().cpu().contiguous().numpy(), str(value.dtype))
        }
    if isinstance(value, np.ndarray):
        return {_NDARRAY_TAG: _encode_array(np.ascontiguousarray(value), str(value.dtype))}
    if isinstance(value, dict):
        # A dict with only str keys stays a dict, unless it would read back as a tag.
        if all(isinstance(key, str) for key in value) and not (
            len(value) == 1 and next(iter(value)) in _TAGS
        ):
            return {key: to_jsonable(item, f"{path}.{key}") for key, item in value.items()}
        return {
            _ITEMS_TAG: [
                [_encode_key(key, path), to_jsonable(item, _key_path(path, key))]
                for key, item in value.items()
            ]
        }
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise ValueError(
        f"{path}: a {type(value).__module__}.{type(value).__qualname__} cannot be saved as JSON; "
        "a state may hold dicts, lists, str, int, float, bool, None, tensors and numpy arrays"
    )


def _encode_key(key: Any, path: str) -> Any:
    """A dict key as JSON: str/int/float/bool/None as themselves, a tuple as a list (a key
    cannot be a list, so a list read back in a key is a tuple)."""
    if key is None or isinstance(key, (bool, str)):
        return key
    if isinstance(key, np.bool_):
        return bool(key)
    if isinstance(key, (int, np.integer)):
        return int(key)
    if isinstance(key, (float, np.floating)) and math.isfinite(key):
        return float(key)
    if isinstance(key, tuple):
        return [_encode_key(part, path) for part in key]
    raise ValueError(
        f"{path}: key {key!r} is a {type(key).__name__}; a state's keys may be str, int, "
        "finite float, bool, None or tuples of these: use one of those as the key"
    )


def _key_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]"


def _decode_key(key: Any) -> Any:
    return tuple(_decode_key(part) for part in key) if isinstance(key, list) else key


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
    """Inverse of ``to_jsonable`` (tuples come back as lists, except in dict keys)."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_TAG}:
            return torch.from_numpy(_decode_array(value[_TENSOR_TAG]))
        if set(value) == {_NDARRAY_TAG}:
            return _decode_array(value[_NDARRAY_TAG])
        if set(value) == {_ITEMS_TAG}:
            return {_decode_key(key): from_jsonable(item) for key, item in value[_ITEMS_TAG]}
        return {key: from_jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [from_jsonable(item) for item in value]
    return value


class Unsaveable:
    """Stands in for a state that ``to_jsonable`` refused; ``state_dict()`` raises its error."""

    def __init__(self, error: ValueError) -> None:
        self.error = error

    def __reduce__(self):  # sent from loader workers to the training process
        return (Unsaveable, (self.error,))


def encode_or_defer(value: Any, path: str, what: str) -> Any:
    """A user object's ``state_dict()`` result as JSON data, or an ``Unsaveable`` carrying the
    refusal: taking a state happens while iterating, and only asking for it (``state_dict()``)
    should fail. It must be a dict, as in torch's Stateful protocol: a loaded state is checked
    to be one, so that a state that saved is a state that loads."""
    if not isinstance(value, dict):
        return Unsaveable(
            ValueError(
                f"{what}: cannot save the state: {path} returned a "
                f"{type(value).__name__}, expected a dict"
            )
        )
    try:
        return to_jsonable(value, path)
    except ValueError as error:
        return Unsaveable(ValueError(f"{what}: cannot save the state: {error}"))


def raise_if_unsaveable(value: Any) -> None:
    if isinstance(value, Unsaveable):
        raise value.error


def same(a: Any, b: Any) -> bool:
    """Equal as JSON data: unlike ``==``, ``True`` is not ``1`` and ``1.0`` is not ``1``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check_user_state(value: Any, where: str) -> None:
    """Refuse a user object's saved state (a sampler's, a dataset's) that is not a dict or that
    ``from_jsonable`` could not read back, at load time rather than when the object is restored,
    mid-iteration."""
    if not isinstance(value, dict):
        raise CorruptState(
            f"{where}: expected the object's state_dict() (a dict), got {value!r:.200}"
        )
    try:
        from_jsonable(value)
    except Exception as error:  # whatever a mangled tag makes numpy or base64 raise
        raise CorruptState(
            f"{where}: a tagged value (tensor, array or non-str keys) is malformed "
            f"({type(error).__name__}: {error}); the state is corrupt"
        ) from None


@dataclass(frozen=True)
class Format:
    """What a saved state of one kind of object looks like: its ``format`` tag, the version
    ``state_dict()`` writes, the versions ``load_state_dict`` reads, and its fields (the keys
    of its ``TypedDict`` schema)."""

    name: str
    version: int
    schema: Any  # a TypedDict class
    readable: tuple[int, ...] = ()

    @property
    def fields(self) -> frozenset[str]:
        return schema_fields(self.schema)


def schema_fields(schema: Any) -> frozenset[str]:
    """The keys of a ``TypedDict`` schema: what a saved dict of that shape holds, exactly."""
    return frozenset(schema.__annotations__)


class StateReader:
    """The one validation path of a loaded state: its shape first (a dict of plain JSON with
    exactly the schema's fields, the right format and a readable version), then each field
    read through a typed getter that names the field when it is wrong. Readers only read:
    the caller swaps its position in once everything was read."""

    def __init__(self, state: Any, what: str, fmt: Format) -> None:
        if not isinstance(state, dict):
            raise CorruptState(
                f"{what}.load_state_dict expected the dict returned by state_dict(), "
                f"got a {type(state).__name__}"
            )
        if state.get("format") != fmt.name:
            raise StateMismatch(
                what,
                "format",
                state.get("format"),
                fmt.name,
                f"This state does not come from {what}.state_dict().",
            )
        version = state.get("version")
        if not any(same(version, v) for v in (fmt.version, *fmt.readable)):
            raise StateMismatch(
                what,
                "version",
                version,
                fmt.version,
                "This state comes from another version of unbroken; resume with "
                "the version that saved it.",
            )
        try:
            json.dumps(state, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise CorruptState(f"{what} state is not plain JSON data ({error})") from None
        fields = fmt.fields
        unexpected = sorted(set(state) - fields)
        missing = sorted(fields - set(state))
        if missing or unexpected:
            raise CorruptState(
                f"{what} state is malformed: missing fields {missing}, unexpected fields "
                f"{unexpected}; pass the dict that {what}.state_dict() returned"
            )
        self.state, self.what, self.version = state, what, version

    def int(self, field: str, minimum: int = 0, maximum: int = COUNT_LIMIT) -> int:
        value = self.state[field]
        return check_int(value, f"{self.what} state field '{field}'", minimum, maximum)

    def bool(self, field: str) -> bool:
        value = self.state[field]
        if not isinstance(value, bool):
            raise CorruptState(
                f"{self.what} state field '{field}': expected a bool, got {value!r}", field
            )
        return value

    def dict(self, field: str) -> dict:
        value = self.state[field]
        if not isinstance(value, dict):
            raise CorruptState(
                f"{self.what} state field '{field}': expected a dict, got {value!r}", field
            )
        return value


def check_int(value: Any, where: str, minimum: int = 0, maximum: int = COUNT_LIMIT) -> int:
    """``value`` if it is an int (not a bool) in [minimum, maximum], else a ``ValueError``."""
    if not is_int(value) or not minimum <= value <= maximum:
        upper, note = f" and <= {maximum}", ""
        if maximum == COUNT_LIMIT:
            upper, note = "", " (counters stay below 2**63)"
        raise CorruptState(
            f"{where}: expected an int >= {minimum}{upper}, got {value!r:.100}{note}"
        )
    return value
