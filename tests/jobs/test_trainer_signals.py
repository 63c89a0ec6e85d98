"""What real schedulers do to a training job: signal its whole process group, signal it while it
starts, start it twice, kill it before any explicit checkpoint was asked for."""

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
from locations import SUPPORT
from trainer_job import Crash, CrashAt, SignalAt, kill_seed, run

import unbroken
import unbroken.train.checkpointing
from unbroken import DirectoryInUse
from unbroken.preemption import EXIT_CODE

JOB = SUPPORT / "trainer_job.py"
TEST_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _same(directory: Path, reference: Path) -> None:
    got = torch.load(directory / "final.pt", weights_only=True)
    want = torch.load(reference / "final.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (directory / "metrics.csv").read_text() == (reference / "metrics.csv").read_text()


def _job(directory: Path, config: dict, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(JOB), str(directory), json.dumps(config)],
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _ran(directory: Path) -> int:
    try:
        return int((directory / "status").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


# One loader kind per case; every loader is built before the Trainer exists (as users do).
KINDS = {
    "map": {},
    # Workers started by a fork server (Python 3.14's default) inherit no handler at all.
    "map-forkserver": {"context": "forkserver"},
    "iterable": {"stream": True},
    "combined": {"combined": True},
}


@pytest.mark.parametrize(
    "kind, signum",
    [
        ("map", signal.SIGTERM),
        ("map-forkserver", signal.SIGUSR1),
        ("iterable", signal.SIGTERM),
        ("combined", signal.SIGTERM),
    ],
)
def test_a_signal_to_the_whole_process_group_saves_exits_75_and_finishes_exactly(
    tmp_path, kind, signum
):
    """docker stop, systemd, Kubernetes and SLURM signal every process of the job, workers too."""
    config = {"workers": 2, "epochs": 2, "pace": 0.02, **KINDS[kind]}
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    subprocess.run([sys.executable, str(JOB), str(reference), json.dumps(config)], check=True)
    seed = kill_seed()  # printed: pytest shows it with a failure
    rng = random.Random(seed)
    after = rng.randint(1, 14)  # batches of this process; epoch ends and validation included
    process = _job(interrupted, config, start_new_session=True)  # its own process group
    while process.poll() is None and _ran(interrupted) < after:
        time.sleep(0.001)
    time.sleep(rng.uniform(0, 0.02))  # anywhere inside a batch, not only at its end
    os.killpg(process.pid, signum)
    _, err = process.communicate(timeout=600)
    err += f"\n(signalled after {after} batches; replay with UNBROKEN_KILL_SEED={seed})"
    assert process.returncode == EXIT_CODE, err
    assert f"{signal.Signals(signum).name} received; checkpoint" in err
    assert "killed by signal" not in err and "Traceback" not in err, err
    assert list((interrupted / "checkpoints").glob("step-*")), f"nothing was committed\n{err}"
    subprocess.run([sys.executable, str(JOB), str(interrupted), json.dumps(config)], check=True)
    _same(interrupted, reference)


@pytest.mark.parametrize(
    "when, signum",
    [
        ("the Trainer is built", signal.SIGTERM),  # e.g. while the model is built after it
        ("the checkpoint loads", signal.SIGUSR1),
    ],
)
def test_a_signal_before_training_starts_exits_75_and_changes_nothing(
    tmp_path, capfd, monkeypatch, when, signum
):
    with pytest.raises(SystemExit):  # a run with a checkpoint and a log
        run(tmp_path, callbacks=[SignalAt("train", 6)])
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    log = (tmp_path / "metrics.csv").read_text()
    capfd.readouterr()
    before = {s: signal.getsignal(s) for s in TEST_SIGNALS}
    cls, method = (
        (unbroken.Trainer, "__init__")
        if when == "the Trainer is built"
        else (unbroken.Checkpointer, "load_latest")
    )
    original = getattr(cls, method)

    def then_signal(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(cls, method, then_signal)
    with pytest.raises(SystemExit) as exit:
        run(tmp_path)
    assert exit.value.code == EXIT_CODE
    name = signal.Signals(signum).name
    assert f"{name} received before training started" in capfd.readouterr().err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == checkpoints
    assert (tmp_path / "metrics.csv").read_text() == log
    # On its way out the preempted process ignores the signals (a second one must not kill it).
    assert {s: signal.getsignal(s) for s in TEST_SIGNALS} == dict.fromkeys(before, signal.SIG_IGN)


@pytest.mark.parametrize("outcome", ["finishes", "raises", "preempted", "refuses"])
def test_every_signal_handler_is_put_back_after_fit_unless_preempted(tmp_path, outcome):
    # After a preemption checkpoint the process is on its way out (SystemExit(75)): it ignores
    # the preemption signals until it exits, so that a scheduler's second SIGTERM, or torchrun's
    # to the ranks still exiting, does not turn its 75 into -15.
    previous = {s: (lambda *_: None) for s in TEST_SIGNALS}
    originals = {s: signal.signal(s, handler) for s, handler in previous.items()}
    try:
        callbacks = {
            "finishes": [],
            "raises": [CrashAt(3)],
            "preempted": [SignalAt("train", 3)],
            "refuses": [],
        }[outcome]
        try:
            if outcome == "refuses":  # fit() rejects its arguments before it starts
                unbroken.Trainer(tmp_path, max_epochs=1).fit(torch.nn.Linear(1, 1), None, [1])
            run(tmp_path, epochs=1, callbacks=callbacks)
        except (SystemExit, Crash, TypeError):
            pass
        for s, handler in previous.items():
            expected = signal.SIG_IGN if outcome == "preempted" else handler
            assert signal.getsignal(s) is expected, signal.Signals(s).name
    finally:
        for s, handler in originals.items():
            signal.signal(s, handler)


def test_a_second_process_on_a_run_directory_is_refused_naming_the_first(tmp_path):
    config = {"workers": 0, "epochs": 50, "pace": 0.05}
    first = _job(tmp_path, config)
    while _ran(tmp_path) < 2:
        assert first.poll() is None, first.communicate()[1]
        time.sleep(0.01)
    rows = (tmp_path / "metrics.csv").read_text()
    with pytest.raises(
        DirectoryInUse, match=rf"in use by another training process \(pid {first.pid}\)"
    ):
        run(tmp_path)
    assert (tmp_path / "metrics.csv").read_text().startswith(rows)  # not restarted by us
    first.kill()  # SIGKILL: no chance to clean up, and still no stale lock
    first.communicate()
    assert (tmp_path / ".lock").exists()
    run(tmp_path, epochs=1)  # takes the directory over at once


def test_two_fits_in_one_process_on_one_directory_are_refused(tmp_path):
    class Nested:
        def on_fit_start(self, trainer):
            run(tmp_path, epochs=1)

    with pytest.raises(DirectoryInUse, match="another Trainer.fit in this process"):
        run(tmp_path, epochs=1, callbacks=[Nested()])
    run(tmp_path, epochs=1)  # released when fit() ended


@pytest.mark.parametrize("interval", [600.0, "auto"])
def test_a_crash_loses_at_most_the_wall_clock_interval(tmp_path, monkeypatch, interval):
    """Time-based saves: every 10 minutes, or by default (auto) at the interval chosen from the
    save's cost and the prior of 4 hours between failures: sqrt(2 x <0.2 s x 4 h) < 70 s."""
    assert unbroken.Trainer(tmp_path, max_epochs=1).checkpoint_every_seconds == "auto"
    reference = tmp_path / "reference"
    torch.save(run(reference, checkpoint_every_steps=None).state_dict(), reference / "final.pt")
    clock = _FakeClock(seconds_per_call=70)  # a batch takes 70 s: a save every ~9 batches
    monkeypatch.setattr(unbroken.train.schedule, "_clock", clock)
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        run(
            crashed,
            checkpoint_every_steps=None,
            checkpoint_every_seconds=interval,
            callbacks=[CrashAt(20)],
            keep=100,
        )
    # Training batch 20 is tick 25 (epoch 0 had 5 validation batches): ~9 batches are 600 s;
    # auto saves after every 70-s batch (its first save: after 2 s).
    ticks = sorted(int(p.name.split("-")[1]) for p in (crashed / "checkpoints").glob("step-*"))
    if interval == "auto":
        assert ticks == list(range(1, 25)), ticks
    else:
        assert ticks and 25 - 10 <= ticks[-1] < 25 and len(ticks) <= 3, ticks
    torch.save(run(crashed, checkpoint_every_steps=None).state_dict(), crashed / "final.pt")
    _same(crashed, reference)


def test_checkpoint_every_steps_counts_optimizer_steps(tmp_path):
    run(
        tmp_path,
        accumulate=3,
        checkpoint_every_steps=2,
        epochs=1,
        keep=10,
        checkpoint_every_seconds=None,
    )
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    # 48 samples in batches of 5: 10 batches, optimizer steps after batches 3, 6, 9 (and 10);
    # every 2nd step is batch 6; checkpoints are numbered by batches (training + validation),
    # the last one is the end of training after 5 validation batches.
    assert names == ["step-000000006", "step-000000015"]


def test_the_trainer_says_where_it_starts(tmp_path, capfd):
    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[SignalAt("train", 5)])
    assert f"no checkpoint in {tmp_path / 'checkpoints'}: starting fresh" in capfd.readouterr().err
    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[SignalAt("train", 13)])
    err = capfd.readouterr().err
    assert re.search(
        r"resumed from checkpoint \S+step-000000005 \(epoch 0, train batch 5, "
        r"optimizer step 2\)",
        err,
    ), err


def test_deterministic_turns_on_deterministic_kernels_during_fit_only(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = []

    class Look:
        def on_train_batch_end(self, trainer, logs):
            seen.append(
                (
                    torch.are_deterministic_algorithms_enabled(),
                    torch.backends.cudnn.benchmark,
                    os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                )
            )

    torch.backends.cudnn.benchmark = True
    try:
        run(tmp_path, epochs=1, deterministic=True, callbacks=[Look()])
        assert set(seen) == {(True, False, ":4096:8")}
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark
        seen.clear()
        run(tmp_path / "default", epochs=1, callbacks=[Look()])
        assert {s[:2] for s in seen} == {(False, True)}
    finally:
        torch.backends.cudnn.benchmark = False
    with pytest.raises(ValueError, match="deterministic"):
        unbroken.Trainer(tmp_path, max_epochs=1, deterministic="yes")


def test_a_seed_mismatch_names_the_trainer_not_a_loader(tmp_path):
    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[SignalAt("train", 4)])
    with pytest.raises(ValueError, match=r"seed=0, but this Trainer has seed=1") as error:
        run(tmp_path, seed=1)
    assert "loader" not in str(error.value).split("rejected the entry")[-1]


# ---------------------------------------------------------------------------------- helpers


class _FakeClock:
    def __init__(self, seconds_per_call: float) -> None:
        self.now, self.step = 0.0, seconds_per_call

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_the_trainer_docstring_describes_every_argument():
    import inspect

    parameters = inspect.signature(unbroken.Trainer.__init__).parameters.values()
    names = [
        f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name for p in parameters if p.name != "self"
    ]
    missing = [n for n in names if f"    {n}: " not in unbroken.Trainer.__doc__]  # its Args:
    assert not missing, f"help(unbroken.Trainer) does not describe {missing}"
