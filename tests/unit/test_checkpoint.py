"""Checkpointer: round trips, corruption, retention, refusal at save time, async, SIGKILL.

Every test writes real files under pytest's tmp_path; nothing about the file system is mocked.
"""

import collections
import enum
import errno
import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import reseal
from hypothesis import given, settings
from hypothesis import strategies as st
from pipelines import Counting
from torch import nn

import unbroken
from unbroken.checkpoint import Checkpointer, Restored
from unbroken.checkpoint.layout import MANIFEST
from unbroken.checkpoint.writing import Writing


def _model(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 2))


def _trained(width=8, optimizer="adam", steps=3):
    model = _model(width)
    params = model.parameters()
    opt = (
        torch.optim.Adam(params, lr=0.01)
        if optimizer == "adam"
        else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    )
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        scheduler.step()
    return model, opt, scheduler


def assert_same(a, b, where="state"):
    """Equal nested data; tensors compared with torch.equal (and dtype)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def _steps(directory):
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("step-"))


# ------------------------------------------------------------------------------- round trips


def _scaler(**kw):
    # torch >= 2.4 (pyproject) has a CPU GradScaler: a failure here is a failure, not a skip.
    return torch.amp.GradScaler("cpu", **kw)


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_round_trip_restores_every_object_and_value(tmp_path, blocking, optimizer):
    model, opt, scheduler = _trained(optimizer=optimizer)
    scaler = _scaler(init_scale=1024.0)
    scaler.scale(model(torch.randn(5, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update(512.0)
    loader = unbroken.DataLoader(Counting(10), batch_size=3, shuffle=True, seed=4)
    batches = iter(loader)
    next(batches)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": scheduler,
        "scaler": scaler,
        "loader": loader,
        "epoch": 3,
        "history": [0.5, (1, "a"), {"best": torch.ones(2)}],
        "note": None,
    }
    expected = {
        name: obj.state_dict() if hasattr(obj, "state_dict") else obj for name, obj in state.items()
    }
    with Checkpointer(tmp_path, keep=2) as checkpointer:
        assert checkpointer.save(7, state, blocking=blocking) == str(tmp_path / "step-000000007")

    fresh_model, fresh_opt, fresh_scheduler = _trained(optimizer=optimizer, steps=0)
    fresh = {
        "model": fresh_model,
        "optimizer": fresh_opt,
        "scheduler": fresh_scheduler,
        "scaler": _scaler(),
        "loader": unbroken.DataLoader(Counting(10), batch_size=3, shuffle=True, seed=4),
        "epoch": 0,
        "history": [],
        "note": "x",
    }
    restored = Checkpointer(tmp_path).load_latest(fresh)
    assert isinstance(restored, Restored) and restored.unrequested == {}
    assert restored.step == 7 and restored.path == str(tmp_path / "step-000000007")
    assert list(restored.values) == ["epoch", "history", "note"]
    for name, obj in fresh.items():
        assert_same(
            expected[name],
            obj.state_dict() if hasattr(obj, "state_dict") else restored.values[name],
            name,
        )
    # The restored loader continues where the saved one was.
    assert [b.tolist() for b in fresh["loader"]] == [b.tolist() for b in batches]


class _Warmup:
    """A callable object: LambdaLR saves its __dict__ (plain data) in its state."""

    def __init__(self, steps):
        self.steps = steps

    def __call__(self, epoch):
        return min(1.0, (epoch + 1) / self.steps)


@pytest.mark.parametrize(
    "make",
    [
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2),
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=20),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.9**epoch),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _Warmup(5)),
        lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),  # holds float('inf')
    ],
    ids=["StepLR", "OneCycleLR", "LambdaLR-lambda", "LambdaLR-object", "ReduceLROnPlateau"],
)
def test_schedulers_round_trip(tmp_path, make):
    def build():
        opt = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
        return opt, make(opt)

    opt, scheduler = build()
    for _ in range(3):
        opt.step()
        scheduler.step(
            *([1.0] if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) else [])
        )
    Checkpointer(tmp_path).save(3, {"optimizer": opt, "scheduler": scheduler})
    opt2, scheduler2 = build()
    Checkpointer(tmp_path).load_latest({"optimizer": opt2, "scheduler": scheduler2})
    assert_same(scheduler.state_dict(), scheduler2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())


def test_unrequested_entries_are_returned_and_missing_ones_are_an_error(tmp_path):
    model, opt, _ = _trained()
    Checkpointer(tmp_path).save(1, {"model": model, "optimizer": opt, "epoch": 4})
    restored = Checkpointer(tmp_path).load_latest({"model": _model()})
    assert list(restored.unrequested) == ["optimizer", "epoch"]
    assert restored.unrequested["epoch"] == 4 and restored.values == {}
    with pytest.raises(ValueError, match=r"no entry 'ema'.*\['epoch', 'model', 'optimizer'\]"):
        Checkpointer(tmp_path).load_latest({"model": _model(), "ema": _model()})


def test_no_checkpoint_returns_none(tmp_path):
    assert Checkpointer(tmp_path / "absent").load_latest({"model": _model()}) is None
    assert not (tmp_path / "absent").exists()  # loading creates nothing


def test_restored_is_always_true_and_plain_values_are_returned_not_rebound(tmp_path):
    model, opt, _ = _trained()
    Checkpointer(tmp_path).save(3, {"model": model, "optimizer": opt, "epoch": 4, "history": [0.5]})
    # Everything restored, nothing left over: the result must still read as "resumed".
    restored = Checkpointer(tmp_path).load_latest({"model": _model()})
    assert restored and bool(restored) is True and not isinstance(restored, dict)
    state = {"model": _model(), "epoch": None}
    restored = Checkpointer(tmp_path).load_latest(state)
    assert state["epoch"] is None  # the caller's dict is not changed
    assert type(restored.step) is int and restored.step == 3
    assert restored.path == str(tmp_path / "step-000000003")
    assert restored.values == {"epoch": 4}
    assert list(restored.unrequested) == ["optimizer", "history"]
    assert restored.unrequested["history"] == [0.5]
    text = repr(restored)
    assert text.startswith(
        f"Restored(step=3, path={str(tmp_path / 'step-000000003')!r}, "
        "values={'epoch': 4}, unrequested={'optimizer': {"
    ), text
    assert len(text) < 400  # the optimizer's state is elided, not printed
    Checkpointer(tmp_path).save(4, {"model": model})
    only = Checkpointer(tmp_path).load_latest({"model": _model()})
    assert (only.values, only.unrequested) == ({}, {}) and only
    assert repr(only).endswith("values={}, unrequested={}, world_size=1)")


@pytest.mark.parametrize("make", ["file", "under a file", "becomes a file"])
def test_a_directory_that_is_a_file_is_refused_before_anything_is_touched(tmp_path, make):
    blocker = tmp_path / "ckpt"
    directory = blocker / "sub" if make == "under a file" else blocker
    if make != "becomes a file":
        blocker.write_text("precious")
        with pytest.raises(NotADirectoryError) as error:
            Checkpointer(directory)
        assert str(directory) in str(error.value) and "not a directory" in str(error.value)
        return
    checkpointer = Checkpointer(directory)
    blocker.write_text("precious")
    for call in (
        lambda: checkpointer.load_latest({"x": None}),
        lambda: checkpointer.save(1, {"x": 1}, blocking=False),  # raised by save
        lambda: checkpointer.save(1, {"x": 1}),
    ):
        with pytest.raises(NotADirectoryError, match=f"{directory}.*not a directory"):
            call()
    checkpointer.wait()  # no background failure pending
    assert blocker.read_text() == "precious"


@pytest.mark.parametrize("blocking", [True, False])
def test_every_file_and_directory_written_is_fsynced(tmp_path, monkeypatch, blocking):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc/self/fd to name a descriptor's file")
    monkeypatch.setattr(os, "fsync", fsync)
    directory = tmp_path / "new" / "ckpt"  # created by the save: both levels
    checkpointer = Checkpointer(directory)
    for step, new in [(1, True), (1, False), (2, False)]:  # new, replaced, plain
        synced.clear()
        final = Path(checkpointer.save(step, {"model": _model(), "epoch": 1}, blocking=blocking))
        checkpointer.wait()
        temporary = {path.parent for path in synced if path.name == MANIFEST}
        assert len(temporary) == 1
        temporary = temporary.pop()
        assert temporary.parent == directory and temporary.name.startswith(".tmp-step-")
        written = {temporary / path.name for path in final.iterdir()}
        expected = written | {temporary, directory}
        if new:  # the directories the save created: their entries in their parents too
            expected |= {directory.parent, tmp_path}
        assert set(synced) == expected, sorted(map(str, set(synced) ^ expected))
    assert len(written) == 3


# --------------------------------------------------------- what saves, loads (weights_only)


class _Colour(enum.IntEnum):
    RED = 1


class _Custom:
    pass


@pytest.mark.parametrize(
    "value, path, what",
    [
        ({"fn": lambda: 0}, "state['bad']['fn']", "function"),
        ({"a": [1, {"b": _Custom()}]}, "state['bad']['a'][1]['b']", "_Custom"),
        ({"x": np.float64(1.5)}, "state['bad']['x']", "numpy float64"),
        ({"x": np.arange(3)}, "state['bad']['x']", "numpy ndarray"),
        ([collections.defaultdict(list)], "state['bad'][0]", "defaultdict"),
        ({"c": _Colour.RED}, "state['bad']['c']", "_Colour"),
        ({"b": b""}, "state['bad']['b']", "bytes"),
        ({_Custom(): 1}, "(the key", "_Custom"),
    ],
)
def test_a_value_weights_only_cannot_load_fails_at_save_naming_its_path(
    tmp_path, value, path, what
):
    checkpointer = Checkpointer(tmp_path / "ckpt")
    for blocking in (True, False):
        with pytest.raises(ValueError) as error:
            checkpointer.save(1, {"model": _model(), "bad": value}, blocking=blocking)
        assert path in str(error.value) and what in str(error.value), str(error.value)
    assert not (tmp_path / "ckpt").exists()  # nothing written, not even the directory


def test_a_user_object_with_an_unloadable_state_names_the_path_inside_it(tmp_path):
    class Stateful:
        def state_dict(self):
            return {"rng": np.random.default_rng(0)}

        def load_state_dict(self, state):
            pass

    with pytest.raises(ValueError, match=r"state\['data'\]\['rng'\]: a numpy.random.*Generator"):
        Checkpointer(tmp_path).save(1, {"data": Stateful()})
    cycle = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match=r"state\['c'\]\[0\]: this list contains itself"):
        Checkpointer(tmp_path).save(1, {"c": cycle})
    assert list(tmp_path.iterdir()) == []


def _torch_loads(value):
    """Whether the installed torch saves ``value`` and loads it back with weights_only=True."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        loaded = torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return type(loaded) is type(value) and loaded == value


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"abc",
        bytearray(),
        bytearray(b"abc"),
        1 + 2j,
        torch.strided,
        torch.sparse_coo,
        collections.Counter("abca"),
        {3, 1, 2},
        set(),
        frozenset({1}),
        frozenset(),
    ],
    ids=repr,
)
def test_a_value_saves_exactly_when_this_torch_loads_it(tmp_path, value):
    checkpointer = Checkpointer(tmp_path)
    # A type is accepted when all its values load: b"" does not (it pickles as a call to bytes).
    empty = {bytes: b"", bytearray: bytearray(), set: set(), frozenset: frozenset()}
    if _torch_loads(value) and _torch_loads(empty.get(type(value), value)):
        checkpointer.save(1, {"x": [value]})
        loaded = checkpointer.load_latest({"x": None}).values["x"]
        assert type(loaded[0]) is type(value) and loaded == [value]
    else:
        refused = rf"state\['x'\]\[0\]: a {type(value).__name__} does not load with torch.load"
        with pytest.raises(ValueError, match=refused):
            checkpointer.save(1, {"x": [value]})
        assert list(tmp_path.iterdir()) == []


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.text(max_size=5)
    | st.floats(allow_nan=False)
    | st.binary(max_size=5).map(bytearray)
    | st.builds(
        lambda n, d: torch.arange(n).to(d),
        st.integers(0, 4),
        st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool]),
    )
    | st.sampled_from([torch.Size([2, 3]), torch.device("cpu"), torch.float16])
)
_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=3)
        | st.builds(
            collections.OrderedDict, st.dictionaries(st.text(max_size=3), inner, max_size=3)
        )
        | (st.sets(st.integers(), max_size=3) if _torch_loads({1}) else st.nothing())
    ),
    max_leaves=10,
)


@given(value=_values, blocking=st.booleans())
@settings(max_examples=40)
def test_what_saves_loads_back_equal(tmp_path_factory, value, blocking):
    directory = tmp_path_factory.mktemp("ckpt")
    checkpointer = Checkpointer(directory)
    checkpointer.save(0, {"value": value}, blocking=blocking)
    loaded = checkpointer.load_latest({"value": None}).values["value"]
    if isinstance(value, set):
        assert loaded == value
    else:
        assert_same(value, loaded)


# ------------------------------------------------------------------------------- corruption


def _two_checkpoints(directory):
    checkpointer = Checkpointer(directory, keep=3)
    for step in (1, 2):
        model = _model()
        with torch.no_grad():
            model[0].weight.fill_(step)
        checkpointer.save(step, {"model": model, "step": step})
    return directory / "step-000000002"


def _data_file(checkpoint):
    return next(p for p in sorted(checkpoint.iterdir()) if p.name.startswith("000-"))


def _truncate(checkpoint):
    file = _data_file(checkpoint)
    file.write_bytes(file.read_bytes()[:-100])


def _flip_byte(checkpoint):
    file = _data_file(checkpoint)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _flip_manifest_digit(checkpoint):
    manifest = (checkpoint / MANIFEST).read_text()
    at = manifest.index('"size": ') + len('"size": ')
    digit = str((int(manifest[at]) + 1) % 10)
    (checkpoint / MANIFEST).write_text(manifest[:at] + digit + manifest[at + 1 :])


CORRUPTIONS = {
    "truncated file": (_truncate, "has .* bytes, the manifest says"),
    "flipped byte": (_flip_byte, "does not match its sha256"),
    "missing file": (lambda c: _data_file(c).unlink(), "unreadable: No such file"),
    "deleted manifest": (lambda c: (c / MANIFEST).unlink(), "manifest.json is missing"),
    "garbage manifest": (
        lambda c: (c / MANIFEST).write_bytes(b"\x00{not json"),
        "manifest.json is unreadable",
    ),
    "empty manifest": (lambda c: (c / MANIFEST).write_bytes(b""), "manifest.json is unreadable"),
    "edited manifest": (_flip_manifest_digit, "does not match its own sha256"),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_a_corrupt_checkpoint_is_skipped_with_a_warning_and_the_previous_one_used(
    tmp_path, corrupt
):
    damage, why = CORRUPTIONS[corrupt]
    newest = _two_checkpoints(tmp_path)
    damage(newest)
    state = {"model": _model(), "step": 0}
    with pytest.warns(UserWarning, match=why) as caught:
        restored = Checkpointer(tmp_path).load_latest(state)
    assert str(newest) in str(caught[0].message)
    assert restored.step == 1 and restored.values == {"step": 1}
    assert torch.equal(state["model"][0].weight, torch.ones(8, 4))


def test_all_corrupt_returns_none_with_a_warning_for_each(tmp_path):
    _two_checkpoints(tmp_path)
    _truncate(tmp_path / "step-000000002")
    (tmp_path / "step-000000001" / MANIFEST).unlink()
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning) as caught:
        assert Checkpointer(tmp_path).load_latest({"model": model}) is None
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "step-000000002" in messages[0] and "step-000000001" in messages[1]
    assert_same(before, model.state_dict())


class _Payload:
    """Unpickling this calls open(marker, "w"): code from the file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_loading_runs_no_code_from_the_file(tmp_path, writer):
    def write(path, marker):
        if writer == "torch.save":
            torch.save({"weight": _Payload(marker)}, path)
        else:
            import pickle

            path.write_bytes(pickle.dumps({"weight": _Payload(marker)}, protocol=2))

    # The payload works: an unrestricted load runs it.
    write(tmp_path / "probe.pt", tmp_path / "probe-marker")
    if writer == "torch.save":
        torch.load(tmp_path / "probe.pt", weights_only=False)
    else:
        import pickle

        pickle.loads((tmp_path / "probe.pt").read_bytes())
    assert (tmp_path / "probe-marker").exists()

    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    _two_checkpoints(directory)
    newest = directory / "step-000000002"
    write(_data_file(newest), marker)
    reseal(newest, _data_file(newest).name)
    state = {"model": _model(), "step": 0}
    with pytest.warns(UserWarning, match="step-000000002.*does not load with torch.load"):
        assert Checkpointer(directory).load_latest(state).step == 1
    assert not marker.exists()


def test_a_checkpoint_of_another_format_version_is_an_error_not_skipped(tmp_path):
    newest = _two_checkpoints(tmp_path)
    reseal(newest, version=3)
    with pytest.raises(
        ValueError,
        match=r"step-000000002 has format version 3; this unbroken "
        r"reads versions \[1, 2\]\. Resume with the unbroken version",
    ):
        Checkpointer(tmp_path).load_latest({"model": _model()})


# -------------------------------------------------------------------------------- mismatches


def test_a_model_of_another_shape_names_the_parameter_and_both_shapes(tmp_path):
    model, opt, _ = _trained(width=8)
    Checkpointer(tmp_path).save(1, {"model": model, "optimizer": opt})
    other, other_opt, _ = _trained(width=6, steps=0)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError) as error:
        Checkpointer(tmp_path).load_latest({"model": other, "optimizer": other_opt})
    message = str(error.value)
    assert "state['model']" in message
    assert "parameter '0.weight' has shape (8, 4) in the checkpoint and (6, 4) now" in message
    assert "buffer '1.running_mean' has shape (8,) in the checkpoint and (6,) now" in message
    assert_same(before, other.state_dict())  # checked before anything was restored

    with pytest.raises(ValueError, match=r"'model'.*missing from the checkpoint: \['2.weight"):
        Checkpointer(tmp_path).load_latest(
            {"model": nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))}
        )
    with pytest.raises(
        ValueError,
        match=r"state\['optimizer'\]: parameter 0 of group 0 has "
        r"shape \(8, 4\) in the checkpoint and \(6, 4\) now",
    ):
        Checkpointer(tmp_path).load_latest({"optimizer": other_opt})
    with pytest.raises(ValueError, match=r"'optimizer'.*groups of sizes \[6\].* sizes \[2\]"):
        Checkpointer(tmp_path).load_latest(
            {"optimizer": torch.optim.Adam(nn.Linear(2, 2).parameters())}
        )


def test_a_rejected_entry_is_a_value_error_naming_it_and_chaining_the_cause(tmp_path):
    loader = unbroken.DataLoader(Counting(10), batch_size=3, seed=1)
    Checkpointer(tmp_path).save(1, {"model": _model(), "loader": loader})
    other = unbroken.DataLoader(Counting(10), batch_size=4, seed=1)
    with pytest.raises(ValueError, match=r"state\['loader'\].*batch_size=3.*batch_size=4") as error:
        Checkpointer(tmp_path).load_latest({"model": _model(), "loader": other})
    assert isinstance(error.value.__cause__, ValueError)
    assert "partly restored" in str(error.value) and "['model']" in str(error.value)


# ------------------------------------------------------------------ retention and leftovers


@pytest.mark.parametrize("keep", [2, 3])
def test_retention_keeps_the_newest(tmp_path, keep):
    checkpointer = Checkpointer(tmp_path, keep=keep)
    for step in range(1, 7):
        checkpointer.save(step * 10, {"step": step})
        assert _steps(tmp_path) == [f"step-{s * 10:09d}" for s in range(1, step + 1)][-keep:]


@pytest.mark.parametrize("keep", [1, 0, True, 2.0, "2"])
def test_keep_below_two_is_refused(tmp_path, keep):
    with pytest.raises(ValueError, match=f"keep must be an int >= 2, got {keep!r}"):
        Checkpointer(tmp_path, keep=keep)


def test_leftovers_of_killed_writers_do_not_count_and_are_removed(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, {"step": 1})
    checkpointer.save(99, {"step": 99})
    # A complete-looking save that was never renamed, and one half deleted by retention.
    os.rename(tmp_path / "step-000000099", tmp_path / ".tmp-step-000000099-123-abcd")
    (tmp_path / ".del-step-000000000-0a0b").mkdir()
    restored = checkpointer.load_latest({"step": None})
    assert restored.step == 1 and restored.values == {"step": 1}
    checkpointer.save(2, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001", "step-000000002"]


def test_a_writer_killed_while_replacing_a_step_leaves_the_old_one(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, {"step": 1})
    checkpointer.save(2, {"step": 2})
    # Killed between moving step 2 aside and renaming its replacement into place.
    os.rename(tmp_path / "step-000000002", tmp_path / ".old-step-000000002-00ff")
    restored = checkpointer.load_latest({"step": None})
    assert restored.step == 2 and restored.values == {"step": 2}
    checkpointer.save(3, {"step": 3})  # the writer's clean-up puts it back
    assert _steps(tmp_path) == ["step-000000002", "step-000000003"]


def test_saving_a_step_again_replaces_it_and_a_lower_step_supersedes_newer_ones(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=3)
    for step in (1, 2, 3):
        checkpointer.save(step, {"value": f"first {step}"})
    checkpointer.save(3, {"value": "second 3"})
    restored = checkpointer.load_latest({"value": None})
    assert restored.step == 3 and restored.values == {"value": "second 3"}
    assert _steps(tmp_path) == ["step-000000001", "step-000000002", "step-000000003"]
    # A newer checkpoint not found damaged is never deleted: the save is refused.
    with pytest.raises(ValueError, match=r"cannot save step 2 .*\['step-000000003'\]"):
        checkpointer.save(2, {"value": "again 2"})
    # The run went back to step 2 (3 is corrupt): its next save is what resumes.
    _truncate(tmp_path / "step-000000003")
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert checkpointer.load_latest({"value": None}).step == 2
    checkpointer.save(2, {"value": "again 2"})  # step 3 moved aside: test_checkpoint_quarantine
    restored = checkpointer.load_latest({"value": None})
    assert restored.step == 2 and restored.values == {"value": "again 2"}
    assert _steps(tmp_path) == ["step-000000001", "step-000000002"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert [p.name[-14:] for p in (tmp_path / "damaged").iterdir()] == ["step-000000003"]


@pytest.mark.parametrize("step", [-1, 1.0, True, "3", None])
def test_a_bad_step_is_refused(tmp_path, step):
    with pytest.raises(ValueError, match=f"step must be an int >= 0.*got {step!r}"):
        Checkpointer(tmp_path).save(step, {"x": 1})


# ------------------------------------------------------------------------------------ async


def test_async_save_writes_the_state_as_it_was_when_save_returned(tmp_path, monkeypatch):
    # The background writer is held until training has changed every tensor in place: what it
    # writes must be the copy taken by save(), whatever the threads' timing.
    release, held = threading.Event(), []
    commit = Writing._write_files

    def held_commit(self, *args):
        held.append(threading.current_thread() is not threading.main_thread())
        assert release.wait(timeout=600), "the test never released the background writer"
        return commit(self, *args)

    monkeypatch.setattr(Writing, "_write_files", held_commit)
    model, opt, scheduler = _trained()
    buffer = torch.arange(4.0)
    history = {"losses": [1.0, 0.5], "buffer": buffer}
    state = {"model": model, "optimizer": opt, "history": history}
    # Copies: an optimizer's state_dict() holds its live state tensors.
    expected = {"model": _clone(model.state_dict()), "optimizer": _clone(opt.state_dict())}
    checkpointer = Checkpointer(tmp_path)
    try:
        checkpointer.save(5, state, blocking=False)
        with torch.no_grad():  # training goes on at once
            for p in model.parameters():
                p.add_(100.0)
        for _ in range(2):  # Adam's moments and step counts change in place; BatchNorm's stats
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
        buffer.add_(100.0)
        history["losses"].append(0.1)
    finally:
        release.set()
    checkpointer.wait()
    assert held == [True], "the save did not go through the background thread"
    fresh_model, fresh_opt, _ = _trained(steps=0)
    fresh = {"model": fresh_model, "optimizer": fresh_opt, "history": None}
    restored = Checkpointer(tmp_path).load_latest(fresh)
    assert restored.step == 5
    assert_same(expected["model"], fresh_model.state_dict())
    assert_same(expected["optimizer"], fresh_opt.state_dict())
    assert_same(restored.values, {"history": {"losses": [1.0, 0.5], "buffer": torch.arange(4.0)}})


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return type(value)((k, _clone(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _failing_disk(monkeypatch):
    def fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)


def test_an_async_failure_is_raised_by_the_next_save_or_wait(tmp_path, monkeypatch):
    _failing_disk(monkeypatch)
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, {"x": 1}, blocking=False)  # returns: the failure is in the thread
    with pytest.raises(OSError, match="Input/output error"):
        checkpointer.save(2, {"x": 2}, blocking=False)
    checkpointer.save(3, {"x": 3}, blocking=False)
    with pytest.raises(OSError, match="Input/output error"):
        checkpointer.wait()
    checkpointer.wait()  # reported once

    with pytest.raises(OSError, match="Input/output error"):
        with Checkpointer(tmp_path) as failing:
            failing.save(1, {"x": 1}, blocking=False)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_load_latest_and_close_wait_for_the_async_save(tmp_path):
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"x": torch.ones(1000)}, blocking=False)
        assert checkpointer.load_latest({"x": None}).step == 1
        checkpointer.save(2, {"x": torch.zeros(1000)}, blocking=False)
    assert _steps(tmp_path) == ["step-000000001", "step-000000002"]


# ---------------------------------------------------------------------------------- SIGKILL

_WRITER = """
import sys
import torch
from unbroken.checkpoint import Checkpointer

checkpointer = Checkpointer(sys.argv[1], keep=2)
model = torch.nn.Linear(1024, 512)  # 2 MB of parameters
state = {"model": model, "step": 0}
restored = checkpointer.load_latest(state)
step = 0 if restored is None else restored.step
print("ready", step, flush=True)
while True:
    step += 1
    with torch.no_grad():
        generator = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    state["step"] = step
    print("saving", step, flush=True)
    checkpointer.save(step, state, blocking=step % 2 == 0)
    if step % 3 == 0:  # saved again: the replacement path moves the first one aside
        checkpointer.save(step, state)
"""


def _check_whole(directory, previous):
    model = torch.nn.Linear(1024, 512)
    state = {"model": model, "step": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a committed checkpoint is never corrupt
        restored = Checkpointer(directory).load_latest(state)
    if restored is None:
        assert previous == 0
        return 0
    assert restored.step == restored.values["step"] >= previous
    generator = torch.Generator().manual_seed(restored.step)
    for p in model.parameters():
        assert torch.equal(p, torch.randn(p.shape, generator=generator))
    return restored.step


def test_sigkill_at_any_moment_leaves_a_whole_checkpoint(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(_WRITER))
    directory = tmp_path / "ckpt"
    rng = random.Random(1234)
    step = leftovers = 0
    for kill in range(14):
        child = subprocess.Popen(
            [sys.executable, str(script), str(directory)], stdout=subprocess.PIPE, text=True
        )
        try:
            ready = child.stdout.readline().split()
            assert ready[:1] == ["ready"] and int(ready[1]) == step
            if kill % 2:  # somewhere in the loop
                time.sleep(rng.uniform(0.0, 0.3))
            else:  # just after a save began, often within the write
                for _ in range(rng.randint(1, 4)):
                    child.stdout.readline()
                time.sleep(rng.uniform(0.0, 0.01))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        leftovers += any(p.name.startswith(".tmp-") for p in directory.iterdir())
        step = _check_whole(directory, step)
        assert len(_steps(directory)) <= 3  # keep, plus one if killed before retention
    assert step >= 7  # every run saved and most of them committed something
    assert leftovers >= 1  # some kills landed inside a write
    # The next save removes what the killed writers left.
    Checkpointer(directory).save(step + 1, {"step": step + 1})
    assert [p.name for p in directory.iterdir() if not p.name.startswith("step-")] == []
