"""``unbroken verify`` / ``inspect`` of Hugging Face output directories and checkpoint folders.

The folders are built by hand as ``unbroken.hf.Trainer`` leaves them (HF's files, each rank's
``unbroken-state-rank<r>.json`` with a real ``unbroken.DataLoader`` state, then a seal): a sealed
checkpoint-9 and checkpoint-40, a sealed checkpoint-50 with one byte changed since, and a
checkpoint-60 whose save was killed before ``trainer_state.json`` and the seal. What the command
says a resume does is checked against ``unbroken.hf.last_sealed``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import unbroken
from unbroken import cli
from unbroken.hf import UnsealedCheckpointWarning, last_sealed, seal

# The loader's place in checkpoint-40: epoch 1 (of 8 batches of 8), 5 batches in.
EPOCH, BATCHES, SAMPLES = 1, 5, 40
UNSEALED = "it has no unbroken-seal.json, so its save did not finish"
CHANGED = "model.safetensors does not match its sha256 in the seal"


def _loader_state(epoch: int, batches: int) -> dict:
    loader = unbroken.DataLoader(list(range(64)), batch_size=8, shuffle=True, seed=3)
    for _ in range(epoch):
        for _ in loader:
            pass
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return loader.state_dict()


def _checkpoint(output: Path, step: int, sealed: bool = True, whole: bool = True) -> Path:
    """A ``checkpoint-<step>`` folder of a 2-rank ``unbroken.hf.Trainer`` run."""
    folder = output / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (folder / "optimizer.pt").write_bytes(bytes(600))
    if not whole:  # killed here: no more files, no seal
        return folder
    loader = _loader_state(EPOCH, BATCHES) if step == 40 else _loader_state(0, step % 8)
    for rank in range(2):
        (folder / f"rng_state_{rank}.pth").write_bytes(bytes([rank]) * 100)
        state = {
            "format": "unbroken.hf.TrainerState",
            "version": 1,
            "rank": rank,
            "world_size": 2,
            "global_step": step,
            "loader": loader,
            "logging": {"loss": 0.5},
        }
        (folder / f"unbroken-state-rank{rank}.json").write_text(json.dumps(state))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": 1.6}))
    if sealed:
        seal(str(folder))
    return folder


@pytest.fixture
def output(tmp_path) -> Path:
    """The output directory: checkpoint-9 and -40 sealed, -50 damaged, -60 killed mid-save."""
    output = tmp_path / "output"
    _checkpoint(output, 9)  # older; by name it would sort after checkpoint-60
    _checkpoint(output, 40)
    with open(_checkpoint(output, 50) / "model.safetensors", "r+b") as file:
        file.seek(100)
        file.write(b"\xff")  # was 100: one byte changed, the size kept
    _checkpoint(output, 60, sealed=False, whole=False)
    (output / "runs").mkdir()  # the Trainer's logs, and other files, are not checkpoints
    (output / "config.json").write_text("{}")
    return output


def _run(capsys, *argv: str) -> tuple[int, str]:
    status = cli.main(list(argv))
    return status, capsys.readouterr().out


def test_verify_fails_on_the_newest_and_says_a_resume_loads_the_newest_sealed(output, capsys):
    status, out = _run(capsys, "verify", str(output))
    assert status == 1
    assert out.startswith(f"Hugging Face output directory {output}: checkpoints in {output}\n")
    rows = [line.split() for line in out.splitlines()[3:7]]
    assert [(row[0], row[1], row[-1]) for row in rows] == [
        ("checkpoint-9", "9", "ok"),
        ("checkpoint-40", "40", "ok"),
        ("checkpoint-50", "50", "DAMAGED"),
        ("checkpoint-60", "60", "UNSEALED"),
    ]
    assert f"checkpoint-50: {CHANGED}\ncheckpoint-60: {UNSEALED}\n" in out
    assert out.splitlines()[-1] == (
        f"FAILED: the newest checkpoint, checkpoint-60, does not verify ({UNSEALED}); a resume "
        "would skip checkpoint-60, checkpoint-50 and fall back to checkpoint-40 (step 40)"
    )
    with warnings.catch_warnings(record=True) as caught:  # what the Trainer's resume takes
        warnings.simplefilter("always")
        chosen, skipped = last_sealed(str(output))
    assert chosen == str(output / "checkpoint-40")
    assert [os.path.basename(v.folder) for v in skipped] == ["checkpoint-60", "checkpoint-50"]
    assert [w.category for w in caught] == [UnsealedCheckpointWarning] * 2


def test_verify_json(output, capsys):
    status, out = _run(capsys, "verify", str(output), "--json")
    report = json.loads(out)
    assert status == 1
    assert (report["command"], report["directory"], report["kind"]) == (
        "verify",
        str(output),
        "hf-run",
    )
    assert report["checkpoints_directory"] == str(output)
    checkpoints = report["checkpoints"]
    assert [(c["name"], c["step"], c["status"], c["verified"]) for c in checkpoints] == [
        ("checkpoint-9", 9, "ok", True),
        ("checkpoint-40", 40, "ok", True),
        ("checkpoint-50", 50, "damaged", False),
        ("checkpoint-60", 60, "unsealed", False),
    ]
    assert [c["problems"] for c in checkpoints] == [[], [], [CHANGED], [UNSEALED]]
    assert [c["world_size"] for c in checkpoints] == [2, 2, None, None]  # unsealed: not read
    forty = checkpoints[1]
    assert forty["path"] == str(output / "checkpoint-40")
    assert forty["entries"] == [
        "model.safetensors",
        "optimizer.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "trainer_state.json",
        "unbroken-state-rank0.json",
        "unbroken-state-rank1.json",
    ]
    assert forty["bytes"] == sum(p.stat().st_size for p in (output / "checkpoint-40").iterdir())
    assert forty["written"] is not None and checkpoints[3]["written"] is None
    assert [(c["position"], c["loaders"], c["log_bytes"]) for c in checkpoints] == [
        (None, [], None)
    ] * 4
    assert (report["newest"], report["ok"], report["log"]) == ("checkpoint-60", False, None)
    assert report["resume"] == {
        "checkpoint": "checkpoint-40",
        "step": 40,
        "skipped": ["checkpoint-60", "checkpoint-50"],
        "fails": None,
        "position": None,
        "loaders": [],
        "summary": "resume would load checkpoint checkpoint-40; it would skip checkpoint-60 "
        "(unsealed), checkpoint-50 (damaged)",
    }


def test_inspect_shows_the_step_and_the_loaders_position(output, capsys):
    status, out = _run(capsys, "inspect", str(output))
    assert status == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:7]}
    assert rows["checkpoint-40"][:6] == ["checkpoint-40", "40", "1", "5", "40", "40"]
    assert rows["checkpoint-9"][:6] == ["checkpoint-9", "9", "0", "1", "8", "9"]
    assert rows["checkpoint-50"][2:6] == ["-"] * 4  # not sealed as it is: nothing read
    loader_row = "train_loader  unbroken.DataLoader  -        3      1        5       40"
    assert "loaders in checkpoint-40:\n  NAME  " in out and loader_row in out
    assert out.splitlines()[-1] == (
        "Resume would load checkpoint checkpoint-40 and continue epoch 1 at batch 5 (sample "
        "40), optimizer step 40; it would skip checkpoint-60 (unsealed), checkpoint-50 "
        "(damaged)."
    )
    report = json.loads(_run(capsys, "inspect", str(output), "--json")[1])
    position = {
        "epoch": EPOCH,
        "phase": None,
        "batch": BATCHES,
        "sample": SAMPLES,
        "optimizer_step": 40,
        "source": "unbroken-state-rank0.json",
    }
    assert report["checkpoints"][1]["position"] == position
    assert report["resume"]["position"] == position
    loader = {
        "name": "train_loader",
        "format": "unbroken.DataLoader",
        "version": 3,
        "seed": 3,
        "epoch": EPOCH,
        "batches": BATCHES,
        "samples": SAMPLES,
    }
    assert report["resume"]["loaders"] == [loader]
    # The step is trainer_state.json's, not the state's or the folder's.
    forty = output / "checkpoint-40"
    (forty / "trainer_state.json").write_text(json.dumps({"global_step": 41}))
    seal(str(forty))
    report = json.loads(_run(capsys, "inspect", str(forty), "--json")[1])
    assert report["checkpoints"][0]["position"]["optimizer_step"] == 41


def test_one_checkpoint_folder(output, capsys):
    forty = output / "checkpoint-40"
    status, out = _run(capsys, "verify", str(forty))
    assert status == 0
    assert out.startswith(f"Hugging Face checkpoint {forty}\n")
    assert out.splitlines()[-1] == "OK: the newest checkpoint, checkpoint-40, verifies"
    report = json.loads(_run(capsys, "inspect", str(forty), "--json")[1])
    assert (report["kind"], report["checkpoints_directory"]) == ("hf-checkpoint", str(output))
    assert [c["name"] for c in report["checkpoints"]] == ["checkpoint-40"]
    assert report["resume"]["checkpoint"] == "checkpoint-40"
    assert report["resume"]["position"]["batch"] == BATCHES
    for name, problem in (("checkpoint-50", CHANGED), ("checkpoint-60", UNSEALED)):
        # checkpoint-60 has neither a seal nor trainer_state.json: known by its sealed siblings.
        status, out = _run(capsys, "verify", str(output / name), "--json")
        report = json.loads(out)
        assert (status, report["kind"], report["ok"]) == (1, "hf-checkpoint", False)
        assert report["checkpoints"][0]["problems"] == [problem]
        resume = report["resume"]
        assert (resume["checkpoint"], resume["skipped"]) == (None, [])  # refused, not skipped
        assert resume["fails"].startswith(
            f"unbroken.hf.Trainer refuses to resume from {output / name} ({problem})"
        )


def test_an_output_directory_with_nothing_sealed_cannot_be_resumed(tmp_path, capsys):
    output = tmp_path / "output"
    _checkpoint(output, 10, sealed=False)  # stock transformers: trainer_state.json, no seal
    _checkpoint(output, 20, sealed=False)
    status, out = _run(capsys, "verify", str(output), "--json")
    report = json.loads(out)
    assert (status, report["kind"], report["resume"]["checkpoint"]) == (1, "hf-run", None)
    assert [c["status"] for c in report["checkpoints"]] == ["unsealed", "unsealed"]
    assert report["resume"]["skipped"] == ["checkpoint-20", "checkpoint-10"]
    assert report["resume"]["fails"] == (
        f"no checkpoint-<step> folder in {output} is sealed, so unbroken.hf.Trainer's "
        "resume_from_checkpoint=True raises; train without it to start afresh"
    )
    status, out = _run(capsys, "inspect", str(output))
    assert status == 0 and out.splitlines()[-1].startswith(
        "A resume would fail (skipping checkpoint-20 (unsealed), checkpoint-10 (unsealed)): no "
    )


def test_folders_of_that_name_without_a_seal_or_trainer_state_are_not_recognised(tmp_path, capsys):
    output = tmp_path / "output"
    _checkpoint(output, 60, sealed=False, whole=False)
    for directory in (output, output / "checkpoint-60"):
        status, out = _run(capsys, "verify", str(directory), "--json")
        assert status == 2
        assert "nor, on a local disk, a Hugging Face output directory" in json.loads(out)["error"]


def test_python_m_unbroken_verify_without_transformers(output):
    # transformers and accelerate made unimportable: the command must not need them.
    code = (
        "import runpy, sys; sys.modules['transformers'] = sys.modules['accelerate'] = None; "
        "sys.argv = ['unbroken', 'verify', sys.argv[1], '--json']; "
        "runpy.run_module('unbroken', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(output)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert (report["kind"], report["resume"]["checkpoint"]) == ("hf-run", "checkpoint-40")
