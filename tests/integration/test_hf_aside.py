"""``unbroken.hf``: a resume never deletes a ``checkpoint-<step>`` folder whose seal does not hold;
it moves it into ``damaged/`` (its files as they were, a note of why) and ``unbroken verify``
lists it. A newer folder that is unsealed (a save that never finished) is removed, as before.
Accelerate's ``load_state`` with a stand-in Accelerator; the Trainer's callback with a
stand-in Trainer (its ``resolve``, which a resume calls first)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import unbroken.hf.accelerate
from unbroken.checkpoint.verdict import DIRECTORY, REASON
from unbroken.cli import main
from unbroken.hf.seal import seal
from unbroken.hf.state import FORMAT, VERSION, state_file


def _folder(directory: Path, step: int, sealed: bool = True) -> Path:
    """A ``checkpoint-<step>`` folder as transformers writes it, with unbroken's state file."""
    folder = directory / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(hashlib.sha256(b"%d" % step).digest() * 100)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    state = {"format": FORMAT, "version": VERSION, "rank": 0, "world_size": 1}
    state.update(global_step=step, loader=None, logging=None)
    (folder / state_file(0)).write_text(json.dumps(state))
    if sealed:
        seal(str(folder))
    return folder


def _damage(folder: Path) -> dict[str, bytes]:
    """One byte of the model changed after the seal; the folder's files as they are then."""
    model = folder / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[10] ^= 0xFF
    model.write_bytes(bytes(data))
    return _files(folder)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != REASON}


def _output(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """checkpoint-2 sealed, checkpoint-3 damaged, checkpoint-4 unsealed."""
    out = tmp_path / "out"
    _folder(out, 2)
    evidence = _damage(_folder(out, 3))
    _folder(out, 4, sealed=False)
    return out, evidence


def _moved_aside(out: Path, evidence: dict[str, bytes]) -> None:
    (moved,) = (out / DIRECTORY).iterdir()
    assert moved.name.endswith("-checkpoint-3")
    assert _files(moved) == evidence
    note = json.loads((moved / REASON).read_text())
    assert note["checkpoint"] == str(out / "checkpoint-3")
    assert "model.safetensors" in note["problems"][0]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", DIRECTORY]


class Accelerator:
    """What ``unbroken.hf.accelerate`` uses of an Accelerator, on one process."""

    is_main_process = is_local_main_process = True
    project_configuration = SimpleNamespace(
        automatic_checkpoint_naming=False, save_on_each_node=False
    )

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_state(self, path: str) -> None:
        self.loaded.append(path)

    def wait_for_everyone(self) -> None:
        pass


def test_accelerate_moves_a_damaged_newer_folder_aside_and_removes_an_unsealed_one(
    tmp_path, caplog
):
    out, evidence = _output(tmp_path)
    accelerator = Accelerator()
    with pytest.warns(unbroken.hf.UnsealedCheckpointWarning):
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            assert unbroken.hf.accelerate.load_state(accelerator, str(out)) == 2
    assert accelerator.loaded == [str(out / "checkpoint-2")]
    _moved_aside(out, evidence)
    assert f"removing {out / 'checkpoint-4'}" in caplog.text
    assert f"to {next((out / DIRECTORY).iterdir())}" in caplog.text


def test_the_trainer_resume_moves_a_damaged_newer_folder_aside(tmp_path, capsys):
    pytest.importorskip("transformers")
    from unbroken.hf.callback import ExactResumeCallback

    out, evidence = _output(tmp_path)
    args = SimpleNamespace(
        output_dir=str(out), should_save=True, process_index=0, world_size=1, save_total_limit=None
    )
    callback = ExactResumeCallback(SimpleNamespace(args=args), signals=(), check_every=1)
    with pytest.warns(unbroken.hf.UnsealedCheckpointWarning):
        assert callback.resolve(True) == str(out / "checkpoint-2")
    _moved_aside(out, evidence)
    # unbroken verify lists it, and the output directory verifies.
    assert main(["verify", str(out), "--json"]) == 0
    (found,) = json.loads(capsys.readouterr().out)["damaged"]
    assert found["checkpoint"] == str(out / "checkpoint-3")
    assert found["path"] == os.path.abspath(next((out / DIRECTORY).iterdir()))


class Saving(Accelerator):
    """An ``Accelerator`` whose ``save_state`` writes a model file, as Accelerate's does."""

    def save_state(self, folder: str) -> None:
        os.makedirs(folder)
        Path(folder, "model.safetensors").write_bytes(b"weights" * 100)


def test_rotation_moves_a_damaged_folder_aside_rather_than_deleting_it(tmp_path):
    out = tmp_path / "out"
    accelerator = Saving()
    for step in (1, 2, 3):
        unbroken.hf.accelerate.save_state(accelerator, str(out), step, keep=2)
    model = out / "checkpoint-3" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-1])  # a size the seal does not vouch for
    evidence = _files(out / "checkpoint-3")
    unbroken.hf.accelerate.save_state(accelerator, str(out), 4, keep=2)
    (moved,) = (out / DIRECTORY).iterdir()
    assert moved.name.endswith("-checkpoint-3") and _files(moved) == evidence
    assert (
        "model.safetensors has 699 bytes" in json.loads((moved / REASON).read_text())["problems"][0]
    )
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", DIRECTORY]
