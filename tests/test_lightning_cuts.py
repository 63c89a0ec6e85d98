"""Every cut inside Lightning 2.x, against the uninterrupted run.

``lightning_job.py --sweep saves`` runs the job of ``test_lightning.py`` uninterrupted, saving a
checkpoint at every place Lightning can save one (each training batch's end, each validation's
end, each epoch's end), then resumes a run from each; ``--sweep signals`` sends SIGTERM to the
process group at the end of each training batch of its own run, lets ``ExactResume`` save
``last.ckpt`` and exit 75, and resumes from it. A resumed run is exact when the uninterrupted
run's records up to the checkpoint followed by its own (every training batch's samples, input,
loss and learning rate, every validation batch, every epoch's start and end) are the
uninterrupted run's, and its final weights, optimizer and scheduler equal the uninterrupted
run's bit for bit.

The rule every sweep checks: a resumed run is exact, or ``ExactResume`` said when it loaded the
checkpoint that it cannot be (where Lightning itself does not go on exactly: ``loops.Place``);
and a checkpoint saved where ``Place`` says Lightning goes on exactly is resumed exactly. Each
sweep then checks the cuts issue 21 named: a checkpoint at an epoch's last batch (a periodic one
dividing the epoch, or a preemption in that step), Lightning's default per-epoch checkpoint
without validation, a SIGTERM inside an accumulation window, ``estimated_stepping_batches`` in
``configure_optimizers``, ``ReduceLROnPlateau`` on a metric that never improves, an augmented
validation set, a training set without ``len()`` (Lightning prefetches), 2 workers.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

JOB = Path(__file__).with_name("lightning_job.py")
N, BATCH = 96, 8
PER_EPOCH = N // BATCH  # 12 training batches an epoch; validation after the 6th and the 12th

# name: the job's options (two epochs, but three for the plain job). The periodic checkpoint
# (every 7 steps) never lands where Lightning does not go on exactly, so each sweep's own
# checkpoints are exact.
SWEEPS = {
    "saves": ("--sweep", "saves", "--epochs", "3"),
    "signals": ("--sweep", "signals", "--epochs", "3"),
    "no-val-saves": ("--sweep", "saves", "--no-val", "--checkpoint", "epoch"),
    "no-val-signals": ("--sweep", "signals", "--no-val", "--checkpoint", "epoch"),
    "accumulate-saves": ("--sweep", "saves", "--accumulate", "3"),
    "accumulate-signals": ("--sweep", "signals", "--accumulate", "3"),
    "onecycle-saves": ("--sweep", "saves", "--scheduler", "onecycle"),
    "plateau-saves": ("--sweep", "saves", "--scheduler", "plateau"),
    "plateau-signals": ("--sweep", "signals", "--scheduler", "plateau"),
    "iterable-saves": ("--sweep", "saves", "--iterable"),
    "iterable-signals": ("--sweep", "signals", "--iterable"),
    "epoch-metric-signals": ("--sweep", "signals", "--no-val", "--epoch-metric"),
    "workers-saves": ("--sweep", "saves", "--workers", "2"),
}
RESUME_WARNING = "resuming from a checkpoint saved where Lightning cannot go on exactly"


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Every sweep of this module, two at a time (each is one process)."""

    def run(name: str) -> Path:
        out = tmp_path_factory.mktemp(name)
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [sys.executable, str(JOB), str(out), "--every", "7", "--epochs", "2", *SWEEPS[name]],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            start_new_session=True,  # the SIGTERM to the process group reaches the job only
        )
        assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stderr[-5000:]}"
        return out

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run, name) for name in SWEEPS}
        yield {name: future for name, future in futures.items()}


@dataclass
class Resumed:
    name: str
    exact: bool
    saved_at: dict  # ExactResume's Place where the checkpoint was saved ({} if none was)
    global_step: int
    warnings: list[str]  # ExactResume's, as the checkpoint loaded and the run went on
    records: list[dict]  # the resumed run's own

    @property
    def place_exact(self) -> bool:
        places = ("accumulating", "validates_next", "last_batch", "epoch_end_steps")
        return not any(self.saved_at.get(p) for p in places)

    @property
    def warned(self) -> bool:
        return any(RESUME_WARNING in w for w in self.warnings)


def records(run: Path) -> list[dict]:
    path = run / "records-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def outcomes(sweeps, name: str) -> tuple[list[dict], list[Resumed]]:
    out = sweeps[name].result()
    whole = records(out / "whole")
    final = torch.load(out / "whole" / "final.pt", weights_only=False)
    check_uninterrupted(whole, iterable="--iterable" in SWEEPS[name])
    resumed = []
    for run in sorted((out / "runs").iterdir()):
        about = json.loads((run / "about.json").read_text())
        before, own = about["records_before"], records(run / "resumed")
        exact = whole[:before] + own == whole and same(
            final, torch.load(run / "resumed" / "final.pt", weights_only=False)
        )
        if (run / "signalled").exists():  # the signalled run did what the whole run did
            exact = exact and records(run / "signalled")[:before] == whole[:before]
        saved_at = about["saved_at"] or {}  # none: the signal came after the last save point
        # ExactResume's warnings but those of saves: the resumed runs' own ModelCheckpoint saves
        # where Lightning does not resume exactly too (last.ckpt at an epoch's end, before the
        # ReduceLROnPlateau step; once inside an accumulation window after a resume).
        ours = [w for w in about["warnings"] if "ExactResume" in w and "is being saved" not in w]
        resumed.append(Resumed(run.name, exact, saved_at, about["global_step"], ours, own))
    assert resumed
    return whole, resumed


def check_uninterrupted(whole: list[dict], iterable: bool) -> None:
    """The uninterrupted run against what the README promises, computed without the loader:
    each epoch reads the whole training set once (shuffled, in another order every epoch; a
    stream in its own order, with other augmentations every epoch), and validation draws its
    augmentation from the training epoch alone (the same for both validations of an epoch,
    another in the next)."""
    train = [r for r in whole if r["kind"] == "train"]
    epochs = sorted({r["epoch"] for r in train})
    orders, inputs = [], []
    for e in epochs:
        batches = [r for r in train if r["epoch"] == e]
        assert [r["batch"] for r in batches] == list(range(PER_EPOCH))
        order = [i for r in batches for i in r["indices"]]
        assert sorted(order) == list(range(N))
        orders.append(tuple(order))
        inputs.append(tuple(r["x"] for r in batches))
    assert len(set(inputs)) == len(epochs)  # the augmentation differs between epochs
    if iterable:
        assert set(orders) == {tuple(range(N))}
    else:
        assert len(set(orders)) == len(epochs)
    val = {}
    for r in whole:
        if r["kind"] == "val":
            val.setdefault(r["epoch"], []).append(r["x"])
    for digests in val.values():
        half = len(digests) // 2
        assert digests[:half] == digests[half:], "two validations of one epoch differ"
    assert len({tuple(d) for d in val.values()}) == len(val), "validation repeats an epoch's"


def check_the_rule(resumed: list[Resumed]) -> None:
    """Exact, or said to be inexact as the checkpoint loaded; exact where Place says so."""
    for r in resumed:
        assert r.exact or r.warned, f"{r.name}: a silent wrong result ({r.saved_at})"
        assert r.exact == r.place_exact, f"{r.name}: exact={r.exact}, saved at {r.saved_at}"
        assert r.warned == (not r.place_exact), f"{r.name}: {r.warnings}"


def batch_of(r: Resumed) -> int:
    """The training batch (counted from 1 over the run) at whose end the cut was saved."""
    return int(r.name.split("-")[1]) if r.name.startswith("signal-") else -1


def test_every_checkpoint_lightning_saves_resumes_exactly_or_says_why_not(sweeps):
    whole, resumed = outcomes(sweeps, "saves")
    check_the_rule(resumed)
    inexact = {r.name for r in resumed if not r.exact}
    # At the end of a batch Lightning validates after (the 6th and 12th of each epoch), and
    # only there: Lightning skips that validation when it resumes.
    assert inexact == {"006-batch", "013-batch", "021-batch", "028-batch", "036-batch", "043-batch"}
    for r in resumed:
        if r.saved_at["last_batch"] and r.global_step < 3 * PER_EPOCH:
            # issue 21 A: it trained 0 batches of the next epoch; now all of it, once.
            trained = [(x["epoch"], x["batch"]) for x in r.records if x["kind"] == "train"]
            assert trained[0] == (r.global_step // PER_EPOCH, 0)
            assert len(trained) == len(set(trained)) == 3 * PER_EPOCH - r.global_step


def test_a_preemption_signal_in_any_training_step_resumes_exactly(sweeps):
    _, resumed = outcomes(sweeps, "signals")
    assert len(resumed) == 3 * PER_EPOCH
    for r in resumed:
        assert r.exact and not r.warnings, (r.name, r.warnings)
        batch = batch_of(r)
        # Saved at the end of the next step, except when Lightning validates after it (then at
        # that validation's end) and at an epoch's last batch (its validation's end).
        if batch % PER_EPOCH in (5, 11):
            assert r.saved_at["hook"] == "validation_end" and r.global_step == batch + 1
        elif batch % PER_EPOCH in (0, 6):
            assert r.saved_at["hook"] == "validation_end" and r.global_step == batch
        else:
            assert r.saved_at["hook"] == "train_batch_end" and r.global_step == batch + 1


def test_epoch_end_checkpoints_without_validation(sweeps):
    # Lightning's default ModelCheckpoint without validation saves at each epoch's end, where
    # it does not load the loaders' states (issue 21 B: epoch 1 was trained on epoch 0's order).
    _, resumed = outcomes(sweeps, "no-val-saves")
    check_the_rule(resumed)
    inexact = {r.name for r in resumed if not r.exact}
    assert inexact == {"012-batch", "025-batch"}  # an epoch's last batch: its end is skipped
    assert all(r.exact for r in resumed if r.saved_at["hook"] == "train_epoch_end")
    _, signalled = outcomes(sweeps, "no-val-signals")
    for r in signalled:
        assert r.exact and not r.warnings, (r.name, r.warnings)
        if batch_of(r) % PER_EPOCH == 0:  # a signal in an epoch's last step: saved at its end
            assert r.saved_at["hook"] == "train_epoch_end"


def test_a_signal_inside_an_accumulation_window_waits_for_its_optimizer_step(sweeps):
    # issue 21 C: the gradients of the window's earlier batches are not in a checkpoint.
    _, resumed = outcomes(sweeps, "accumulate-signals")
    for r in resumed:
        assert r.exact and not r.warnings, (r.name, r.warnings)
        # Windows of 3 batches; validation after the 6th and 12th batch of an epoch.
        batch = batch_of(r)
        if batch % 6 == 0:  # a window's end, before a validation: at that validation's end
            assert r.saved_at["hook"] == "validation_end" and r.global_step == batch // 3
            continue
        window_end = (batch // 3 + 1) * 3
        hook = "validation_end" if window_end % 6 == 0 else "train_batch_end"
        assert r.saved_at["hook"] == hook and r.global_step == window_end // 3, r.name
    # Checkpoints other savers take inside a window resume inexactly, and say so.
    _, saved = outcomes(sweeps, "accumulate-saves")
    check_the_rule(saved)
    assert any(r.saved_at["accumulating"] and not r.exact for r in saved)


def test_estimated_stepping_batches_in_configure_optimizers(sweeps):
    # issue 21 D: Lightning builds the loader before it loads the checkpoint, and drops its
    # state (its issue 20550): the epoch restarted from its first batch.
    _, resumed = outcomes(sweeps, "onecycle-saves")
    check_the_rule(resumed)
    assert sum(not r.exact for r in resumed) == 4  # the 4 before a validation, as without it


def test_reduce_lr_on_plateau_steps_at_the_end_of_the_resumed_epoch(sweeps):
    # issue 21 E: Lightning skips ReduceLROnPlateau at the end of the first epoch after a
    # resume. On a validation metric that never improves, every step shows in the learning rate.
    _, resumed = outcomes(sweeps, "plateau-saves")
    check_the_rule(resumed)
    final = torch.load(sweeps["plateau-saves"].result() / "whole" / "final.pt", weights_only=False)
    assert final["scheduler"]["_last_lr"] == [0.1 * 0.1]  # reduced once (patience 0)
    # Saved at an epoch's end, before Lightning's own step: inexact, and said.
    assert not any(r.exact for r in resumed if r.saved_at["hook"] == "train_epoch_end")
    _, signalled = outcomes(sweeps, "plateau-signals")
    assert all(r.exact and not r.warnings for r in signalled)


def test_a_training_set_without_len_is_prefetched_by_lightning(sweeps):
    # Lightning fetches a batch ahead from a loader without len(); the state it saves counted
    # that batch, and a resumed run skipped it.
    _, resumed = outcomes(sweeps, "iterable-saves")
    check_the_rule(resumed)
    _, signalled = outcomes(sweeps, "iterable-signals")
    for r in signalled:
        assert r.exact, r.name
        assert not r.warnings, r.warnings


def test_epoch_level_training_metrics_after_a_mid_epoch_resume_are_said_to_be_partial(sweeps):
    _, resumed = outcomes(sweeps, "epoch-metric-signals")
    for r in resumed:
        assert r.exact, r.name  # weights and records
        partial = [w for w in r.warnings if "cover only the batches since the resume" in w]
        mid_epoch = r.saved_at.get("hook") == "train_batch_end" and r.global_step % PER_EPOCH
        assert bool(partial) == bool(mid_epoch), (r.name, r.saved_at, r.warnings)
        # At an epoch's last batch the save waits past the epoch's end (its metrics are logged
        # after the hooks) to the next epoch's first batch.
        assert r.saved_at.get("hook") != "train_epoch_end"


def test_two_workers(sweeps):
    _, resumed = outcomes(sweeps, "workers-saves")
    check_the_rule(resumed)
    assert sum(not r.exact for r in resumed) == 4
