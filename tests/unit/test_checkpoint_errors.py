"""The kinds of error the checkpoint package raises: each one where it belongs, each a ValueError.

``CorruptCheckpoint``: a checkpoint that fails verification (``load_latest`` skips it);
``StateMismatch``: a checkpoint that does not fit the objects loading it, or another format
version; an entry that ``load_state_dict`` rejects keeps the kind of its refusal. Every test
asserts the exact subclass, so it fails if the package went back to a plain ``ValueError``, and
that ``except ValueError`` still catches it.
"""

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from unbroken.checkpoint import Checkpointer, LocalStorage
from unbroken.checkpoint.layout import MANIFEST, read
from unbroken.errors import CorruptCheckpoint, CorruptState, StateMismatch


def _model(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def _raised(kind, call, match=None):
    """What ``call()`` raised: exactly a ``kind``, caught by ``except ValueError``."""
    try:
        call()
    except ValueError as error:  # what callers wrote before these types existed
        assert type(error) is kind, f"{type(error).__name__} raised, expected {kind.__name__}"
        if match is not None:
            assert match in str(error), str(error)
        return error
    raise AssertionError(f"nothing raised, expected {kind.__name__}")


def _reseal(checkpoint, **changes):
    """Change manifest fields and seal it again (the format's documented seal)."""
    manifest = {**json.loads((checkpoint / MANIFEST).read_text()), **changes}
    del manifest["sha256"]
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["sha256"] = hashlib.sha256(canonical).hexdigest()
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


# ------------------------------------------------------------------------- CorruptCheckpoint


@pytest.mark.parametrize(
    "damage",
    ["flipped byte", "missing manifest", "edited manifest", "malformed manifest", "wrong step"],
)
def test_a_checkpoint_that_fails_verification_is_a_corrupt_checkpoint(tmp_path, damage):
    checkpointer = Checkpointer(tmp_path, keep=3)
    checkpointer.save(1, {"model": _model()})
    path = Path(checkpointer.save(2, {"model": _model()}))
    data = next(path.glob("000-*.pt"))
    if damage == "flipped byte":
        content = bytearray(data.read_bytes())
        content[len(content) // 2] ^= 1
        data.write_bytes(bytes(content))
    elif damage == "missing manifest":
        (path / MANIFEST).unlink()
    elif damage == "edited manifest":
        (path / MANIFEST).write_text(
            (path / MANIFEST).read_text().replace('"step": 2', '"step": 3')
        )
    elif damage == "malformed manifest":
        _reseal(path, torch=5)
    else:
        _reseal(path, step=3)
    expected = {
        "flipped byte": "does not match its sha256",
        "missing manifest": "is missing",
        "edited manifest": "does not match its own sha256",
        "malformed manifest": "manifest['torch'] is an int, expected a str",
        "wrong step": "says step 3, its directory 2",
    }[damage]
    _raised(CorruptCheckpoint, lambda: read(LocalStorage(), str(path), 2), match=expected)
    # load_latest skips exactly this kind, with a warning, to the previous checkpoint.
    with pytest.warns(UserWarning, match=f"skipping checkpoint {path}"):
        assert Checkpointer(tmp_path).load_latest({"model": _model()}).step == 1


def test_a_file_that_torch_cannot_load_is_a_corrupt_checkpoint(tmp_path):
    path = Path(Checkpointer(tmp_path).save(1, {"model": _model()}))
    data = next(path.glob("000-*.pt"))
    data.write_bytes(b"not a zip file")
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][data.name] = {
        "sha256": hashlib.sha256(b"not a zip file").hexdigest(),
        "size": len(b"not a zip file"),
    }
    (path / MANIFEST).write_text(json.dumps(manifest))
    _reseal(path)
    _raised(
        CorruptCheckpoint,
        lambda: read(LocalStorage(), str(path), 1),
        match="does not load with torch.load(weights_only=True)",
    )


# ----------------------------------------------------------------------------- StateMismatch


def test_another_format_version_is_a_state_mismatch_and_not_skipped(tmp_path):
    Checkpointer(tmp_path).save(1, {"model": _model()})
    path = Path(Checkpointer(tmp_path).save(2, {"model": _model()}))
    _reseal(path, version=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not skipped: no warning, no fallback to step 1
        error = _raised(
            StateMismatch,
            lambda: Checkpointer(tmp_path).load_latest({"model": _model()}),
            match="has format version 3; this unbroken reads versions [1, 2]",
        )
    assert (error.field, error.saved, error.current) == ("version", 3, 2)


def test_a_missing_entry_is_a_state_mismatch(tmp_path):
    Checkpointer(tmp_path).save(1, {"model": _model(), "epoch": 3})
    error = _raised(
        StateMismatch,
        lambda: Checkpointer(tmp_path).load_latest({"model": _model(), "ema": _model()}),
        match="has no entry 'ema'",
    )
    assert error.field == "entries" and error.saved == ["epoch", "model"]


def test_a_model_of_another_shape_is_a_state_mismatch_naming_the_tensors(tmp_path):
    Checkpointer(tmp_path).save(1, {"model": _model(width=8)})
    error = _raised(
        StateMismatch,
        lambda: Checkpointer(tmp_path).load_latest({"model": _model(width=6)}),
        match="parameter '0.weight' has shape (8, 4)",
    )
    assert error.field == "state_dict"
    assert error.saved["0.weight"] == (8, 4) and error.current["0.weight"] == (6, 4)
    _raised(
        StateMismatch,
        lambda: Checkpointer(tmp_path).load_latest({"model": nn.Sequential(nn.Linear(4, 8))}),
        match="keys in the checkpoint that the module",
    )


def test_a_plain_value_loaded_into_a_module_is_a_state_mismatch(tmp_path):
    Checkpointer(tmp_path).save(1, {"model": [1, 2]})
    _raised(
        StateMismatch,
        lambda: Checkpointer(tmp_path).load_latest({"model": _model()}),
        match="the checkpoint holds a list, not the state_dict of a Sequential",
    )


def test_an_optimizer_that_does_not_fit_is_a_state_mismatch(tmp_path):
    model = _model()
    Checkpointer(tmp_path).save(
        1, {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "plain": {"lr": 0.1}}
    )
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    error = _raised(
        StateMismatch,
        lambda: Checkpointer(tmp_path).load_latest({"optimizer": other}),
        match="groups of sizes [4]",
    )
    assert (error.field, error.saved, error.current) == ("param_groups", [4], [2])
    wider = torch.optim.SGD(_model(width=6).parameters(), lr=0.1)
    error = _raised(
        StateMismatch,
        lambda: Checkpointer(tmp_path).load_latest({"optimizer": wider}),
        match="parameter 0 of group 0 has shape (8, 4)",
    )
    assert (error.saved, error.current) == ((8, 4), (6, 4))
    _raised(
        StateMismatch,
        lambda: Checkpointer(tmp_path).load_latest(
            {"plain": torch.optim.SGD(model.parameters(), lr=0.1)}
        ),
        match="does not hold an optimizer's state_dict",
    )


# ----------------------------------------------------------- refusals of load_state_dict


class _Refusing:
    """A stateful object whose load_state_dict refuses with ``error``."""

    def __init__(self, error):
        self.error = error

    def state_dict(self):
        return {"seed": 1}

    def load_state_dict(self, state):
        raise self.error


@pytest.mark.parametrize(
    "refusal, kind",
    [
        (StateMismatch("Sampler", "seed", 1, 2), StateMismatch),
        (
            CorruptState("Sampler: 'position' is -1, expected an int >= 0", field="position"),
            CorruptState,
        ),
        (KeyError("position"), ValueError),
    ],
)
def test_a_rejected_entry_keeps_the_kind_of_its_refusal(tmp_path, refusal, kind):
    Checkpointer(tmp_path).save(1, {"model": _model(), "sampler": _Refusing(None)})
    error = _raised(
        kind,
        lambda: Checkpointer(tmp_path).load_latest(
            {"model": _model(), "sampler": _Refusing(refusal)}
        ),
        match="state['sampler']: _Refusing.load_state_dict rejected the entry",
    )
    assert error.__cause__ is refusal and "partly restored" in str(error)
    if kind is StateMismatch:
        assert (error.field, error.saved, error.current) == ("seed", 1, 2)
    if kind is CorruptState:
        assert error.field == "position"
