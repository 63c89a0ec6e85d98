"""The whole run resumes bit for bit: weights, optimizer, schedule, RNGs, metrics, logs."""

import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from locations import SUPPORT
from trainer_job import Crash, CrashAt, SignalAt, kill_seed, run

import unbroken
from unbroken.checkpoint import Checkpointer
from unbroken.preemption import EXIT_CODE
from unbroken.testing import assert_same
from unbroken.train.csvlog import HEADER

JOB = SUPPORT / "trainer_job.py"


def _same_run(directory: Path, reference: Path) -> None:
    """The finished run's weights and log are the reference's; a run without final.pt failed."""
    for run_directory in (directory, reference):
        assert (run_directory / "final.pt").is_file(), f"{run_directory} has no final.pt"
    got = torch.load(directory / "final.pt", weights_only=True)
    want = torch.load(reference / "final.pt", weights_only=True)
    assert_same(dict(got), dict(want), "final weights")
    assert (directory / "metrics.csv").read_text() == (reference / "metrics.csv").read_text()


def _newest_checkpoint(directory: Path) -> tuple[str, dict]:
    """The newest committed checkpoint's directory name and the loop counters it holds."""
    restored = Checkpointer(directory / "checkpoints").load_latest({"progress": None})
    assert restored is not None, f"no checkpoint was committed in {directory}"
    return Path(restored.path).name, restored.values["progress"]


def _finish(directory: Path, **config) -> torch.nn.Module:
    """Run the job in-process until it completes, resuming after each preemption."""
    for _ in range(10):
        try:
            model = run(directory, **config)
        except SystemExit as exit:
            assert exit.code == EXIT_CODE
            config.pop("callbacks", None)  # the restarted "process" is not told to stop again
            continue
        torch.save(model.state_dict(), directory / "final.pt")
        return model
    raise AssertionError("the job did not finish in 10 attempts")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reference")
    torch.save(run(directory).state_dict(), directory / "final.pt")
    return directory


@pytest.mark.parametrize(
    "phase, batch",
    [
        ("train", 1),  # inside the first accumulation window
        ("train", 5),  # mid-window, mid-epoch
        ("train", 10),  # the epoch's last batch (48 samples in batches of 5)
        ("train", 13),  # after a periodic checkpoint, mid-window in the second epoch
        ("val", 12),  # the second of validation's 5 batches in epoch 0 (10 train + 2)
        ("val", 15),  # validation's last batch
    ],
)
def test_preemption_saves_exits_75_and_resumes_bit_for_bit(
    tmp_path, reference, phase, batch, capfd
):
    signal_at = SignalAt(phase, batch)
    with pytest.raises(SystemExit) as exit:
        run(tmp_path, callbacks=[signal_at])
    assert exit.value.code == EXIT_CODE
    assert re.search(
        r"SIGTERM received; checkpoint .* committed \d+\.\d+ s after the signal",
        capfd.readouterr().err,
    )
    # The checkpoint is the signal's batch, not an earlier periodic one (none of these batches
    # is one: with accumulate=2 and checkpoint_every_steps=2 those are every 4th training batch).
    at_signal = signal_at.progress
    name, saved = _newest_checkpoint(tmp_path)
    assert name == f"step-{at_signal['ticks']:09d}", f"newest is {name}; signal at {at_signal}"
    assert saved == at_signal
    assert saved["phase"] == phase
    assert saved["batches" if phase == "train" else "ticks"] == batch, saved
    _finish(tmp_path)
    _same_run(tmp_path, reference)


def test_an_uninterrupted_rerun_of_a_finished_run_changes_nothing(tmp_path, reference):
    _finish(tmp_path)
    before = (tmp_path / "metrics.csv").read_text()
    _finish(tmp_path)
    assert (tmp_path / "metrics.csv").read_text() == before
    _same_run(tmp_path, reference)


@pytest.mark.parametrize(
    "config",
    [
        {"scheduler_interval": "epoch", "accumulate": 1, "scaler": False},
        {"accumulate": 3, "checkpoint_every_steps": 1, "max_steps": 9},
    ],
)
def test_other_configurations_resume_bit_for_bit(tmp_path, config):
    reference = tmp_path / "reference"
    torch.save(run(reference, **config).state_dict(), reference / "final.pt")
    interrupted = tmp_path / "interrupted"
    with pytest.raises(SystemExit):
        run(interrupted, callbacks=[SignalAt("train", 7)], **config)
    _finish(interrupted, **config)
    _same_run(interrupted, reference)


def test_a_combined_map_and_iterable_loader_resumes_bit_for_bit(tmp_path):
    config = {"combined": True, "workers": 2}
    reference = tmp_path / "reference"
    torch.save(run(reference, **config).state_dict(), reference / "final.pt")
    for batch in (3, 11, 17):  # mid-epoch, start of epoch 1 (after validation), mid epoch 1
        interrupted = tmp_path / f"interrupted-{batch}"
        with pytest.raises(SystemExit):
            run(interrupted, callbacks=[SignalAt("train", batch)], **config)
        _finish(interrupted, **config)
        _same_run(interrupted, reference)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """A run directory with one checkpoint (training batch 4) and a log: copy, do not change."""
    directory = tmp_path_factory.mktemp("preempted")
    with pytest.raises(SystemExit):
        run(directory, callbacks=[SignalAt("train", 4)])
    return directory


@pytest.mark.parametrize(
    "change, match",
    [
        ({"hidden": 32}, r"model.*shape"),
        ({"dataset_length": 40}, r"dataset_length=48.*dataset_length=40"),
    ],
)
def test_a_directory_from_another_configuration_is_a_clear_error(
    tmp_path, preempted, change, match
):
    shutil.copytree(preempted, tmp_path, dirs_exist_ok=True)
    with pytest.raises(ValueError, match=match):
        run(tmp_path, **change)


# The settings the README says are checked on resume, each with a value other than trainer_job's.
CHANGED = {"seed": 1, "accumulate": 3, "clip_grad_norm": 1.0, "scheduler_interval": "epoch"}


def _recorded_settings() -> list[str]:
    """The settings a Trainer records in its checkpoints (no signal handler, nothing on disk)."""
    trainer = unbroken.Trainer("unused", max_epochs=1, signals=())
    return list(trainer.progress.state_dict()["config"])


def test_a_checkpoint_records_every_setting_that_is_checked_on_resume(preempted):
    _, saved = _newest_checkpoint(preempted)
    assert sorted(saved["config"]) == sorted(CHANGED)
    assert saved["config"] == {
        "seed": 0,
        "accumulate": 2,
        "clip_grad_norm": 0.5,
        "scheduler_interval": "step",
    }


@pytest.mark.parametrize("field", sorted(set(CHANGED) | set(_recorded_settings())))
def test_every_recorded_setting_is_checked_on_resume(tmp_path, preempted, field):
    """A changed value is a ValueError naming the field and both values, before any training."""
    if field not in CHANGED:
        pytest.fail(
            f"Trainer records {field!r} in checkpoints: add it and a changed value to "
            'CHANGED (and to the README\'s "Checked on resume")'
        )
    shutil.copytree(preempted, tmp_path, dirs_exist_ok=True)
    _, saved = _newest_checkpoint(tmp_path)
    assert field in saved["config"], f"the checkpoint does not record {field}: {saved['config']}"
    old, new = saved["config"][field], CHANGED[field]
    assert old != new
    log = (tmp_path / "metrics.csv").read_text()
    change = {field: new, "loader_seed": 0}  # the loaders keep their seed: only the Trainer's check
    with pytest.raises(ValueError) as error:
        run(tmp_path, **change)
    message = str(error.value)
    assert f"{field}={old!r}" in message and f"{field}={new!r}" in message, message
    assert message.index(f"{field}={old!r}") < message.index(f"{field}={new!r}"), message
    assert (tmp_path / "metrics.csv").read_text() == log  # nothing was trained or logged


def test_a_fresh_start_empties_the_log_of_a_process_that_never_committed_a_checkpoint(
    tmp_path, reference
):
    with pytest.raises(Crash):
        run(
            tmp_path,
            checkpoint_every_steps=None,
            checkpoint_every_seconds=None,
            callbacks=[CrashAt(7)],
        )
    assert not list((tmp_path / "checkpoints").glob("step-*"))
    log = tmp_path / "metrics.csv"
    with log.open("a") as file:
        file.write("8,0,train,lo")  # and a row cut off by the kill
    assert log.read_text().count("\n") > 7  # rows of the process that died

    at_start = []

    class LogAtStart:
        def on_fit_start(self, trainer):
            at_start.append(log.read_text())

    _finish(tmp_path, callbacks=[LogAtStart()])
    assert at_start == [HEADER]
    _same_run(tmp_path, reference)


@pytest.mark.parametrize(
    "job, count",
    [
        ({}, 20),
        (
            {"combined": True, "epochs": 3},
            6,
        ),  # a CombinedLoader: a map-style and an iterable loader
    ],
)
def test_sigkill_at_random_moments_including_inside_saves(tmp_path, job, count):
    """Kill a real training process with SIGKILL `count` times; the finished run is bit-exact."""
    config = json.dumps(
        {"workers": 2, "epochs": 6, "checkpoint_every_steps": 1, "pace": 0.01, **job}
    )
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    subprocess.run([sys.executable, str(JOB), str(reference), config], check=True)
    seed = kill_seed()  # printed: pytest shows it with a failure
    rng = random.Random(seed)
    status, checkpoints = interrupted / "status", interrupted / "checkpoints"
    kills = inside_saves = 0
    while kills < count:
        status.unlink(missing_ok=True)
        process = subprocess.Popen([sys.executable, str(JOB), str(interrupted), config])
        # Every third kill waits for a checkpoint being written; the others land after a random
        # number of batches of this process (so every kill follows some progress).
        aim_at_save, batches = kills % 3 == 0, rng.randint(1, 6)
        while process.poll() is None:
            ran = int(status.read_text() or 0) if status.exists() else 0
            writing = checkpoints.exists() and any(
                p.name.startswith(".tmp") for p in checkpoints.iterdir()
            )
            if (aim_at_save and writing) or (not aim_at_save and ran >= batches):
                process.send_signal(signal.SIGKILL)
                kills += 1
                inside_saves += writing
                break
            time.sleep(0.0005)
        if process.wait() == 0:
            break  # it finished before the kill it was meant to get
        assert process.returncode == -signal.SIGKILL, (
            process.returncode,
            f"UNBROKEN_KILL_SEED={seed}",
        )
    subprocess.run([sys.executable, str(JOB), str(interrupted), config], check=True)
    assert kills == count, f"the run finished after {kills} kills (UNBROKEN_KILL_SEED={seed})"
    assert inside_saves >= count // 6, (
        f"only {inside_saves} kills landed inside a checkpoint write (UNBROKEN_KILL_SEED={seed})"
    )
    _same_run(interrupted, reference)


def test_the_kill_seed_is_printed_and_replayable(monkeypatch, capsys):
    monkeypatch.delenv("UNBROKEN_KILL_SEED", raising=False)
    chosen = kill_seed()
    assert capsys.readouterr().out.startswith(f"UNBROKEN_KILL_SEED={chosen} ")
    monkeypatch.setenv("UNBROKEN_KILL_SEED", str(chosen))
    assert kill_seed() == chosen
    assert f"UNBROKEN_KILL_SEED={chosen} " in capsys.readouterr().out


def test_tensorboard_curves_of_a_resumed_run_equal_the_uninterrupted_ones(tmp_path, reference):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

    def curve(directory):
        events = accumulator.EventAccumulator(str(directory / "tensorboard"))
        events.Reload()
        return [
            (e.step, e.value)
            for e in events.Scalars("train/loss") + events.Scalars("val/epoch_loss")
        ]

    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[SignalAt("train", 7)])
    with pytest.raises(SystemExit):  # a second interruption, later
        run(tmp_path, callbacks=[SignalAt("train", 17)])
    _finish(tmp_path)
    expected = curve(reference)
    assert len(expected) == 30 + 3 and curve(tmp_path) == expected


def test_a_clean_up_runs_every_step_and_never_replaces_the_error_on_its_way(caplog):
    from unbroken.train.ending import clean_up

    ran = []

    def step(name, fails):
        def run_step():
            ran.append(name)
            if fails:
                raise OSError(f"{name} failed")

        return run_step

    steps = [step("wait", True), step("upload", True), step("close", False)]
    first = ValueError("the resume failed")
    clean_up(steps, first)  # the caller raises `first`: nothing replaces it
    assert ran == ["wait", "upload", "close"]
    said = getattr(first, "__notes__", None) or [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "OSError: wait failed" in said[0] and "upload failed" in said[1]
    ran.clear()
    with pytest.raises(OSError, match="wait failed") as raised:  # without one: the first failure
        clean_up(steps, None)
    assert ran == ["wait", "upload", "close"]
    if sys.version_info >= (3, 11):
        assert raised.value.__notes__ == ["then, cleaning up after it: OSError: upload failed"]
    clean_up([step("close", False)], None)  # nothing failed: nothing raised
