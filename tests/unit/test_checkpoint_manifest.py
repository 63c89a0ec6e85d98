"""Manifests edited by hand (or by a buggy tool) and sealed again with a valid sha256.

The seal only proves that the manifest was not changed by accident. Whatever it says is checked
against the schema before it is used: a manifest that breaks it is skipped with a warning that
names the problem, and ``load_latest`` falls back to the previous checkpoint; it never crashes.
"""

import hashlib
import json
import re
import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.layout import MANIFEST


def _state(fill=0.0):
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        model.weight.fill_(fill)
    return {"model": model, "optimizer": optimizer, "step": int(fill)}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """Checkpoints 1 and 2 of a model whose weight is filled with the step."""
    directory = tmp_path_factory.mktemp("template")
    checkpointer = Checkpointer(directory, keep=3)
    for step in (1, 2):
        checkpointer.save(step, _state(step))
    return directory


def _copy(template, directory):
    shutil.copytree(template, directory)
    path = directory / "step-000000002"
    return path, json.loads((path / MANIFEST).read_text())


def _reseal(checkpoint, manifest):
    """Write ``manifest`` with a valid seal: the sha256 of its canonical JSON, as documented."""
    if isinstance(manifest, dict):
        manifest.pop("sha256", None)
        canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        manifest["sha256"] = hashlib.sha256(canonical).hexdigest()
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _load(directory):
    """``(restored, warnings)`` of a load_latest of a fresh state."""
    state = {"model": nn.Linear(4, 3), "optimizer": None, "step": None}
    state["optimizer"] = torch.optim.Adam(state["model"].parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = Checkpointer(directory).load_latest(state)
    if restored is not None:
        assert torch.equal(state["model"].weight, torch.full((3, 4), float(restored.step)))
        assert restored.values == {"step": restored.step}
    return restored, [str(w.message) for w in caught]


def _fell_back(directory):
    restored, messages = _load(directory)
    assert restored is not None and restored.step == 1, messages
    assert len(messages) == 1 and "step-000000002" in messages[0], messages
    return messages[0]


def _model_file(manifest):
    return manifest["entries"]["model"]["file"]


EDITS = {
    "entry file is a list": (
        lambda m: m["entries"]["model"].update(file=[_model_file(m)]),
        r"\['entries'\]\['model'\]\['file'\] is a list, expected a str",
    ),
    "file name with a null byte": (
        lambda m: (
            m["files"].update({"000-mo\x00del.pt": m["files"].pop(_model_file(m))})
            or m["entries"]["model"].update(file="000-mo\x00del.pt")
        ),
        r"\['files'\] has an invalid file name '000-mo\\x00del.pt'",
    ),
    "file name with a slash": (
        lambda m: (
            m["files"].update({"../step-000000001/000-model.pt": m["files"].pop(_model_file(m))})
            or m["entries"]["model"].update(file="../step-000000001/000-model.pt")
        ),
        r"invalid file name '\.\./step-000000001/000-model\.pt'",
    ),
    "size is a str": (
        lambda m: m["files"][_model_file(m)].update(size="1234"),
        r"\['files'\]\['000-model\.pt'\]\['size'\] is a str, expected an int >= 0",
    ),
    "size is a bool": (
        lambda m: m["files"][_model_file(m)].update(size=True),
        r"\['size'\] is a bool, expected an int >= 0",
    ),
    "size is negative": (
        lambda m: m["files"][_model_file(m)].update(size=-1),
        r"\['size'\] is -1, expected an int >= 0",
    ),
    "size is a float": (
        lambda m: m["files"][_model_file(m)].update(size=float(m["files"][_model_file(m)]["size"])),
        r"\['size'\] is a float",
    ),
    "sha256 is an int": (
        lambda m: m["files"][_model_file(m)].update(sha256=5),
        r"\['sha256'\] is an int, expected 64 lowercase hex digits",
    ),
    "sha256 is not hex": (
        lambda m: m["files"][_model_file(m)].update(sha256="z" * 64),
        r"\['sha256'\] is 'z+', expected 64 lowercase hex digits",
    ),
    "entries is a list": (
        lambda m: m.update(entries=[]),
        r"manifest\['entries'\] is a list, expected a dict",
    ),
    "files is null": (
        lambda m: m.update(files=None),
        r"manifest\['files'\] is None, expected a dict",
    ),
    "an entry is a str": (
        lambda m: m["entries"].update(model="000-model.pt"),
        r"\['entries'\]\['model'\] is a str, expected a dict",
    ),
    "an entry lacks its file": (
        lambda m: m["entries"]["model"].pop("file"),
        r"manifest\['entries'\]\['model'\] must have one of 'file', 'ranks' and 'dcp'",
    ),
    "a file is not listed": (
        lambda m: m["files"].pop(_model_file(m)),
        r"\['file'\] is '000-model\.pt', which is not in manifest\['files'\]",
    ),
    "step is a float": (
        lambda m: m.update(step=2.0),
        r"manifest\['step'\] is a float, expected an int >= 0",
    ),
    "step is a bool": (lambda m: m.update(step=True), r"manifest\['step'\] is a bool"),
    "version is a str": (
        lambda m: m.update(version="1"),
        r"manifest\['version'\] is a str, expected an int",
    ),
    "torch is missing": (lambda m: m.pop("torch"), r"manifest has no 'torch'"),
    "param_shapes is a dict": (
        lambda m: m["entries"]["optimizer"].update(param_shapes={}),
        r"\['entries'\]\['optimizer'\]\['param_shapes'\] is a dict",
    ),
    "param_shapes has a str": (
        lambda m: m["entries"]["optimizer"]["param_shapes"][0][0].__setitem__(0, "4"),
        r"\['param_shapes'\]\[0\]\[0\]\[0\] is a str, expected an int >= 0",
    ),
    "param_shapes lists too few groups": (
        lambda m: m["entries"]["optimizer"].update(param_shapes=[]),
        r"\['optimizer'\]\['param_shapes'\] lists 0 parameter groups of sizes \[\], the "
        r"optimizer state_dict in 001-optimizer\.pt has 1 of sizes \[2\]",
    ),
    "param_shapes lists too few parameters": (
        lambda m: m["entries"]["optimizer"]["param_shapes"][0].pop(),
        r"lists 1 parameter groups of sizes \[1\], the optimizer state_dict in "
        r"001-optimizer\.pt has 1 of sizes \[2\]",
    ),
}


@pytest.mark.parametrize("edit", EDITS, ids=list(EDITS))
def test_a_resealed_manifest_that_breaks_the_schema_is_skipped_naming_the_problem(
    template, tmp_path, edit
):
    change, why = EDITS[edit]
    checkpoint, manifest = _copy(template, tmp_path / "ckpt")
    change(manifest)
    _reseal(checkpoint, manifest)
    message = _fell_back(tmp_path / "ckpt")
    assert "manifest.json is malformed" in message and re.search(why, message), message


def test_a_manifest_that_is_not_an_object_or_nested_too_deep_is_skipped(template, tmp_path):
    checkpoint, manifest = _copy(template, tmp_path / "a")
    _reseal(checkpoint, [manifest])
    assert "format" in _fell_back(tmp_path / "a")
    checkpoint, _ = _copy(template, tmp_path / "b")  # too deep for json: the seal is moot
    text = (checkpoint / MANIFEST).read_text().rstrip().rstrip("}")
    (checkpoint / MANIFEST).write_text(text + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "manifest.json is unreadable" in _fell_back(tmp_path / "b")


def test_a_file_linked_from_outside_the_checkpoint_is_refused(template, tmp_path):
    # A data file replaced by a symbolic link to a file elsewhere (its sha256 and size resealed
    # into the manifest) would load that file: refused, the previous checkpoint loads.
    checkpoint, manifest = _copy(template, tmp_path / "ckpt")
    outside = tmp_path / "elsewhere.pt"
    name = next(f for f in manifest["files"] if f.endswith("model.pt"))
    shutil.copy(template / "step-000000001" / name, outside)  # a valid file, of step 1
    (checkpoint / name).unlink()
    (checkpoint / name).symlink_to(outside)
    data = outside.read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    _reseal(checkpoint, manifest)
    message = _fell_back(tmp_path / "ckpt")
    assert f"{name} is a symbolic link" in message, message


def test_unknown_keys_are_ignored(template, tmp_path):
    checkpoint, manifest = _copy(template, tmp_path / "ckpt")
    manifest["note"] = {"any": ["thing"]}
    manifest["entries"]["model"]["comment"] = 1
    _reseal(checkpoint, manifest)
    restored, messages = _load(tmp_path / "ckpt")
    assert restored.step == 2 and messages == []


# ----------------------------------------------------------------------------- generated


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=5,
)


def _paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


def _at(manifest, path):
    for key in path:
        manifest = manifest[key]
    return manifest


def _edits(manifest):
    """Every place of the manifest but its seal, as a ``(path, value there)`` pair."""
    return [(p, _at(manifest, p)) for p in _paths(manifest) if p and p[0] != "sha256"]


@st.composite
def _type_changes(draw, manifest):
    """A path and a value of another type there (2.0 for 2 counts: sizes are ints)."""
    path, old = draw(st.sampled_from(_edits(manifest)))
    return path, draw(_json.filter(lambda new: type(new) is not type(old)))


@given(data=st.data())
@settings(max_examples=80)
def test_any_change_of_a_fields_type_falls_back_to_the_previous_checkpoint(
    template, tmp_path_factory, data
):
    directory = tmp_path_factory.mktemp("ckpt") / "c"
    checkpoint, manifest = _copy(template, directory)
    path, new = data.draw(_type_changes(manifest))
    if path == ("version",) and type(new) is int:
        return  # another format version: an error, tested in test_checkpoint.py
    _at(manifest, path[:-1])[path[-1]] = new
    _reseal(checkpoint, manifest)
    _fell_back(directory)


@given(data=st.data())
@settings(max_examples=80)
def test_any_edit_is_skipped_loaded_or_a_value_error_never_a_crash(
    template, tmp_path_factory, data
):
    directory = tmp_path_factory.mktemp("ckpt") / "c"
    checkpoint, manifest = _copy(template, directory)
    path, old = data.draw(st.sampled_from(_edits(manifest)))
    parent, key = _at(manifest, path[:-1]), path[-1]
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        parent[key] = data.draw(_json)
    elif action == "delete":
        del parent[key]
    elif isinstance(old, dict):
        old[data.draw(st.text(max_size=5))] = data.draw(_json)
    elif isinstance(old, list):
        old.append(data.draw(_json))
    _reseal(checkpoint, manifest)
    try:
        restored, messages = _load(directory)
    except ValueError as error:  # a whole checkpoint that does not fit the state, or v2
        assert str(error).startswith(("state[", "checkpoint ")), str(error)
        return
    assert restored is not None and restored.step in (1, 2)
    assert len(messages) == (restored.step == 1), messages
