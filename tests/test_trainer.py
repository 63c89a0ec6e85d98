"""The whole run resumes bit for bit: weights, optimizer, schedule, RNGs, metrics, logs."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer_job import SignalAt, run
from unbroken.preemption import EXIT_CODE
from unbroken.testing import assert_same

JOB = Path(__file__).with_name("trainer_job.py")


def _same_run(directory: Path, reference: Path) -> None:
    got = torch.load(directory / "final.pt", weights_only=True) if (directory / "final.pt").exists() else None
    want = torch.load(reference / "final.pt", weights_only=True) if got is not None else None
    if got is not None:
        assert_same(dict(got), dict(want), "final weights")
    assert (directory / "metrics.csv").read_text() == (reference / "metrics.csv").read_text()


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
def test_preemption_saves_exits_75_and_resumes_bit_for_bit(tmp_path, reference, phase, batch, capfd):
    with pytest.raises(SystemExit) as exit:
        run(tmp_path, callbacks=[SignalAt(phase, batch)])
    assert exit.value.code == EXIT_CODE
    assert re.search(r"SIGTERM received; checkpoint .* committed \d+\.\d+ s after the signal",
                     capfd.readouterr().err)
    committed = sorted((tmp_path / "checkpoints").glob("step-*"))
    assert committed, "the preemption checkpoint was not committed"
    _finish(tmp_path)
    _same_run(tmp_path, reference)


def test_an_uninterrupted_rerun_of_a_finished_run_changes_nothing(tmp_path, reference):
    _finish(tmp_path)
    before = (tmp_path / "metrics.csv").read_text()
    _finish(tmp_path)
    assert (tmp_path / "metrics.csv").read_text() == before
    _same_run(tmp_path, reference)


@pytest.mark.parametrize("config", [
    {"scheduler_interval": "epoch", "accumulate": 1, "scaler": False},
    {"accumulate": 3, "checkpoint_every_steps": 1, "max_steps": 9},
])
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


@pytest.mark.parametrize(
    "change, match",
    [
        ({"hidden": 32}, r"model.*shape"),
        ({"dataset_length": 40}, r"dataset_length=48.*dataset_length=40"),
        ({"seed": 1}, r"seed=0.*seed=1"),
        ({"accumulate": 4}, r"accumulate=2.*accumulate=4"),
    ],
)
def test_a_directory_from_another_configuration_is_a_clear_error(tmp_path, change, match):
    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[SignalAt("train", 4)])
    with pytest.raises(ValueError, match=match):
        run(tmp_path, **change)


@pytest.mark.parametrize("job, count", [
    ({}, 20),
    ({"combined": True, "epochs": 3}, 6),  # a CombinedLoader: a map-style and an iterable loader
])
def test_sigkill_at_random_moments_including_inside_saves(tmp_path, job, count):
    """Kill a real training process with SIGKILL `count` times; the finished run is bit-exact."""
    config = json.dumps({"workers": 2, "epochs": 6, "checkpoint_every_steps": 1, "pace": 0.01, **job})
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    subprocess.run([sys.executable, str(JOB), str(reference), config], check=True)
    rng = random.Random(os.environ.get("UNBROKEN_KILL_SEED"))
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
                p.name.startswith(".tmp") for p in checkpoints.iterdir())
            if (aim_at_save and writing) or (not aim_at_save and ran >= batches):
                process.send_signal(signal.SIGKILL)
                kills += 1
                inside_saves += writing
                break
            time.sleep(0.0005)
        if process.wait() == 0:
            break  # it finished before the kill it was meant to get
        assert process.returncode == -signal.SIGKILL, process.returncode
    subprocess.run([sys.executable, str(JOB), str(interrupted), config], check=True)
    assert kills == count, f"the run finished after {kills} kills"
    assert inside_saves >= count // 6, f"only {inside_saves} kills landed inside a checkpoint write"
    _same_run(interrupted, reference)


def test_tensorboard_curves_of_a_resumed_run_equal_the_uninterrupted_ones(tmp_path, reference):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

    def curve(directory):
        events = accumulator.EventAccumulator(str(directory / "tensorboard"))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("train/loss") + events.Scalars("val/epoch_loss")]

    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[SignalAt("train", 7)])
    with pytest.raises(SystemExit):  # a second interruption, later
        run(tmp_path, callbacks=[SignalAt("train", 17)])
    _finish(tmp_path)
    expected = curve(reference)
    assert len(expected) == 30 + 3 and curve(tmp_path) == expected
