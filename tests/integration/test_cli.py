"""The ``unbroken`` command: ``inspect`` and ``verify`` over real checkpoints.

The checkpoints are written by the public API (a Trainer preempted by SIGTERM during validation,
a Checkpointer saving a loader mid-epoch), then copied and damaged as a disk or a copy would
(a flipped byte, a truncated file, a lost manifest). What the command says a resume would do is
checked against what ``Checkpointer.load_latest`` does.
"""

import hashlib
import io
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from conftest import reseal
from torch import nn

import unbroken
from unbroken import cli
from unbroken._units import human
from unbroken.checkpoint import Checkpointer
from unbroken.checkpoint.layout import MANIFEST
from unbroken.cli import checkpoints
from unbroken.errors import CorruptState, StateMismatch
from unbroken.preemption import EXIT_CODE

# The Trainer run: 48 samples in batches of 8 (6 training batches an epoch), 16 validation
# samples in batches of 8 (2), a checkpoint every 2 optimizer steps, keep=3. SIGTERM after the
# first validation batch of epoch 1 (tick 6 + 2 + 6 + 1 = 15) saves there and exits.
RUN = {
    "step-000000012": {
        "epoch": 1,
        "phase": "train",
        "batch": 4,
        "sample": 32,
        "optimizer_step": 10,
        "source": "progress",
    },
    "step-000000014": {
        "epoch": 1,
        "phase": "train",
        "batch": 6,
        "sample": 48,
        "optimizer_step": 12,
        "source": "progress",
    },
    "step-000000015": {
        "epoch": 1,
        "phase": "val",
        "batch": 1,
        "sample": 8,
        "optimizer_step": 12,
        "source": "progress",
    },
}


class SigtermAt:
    """Sends SIGTERM to this process after validation batch ``batch`` of epoch ``epoch``."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch

    def on_validation_batch_end(self, trainer, logs) -> None:
        progress = trainer.progress
        if (progress.epoch, progress.val_batches) == (self.epoch, self.batch):
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(directory: Path, max_epochs: int, callbacks=()) -> None:
    generator = torch.Generator().manual_seed(0)
    train = torch.utils.data.TensorDataset(
        torch.randn(48, 4, generator=generator), torch.randint(0, 2, (48,), generator=generator)
    )
    val = torch.utils.data.TensorDataset(
        torch.randn(16, 4, generator=generator), torch.randint(0, 2, (16,), generator=generator)
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    trainer = unbroken.Trainer(
        directory,
        max_epochs=max_epochs,
        checkpoint_every_steps=2,
        checkpoint_every_seconds=None,
        keep=3,
        progress_bar=False,
        tensorboard=False,
        callbacks=callbacks,
    )

    def step(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    trainer.fit(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        unbroken.DataLoader(train, batch_size=8, shuffle=True, seed=0),
        unbroken.DataLoader(val, batch_size=8, seed=0),
        training_step=step,
        validation_step=step,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A Trainer's run directory, preempted during validation: copy it before damaging it."""
    directory = tmp_path_factory.mktemp("run")
    with pytest.raises(SystemExit) as stopped:
        _fit(directory, max_epochs=2, callbacks=[SigtermAt(epoch=1, batch=1)])
    assert stopped.value.code == EXIT_CODE
    assert sorted(p.name for p in (directory / "checkpoints").iterdir()) == sorted(RUN)
    return directory


# The Checkpointer directory: a loader of 40 samples in batches of 4 (10 an epoch), saved after
# these batches (the last one in its second epoch), with its state at each save.
SAVED_AT = (3, 5, 12)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """``(directory, {step: the loader's state when it was saved})``: copy before damaging."""
    directory = tmp_path_factory.mktemp("checkpoints")
    dataset = torch.utils.data.TensorDataset(torch.arange(40.0))
    loader = unbroken.DataLoader(dataset, batch_size=4, shuffle=True, seed=7)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    states = {}
    with Checkpointer(directory, keep=3) as checkpointer:
        batches = 0
        for _ in range(2):
            for _batch in loader:
                batches += 1
                if batches in SAVED_AT:
                    state = {"model": model, "optimizer": optimizer, "loader": loader}
                    checkpointer.save(batches, {**state, "step": batches})
                    states[batches] = loader.state_dict()
    assert [states[s]["epoch"] for s in SAVED_AT] == [0, 0, 1]  # the premise: 12 is in epoch 1
    return directory, states


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(source, target)
    return target


def _run(argv, capsys):
    """``main(argv)``: (exit status, stdout, stderr)."""
    status = cli.main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return status, out, err


def _json(argv, capsys):
    status, out, err = _run([*argv, "--json"], capsys)
    return status, json.loads(out)


def _load_latest(directory: Path):
    """What a real resume restores from ``directory``: ``(Restored or None, warnings)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = Checkpointer(directory).load_latest({"model": nn.Linear(3, 2)})
    return restored, [str(w.message) for w in caught]


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-10])


class _RunsCode:
    """Unpickling this would call open(marker, "w"): code from the file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _resealed(checkpoint: Path, file: str, data: bytes) -> None:
    """``file`` replaced by ``data`` and the manifest resealed over it: its sha256 matches."""
    (checkpoint / file).write_bytes(data)
    reseal(checkpoint, file)


def _reshaped(checkpoint: Path) -> None:
    entries = json.loads((checkpoint / MANIFEST).read_text())["entries"]
    entries["optimizer"]["param_shapes"] = entries["optimizer"]["param_shapes"] * 2
    reseal(checkpoint, entries=entries)


def _pickle_that_runs_code(checkpoint: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"weight": _RunsCode(checkpoint.parent / "code-ran")}, buffer)
    return buffer.getvalue()


NOT_LOADING = r"state\['(model|optimizer)'\]: 00[01]-\w+\.pt does not load with torch\.load"


DAMAGE = {
    "flipped byte": (
        lambda checkpoint: _flip(checkpoint / "000-model.pt"),
        r"000-model\.pt does not match its sha256",
    ),
    "truncated file": (
        lambda checkpoint: _truncate(checkpoint / "001-optimizer.pt"),
        r"001-optimizer\.pt has \d+ bytes, the manifest says \d+",
    ),
    "deleted manifest": (
        lambda checkpoint: (checkpoint / MANIFEST).unlink(),
        r"manifest\.json is missing",
    ),
    # Whole by their sha256, but load_latest skips them: the command must say so too.
    "garbage, resealed": (
        lambda checkpoint: _resealed(checkpoint, "000-model.pt", os.urandom(3000)),
        NOT_LOADING,
    ),
    "truncated zip, resealed": (
        lambda checkpoint: _resealed(
            checkpoint, "001-optimizer.pt", (checkpoint / "001-optimizer.pt").read_bytes()[:700]
        ),
        NOT_LOADING,
    ),
    "a pickle that runs code, resealed": (
        lambda checkpoint: _resealed(
            checkpoint, "000-model.pt", _pickle_that_runs_code(checkpoint)
        ),
        NOT_LOADING,
    ),
    # The file loads, but not as the manifest describes it (an optimizer's parameter groups).
    "param_shapes of another optimizer, resealed": (
        lambda checkpoint: _reshaped(checkpoint),
        r"state\['optimizer'\]: manifest\.json is malformed: .*\['param_shapes'\] lists 2 ",
    ),
}


# --------------------------------------------------------------------------------- inspect


def test_inspect_a_run_directory_gives_every_checkpoint_its_position(run_dir, capsys):
    status, document = _json(["inspect", run_dir], capsys)
    assert status == 0
    assert document["command"] == "inspect" and document["kind"] == "run"
    assert document["checkpoints_directory"] == str((run_dir / "checkpoints").resolve())
    checkpoints = document["checkpoints"]
    assert [c["name"] for c in checkpoints] == sorted(RUN)  # oldest first
    assert [c["step"] for c in checkpoints] == [12, 14, 15]
    for checkpoint in checkpoints:
        path = run_dir / "checkpoints" / checkpoint["name"]
        assert checkpoint["path"] == str(path.resolve())
        assert (checkpoint["verified"], checkpoint["status"], checkpoint["problems"]) == (
            True,
            "ok",
            [],
        )
        assert checkpoint["position"] == RUN[checkpoint["name"]], checkpoint["name"]
        assert checkpoint["bytes"] == sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        assert checkpoint["world_size"] == 1 and "progress" in checkpoint["entries"]
    assert document["newest"] == "step-000000015" and document["ok"] is True
    resume = document["resume"]
    assert (resume["checkpoint"], resume["step"], resume["skipped"]) == ("step-000000015", 15, [])
    assert resume["position"] == RUN["step-000000015"]
    loaders = {loader["name"]: loader for loader in resume["loaders"]}
    assert loaders["train_loader"] == {  # its epoch 1 ended: the next iter() starts epoch 2
        "name": "train_loader",
        "format": "unbroken.DataLoader",
        "version": 3,
        "seed": 0,
        "epoch": 2,
        "batches": 0,
        "samples": 0,
    }
    assert (loaders["val_loader"]["epoch"], loaders["val_loader"]["batches"]) == (1, 1)
    assert resume["summary"] == (
        "resume would load checkpoint step-000000015 and continue the validation of epoch 1 "
        "at batch 1 (sample 8), optimizer step 12"
    )


def test_inspect_prints_an_aligned_table_and_what_a_resume_would_do(run_dir, capsys):
    status, out, _ = _run(["inspect", run_dir], capsys)
    assert status == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("CHECKPOINT"))
    rows = lines[header : header + 4]
    assert rows[0].split() == [
        "CHECKPOINT",
        "STEP",
        "EPOCH",
        "BATCH",
        "SAMPLE",
        "OPT",
        "STEP",
        "WRITTEN",
        "(UTC)",
        "SIZE",
        "VERIFIED",
    ]
    verified = rows[0].index("VERIFIED")
    assert len({len(row[:verified].rstrip()) for row in rows}) == 1  # SIZE: right-aligned
    written = {re.search(r"\d{4}-\d\d-\d\dT", row).start() for row in rows[1:]}
    assert written == {rows[0].index("WRITTEN")}
    assert [row[verified:] for row in rows[1:]] == ["ok", "ok", "ok"]
    cells = [re.split(r"\s{2,}", row) for row in rows[1:]]
    assert cells[0][:6] == ["step-000000012", "12", "1", "4", "32", "10"]
    assert cells[2][:6] == ["step-000000015", "15", "1", "val 1", "8", "12"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", cells[2][6])
    assert re.fullmatch(r"\d+\.\d KiB", cells[2][7])
    assert re.search(r"train_loader\s+unbroken\.DataLoader\s+-\s+0\s+2\s+0\s+0\n", out)
    assert re.search(r"val_loader\s+unbroken\.DataLoader\s+-\s+0\s+1\s+1\s+8\n", out)
    assert lines[-1] == (
        "Resume would load checkpoint step-000000015 and continue the validation of epoch 1 "
        "at batch 1 (sample 8), optimizer step 12."
    )


def test_the_time_written_is_the_manifests_mtime_in_utc(run_dir, tmp_path, monkeypatch, capsys):
    run = _copy(run_dir, tmp_path)
    manifest = run / "checkpoints" / "step-000000014" / MANIFEST
    os.utime(manifest, (1_700_000_000, 1_700_000_000))
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30: a local time would differ
    time.tzset()
    try:
        _, document = _json(["inspect", run], capsys)
    finally:
        monkeypatch.undo()
        time.tzset()
    written = {c["name"]: c["written"] for c in document["checkpoints"]}
    assert written["step-000000014"] == "2023-11-14T22:13:20Z"
    other = (run / "checkpoints" / "step-000000015" / MANIFEST).stat().st_mtime
    expected = datetime.fromtimestamp(other, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert written["step-000000015"] == expected


def test_a_finished_run_would_start_the_epoch_after_its_last(run_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path)
    _fit(run, max_epochs=2)  # resumes from step 15, finishes, saves at the end (tick 16)
    _, document = _json(["inspect", run], capsys)
    assert document["resume"]["position"] == {
        "epoch": 2,
        "phase": "train",
        "batch": 0,
        "sample": 0,
        "optimizer_step": 12,
        "source": "progress",
    }
    assert document["resume"]["summary"] == (
        "resume would load checkpoint step-000000016 and start epoch 2 at its first batch, "
        "optimizer step 12 (where the run ended: only a larger max_epochs or max_steps trains on)"
    )


def test_inspect_a_checkpointer_directory_gives_the_loaders_cursors(saves, capsys):
    directory, states = saves
    status, document = _json(["inspect", directory], capsys)
    assert status == 0 and document["kind"] == "checkpoints"
    assert [c["step"] for c in document["checkpoints"]] == list(SAVED_AT)
    for checkpoint in document["checkpoints"]:
        state = states[checkpoint["step"]]
        assert checkpoint["position"] == {
            "epoch": state["epoch"],
            "phase": None,
            "batch": state["batches"],
            "sample": state["samples"],
            "optimizer_step": None,
            "source": "loader",
        }
        (loader,) = checkpoint["loaders"]
        fields = ("format", "version", "seed", "epoch", "batches", "samples")
        assert loader == {"name": "loader", **{field: state[field] for field in fields}}
    assert document["resume"]["summary"] == (
        "resume would load checkpoint step-000000012 and continue epoch 1 at batch 2 (sample 8)"
    )


def test_a_combined_loaders_children_are_listed_under_it(tmp_path, capsys):
    a = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.arange(12.0)), batch_size=4)
    b = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.arange(4.0)), batch_size=2)
    combined = unbroken.CombinedLoader({"a": a, "b": b}, mode="max_size_cycle")
    batches = iter(combined)
    for _ in range(3):  # b (2 batches) cycles into its second epoch
        next(batches)
    Checkpointer(tmp_path).save(3, {"data": {"train": combined.state_dict()}})
    status, document = _json(["inspect", tmp_path], capsys)
    assert status == 0
    (loader,) = document["resume"]["loaders"]
    assert (loader["name"], loader["format"], loader["mode"]) == (
        "data.train",
        "unbroken.CombinedLoader",
        "max_size_cycle",
    )
    assert (loader["epoch"], loader["batches"]) == (0, 3)
    children = {child["name"]: child for child in loader["loaders"]}
    assert sorted(children) == ["data.train[a]", "data.train[b]"]
    assert (children["data.train[a]"]["epoch"], children["data.train[a]"]["batches"]) == (0, 3)
    assert (children["data.train[b]"]["epoch"], children["data.train[b]"]["batches"]) == (1, 1)


def test_a_checkpoint_moved_aside_counts_as_load_latest_counts_it(saves, tmp_path, capsys):
    # A writer killed while replacing step 12 left it as .old-step-...: load_latest reads it.
    directory = _copy(saves[0], tmp_path)
    (directory / "step-000000012").rename(directory / ".old-step-000000012-0a1b2c3d")
    status, document = _json(["verify", directory], capsys)
    assert status == 0
    names = [c["name"] for c in document["checkpoints"]]
    assert names == ["step-000000003", "step-000000005", ".old-step-000000012-0a1b2c3d"]
    assert document["checkpoints"][-1]["step"] == 12
    assert _load_latest(directory)[0].step == document["resume"]["step"] == 12


def test_one_checkpoint_directory_is_inspected_alone(saves, tmp_path, capsys):
    directory, states = saves
    status, document = _json(["inspect", directory / "step-000000005"], capsys)
    assert status == 0 and document["kind"] == "checkpoint"
    assert document["checkpoints_directory"] == str(directory.resolve())
    (checkpoint,) = document["checkpoints"]
    assert (checkpoint["name"], checkpoint["step"], checkpoint["verified"]) == (
        "step-000000005",
        5,
        True,
    )
    assert checkpoint["position"]["batch"] == states[5]["batches"] == 5
    # Copied under another name: the step is the manifest's.
    shutil.copytree(directory / "step-000000005", tmp_path / "best")
    status, out, _ = _run(["verify", tmp_path / "best"], capsys)
    assert status == 0 and re.search(r"^best\s+5\s.*\sok$", out, re.MULTILINE)


def _spy_on_torch_load(monkeypatch) -> list:
    """The ``(file name, weights_only)`` of every ``torch.load`` from now on."""
    calls = []
    real = torch.load

    def spy(file, *args, **kwargs):
        calls.append((Path(getattr(file, "name", file)).name, kwargs.get("weights_only")))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


def test_verify_and_inspect_load_every_file_with_weights_only(saves, monkeypatch, capsys):
    # As load_latest does: a file may match its sha256 and still not load.
    directory, _ = saves
    files = ["000-model.pt", "001-optimizer.pt", "002-loader.pt", "003-step.pt"]
    calls = _spy_on_torch_load(monkeypatch)
    status, document = _json(["verify", directory], capsys)
    assert status == 0 and calls == [(file, True) for _ in SAVED_AT for file in files]
    assert all(c["position"] is None and c["loaders"] == [] for c in document["checkpoints"])
    calls.clear()
    status, _ = _json(["inspect", directory], capsys)
    assert status == 0
    assert calls == [(file, True) for _ in SAVED_AT for file in files]


def test_large_entries_are_not_kept_for_positions_except_the_trainers_own(
    run_dir, monkeypatch, capsys
):
    monkeypatch.setattr(checkpoints, "READ_LIMIT", 0)  # every entry is "large" now
    kept = []
    real = checkpoints.loaders

    def spy(states):
        kept.append(sorted(states))
        return real(states)

    monkeypatch.setattr(checkpoints, "loaders", spy)
    _, document = _json(["inspect", run_dir], capsys)
    assert kept and {tuple(names) for names in kept} == {("progress", "train_loader", "val_loader")}
    assert [c["position"] for c in document["checkpoints"]] == list(RUN.values())


# ---------------------------------------------------------------------------------- verify


def test_verify_passes_when_the_newest_checkpoint_verifies(saves, capsys):
    directory, _ = saves
    status, out, err = _run(["verify", directory], capsys)
    assert (status, err) == (0, "")
    assert out.splitlines()[-1] == "OK: the newest checkpoint, step-000000012, verifies"
    assert "CORRUPT" not in out


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_fails_verify_and_resume_falls_back(
    saves, tmp_path, capsys, damage
):
    directory = _copy(saves[0], tmp_path)
    harm, problem = DAMAGE[damage]
    harm(directory / "step-000000012")
    status, out, _ = _run(["verify", directory], capsys)
    assert status == 1
    rows = {line.split()[0]: re.split(r"\s{2,}", line) for line in out.splitlines() if line}
    assert rows["step-000000012"][1] == "12" and rows["step-000000012"][-1] == "CORRUPT"
    assert rows["step-000000005"][-1] == rows["step-000000003"][-1] == "ok"
    assert re.search(f"step-000000012: {problem}", out)
    assert out.splitlines()[-1].startswith(
        "FAILED: the newest checkpoint, step-000000012, does not verify ("
    )
    assert out.splitlines()[-1].endswith(
        "a resume would skip step-000000012 and fall back to step-000000005 (step 5)"
    )
    status, document = _json(["inspect", directory], capsys)
    assert status == 0  # inspect reports; verify judges
    newest = document["checkpoints"][-1]
    assert (newest["verified"], newest["status"], document["ok"]) == (False, "corrupt", False)
    assert re.search(problem, newest["problems"][0])
    assert [c["verified"] for c in document["checkpoints"][:-1]] == [True, True]
    if damage == "deleted manifest":
        assert (newest["written"], newest["entries"], newest["position"]) == (None, None, None)
    else:  # what still verifies is still read: the loader's file is whole
        assert newest["position"]["batch"] == 2
    resume = document["resume"]
    assert (resume["checkpoint"], resume["skipped"]) == ("step-000000005", ["step-000000012"])
    assert resume["summary"] == (
        "resume would load checkpoint step-000000005 and continue epoch 0 at batch 5 "
        "(sample 20); it would skip step-000000012 (corrupt)"
    )
    restored, said = _load_latest(directory)  # what the command predicts is what happens
    assert Path(restored.path).name == resume["checkpoint"] and restored.step == resume["step"]
    assert any("skipping checkpoint" in line and "step-000000012" in line for line in said)
    assert not (directory / "code-ran").exists()


def test_a_damaged_trainer_checkpoint_falls_back_to_the_training_phase(run_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path)
    _flip(run / "checkpoints" / "step-000000015" / "001-model.pt")
    status, out, _ = _run(["inspect", run], capsys)
    assert status == 0
    assert re.search(r"step-000000015\s+15\s+1\s+val 1\s+8\s+12\s+.*CORRUPT", out)
    assert "loaders in step-000000014:" in out
    assert out.splitlines()[-1] == (
        "Resume would load checkpoint step-000000014 and continue epoch 1 at batch 6 "
        "(sample 48), optimizer step 12; it would skip step-000000015 (corrupt)."
    )
    assert _run(["verify", run], capsys)[0] == 1


def _one_digit_changed(data: bytes) -> bytes:
    at = data.index(b",val,epoch_loss,0.") + len(b",val,epoch_loss,0.")  # a loss's digits
    digit = data[at : at + 1]
    assert digit.isdigit()
    return data[:at] + (b"7" if digit != b"7" else b"8") + data[at + 1 :]


@pytest.mark.parametrize(
    "damage",
    [_one_digit_changed, lambda data: b"x" * len(data)],
    ids=["one digit changed", "replaced by as many x bytes"],
)
def test_a_log_changed_before_its_checkpoint_fails_verify_and_the_resume(
    run_dir, tmp_path, capsys, damage
):
    """``metrics.csv`` is under the checkpoint's seal up to the bytes it records: a change that
    keeps its size fails ``verify`` and the resume, which name the file and both hashes."""
    run = _copy(run_dir, tmp_path)
    log = run / "metrics.csv"
    good = log.read_bytes()
    _, document = _json(["verify", run], capsys)
    assert document["ok"] is True and document["log"]["ok"] is True
    expected = document["log"]["expected"]
    assert expected == len(good)  # the preemption's checkpoint holds the whole log
    saved = hashlib.sha256(good).hexdigest()
    log.write_bytes(damage(good))
    found = hashlib.sha256(damage(good)).hexdigest()
    status, document = _json(["verify", run], capsys)
    assert status == 1 and document["ok"] is False and document["log"]["ok"] is False
    assert document["log"]["sha256"] == saved
    problem = document["log"]["problem"]
    assert problem.startswith(f"{log} changed since checkpoint step-000000015 was taken")
    assert f"first {expected} bytes is {found}, and the checkpoint says " in problem
    assert saved in problem and "Restore the log" in problem
    assert document["resume"]["fails"] == problem
    status, out, _ = _run(["verify", run], capsys)
    assert status == 1 and out.splitlines()[-1] == (
        f"FAILED: the newest checkpoint, step-000000015, verifies, but {problem}"
    )
    with pytest.raises(CorruptState) as raised:
        _fit(run, max_epochs=2)
    assert f"{log} changed since the checkpoint was taken" in str(raised.value)
    assert found in str(raised.value) and saved in str(raised.value)
    assert log.read_bytes() == damage(good)  # nothing cut or appended


def test_when_no_checkpoint_verifies_a_resume_starts_fresh(saves, tmp_path, capsys):
    directory = _copy(saves[0], tmp_path)
    for step in SAVED_AT:
        _flip(directory / f"step-{step:09d}" / "002-loader.pt")
    status, out, _ = _run(["verify", directory], capsys)
    assert status == 1
    assert out.splitlines()[-1].endswith("no checkpoint verifies: a resume would start fresh")
    status, document = _json(["inspect", directory], capsys)
    assert status == 0
    assert [c["position"] for c in document["checkpoints"]] == [None, None, None]
    resume = document["resume"]
    assert (resume["checkpoint"], resume["step"], resume["loaders"]) == (None, None, [])
    assert resume["skipped"] == ["step-000000012", "step-000000005", "step-000000003"]
    assert resume["summary"].endswith("and start fresh")
    assert _load_latest(directory)[0] is None


def test_a_damaged_older_checkpoint_does_not_fail_verify(saves, tmp_path, capsys):
    directory = _copy(saves[0], tmp_path)
    _flip(directory / "step-000000003" / "000-model.pt")
    status, out, _ = _run(["verify", directory], capsys)
    assert status == 0
    assert re.search(r"step-000000003\s.*CORRUPT", out)
    status, document = _json(["verify", directory], capsys)
    assert [c["verified"] for c in document["checkpoints"]] == [False, True, True]
    assert document["ok"] is True and document["resume"]["skipped"] == []


def test_a_manifest_of_another_format_version_fails_rather_than_is_skipped(saves, tmp_path, capsys):
    from unbroken.checkpoint.layout import SEAL, seal_of

    directory = _copy(saves[0], tmp_path)
    path = directory / "step-000000012" / MANIFEST
    manifest = json.loads(path.read_text())
    del manifest[SEAL]
    manifest["version"] = 99
    path.write_text(json.dumps({**manifest, SEAL: seal_of(manifest)}))  # sealed again: whole
    status, out, _ = _run(["verify", directory], capsys)
    assert status == 1
    assert "is of another format version; a resume would fail" in out.splitlines()[-1]
    _, document = _json(["inspect", directory], capsys)
    assert document["checkpoints"][-1]["status"] == "unsupported"
    resume = document["resume"]
    assert resume["checkpoint"] is None and "version 99" in resume["fails"]
    with pytest.raises(StateMismatch, match="version 99"):
        Checkpointer(directory).load_latest({"model": nn.Linear(3, 2)})


# ------------------------------------------------------------------------- usage and entry


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_nothing_to_inspect_is_exit_2_with_a_message(tmp_path, capsys, command):
    (tmp_path / "empty").mkdir()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "file").write_text("")
    (tmp_path / "leftover" / ".tmp-step-000000004-1-ab").mkdir(parents=True)  # not committed
    cases = {
        "missing": "no such directory",
        "empty": "no checkpoints found in",
        "run": "no checkpoints found in the run directory",
        "file": "is not a directory",
        "leftover": "no checkpoints found in",
    }
    for name, message in cases.items():
        status, out, err = _run([command, tmp_path / name], capsys)
        assert (status, out) == (2, ""), name
        assert err.startswith(f"unbroken {command}: error: ") and message in err, (name, err)
        status, out, err = _run([command, tmp_path / name, "--json"], capsys)
        assert status == 2 and message in err
        assert json.loads(out) == {
            "command": command,
            "directory": str(tmp_path / name),
            "error": err.split("error: ", 1)[1].strip(),
        }


def test_usage_errors_are_exit_2(capsys):
    for argv in ([], ["check", "."], ["verify"], ["inspect", ".", "--yaml"]):
        assert cli.main(argv) == 2, argv
        assert "usage: unbroken" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out


def test_human_sizes():
    sizes = (0, 1023, 1024, 1536, 1000 * 1024, 5 * 2**20, 3 * 2**30, 2**50)
    assert [human(n) for n in sizes] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "1000.0 KiB",  # a unit is kept up to 1024 of it
        "5.0 MiB",
        "3.0 GiB",
        "1024.0 TiB",
    ]


def test_the_installed_console_script_exits_1_on_a_corrupt_newest_checkpoint(saves, tmp_path):
    directory = _copy(saves[0], tmp_path)
    _flip(directory / "step-000000012" / "000-model.pt")
    script = Path(sys.executable).parent / "unbroken"
    assert script.is_file(), "reinstall: pip install --no-deps -e ."
    done = subprocess.run(
        [str(script), "verify", str(directory), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 1, done.stderr
    document = json.loads(done.stdout)
    assert (document["newest"], document["ok"]) == ("step-000000012", False)
    assert document["resume"]["checkpoint"] == "step-000000005"


def test_python_dash_m_unbroken_runs_the_command(saves, monkeypatch, capsys):
    directory, _ = saves
    monkeypatch.setattr(sys, "argv", ["unbroken", "verify", str(directory)])
    monkeypatch.delitem(sys.modules, "unbroken.__main__", raising=False)
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("unbroken", run_name="__main__")
    assert stopped.value.code == 0
    assert "OK: the newest checkpoint, step-000000012, verifies" in capsys.readouterr().out
