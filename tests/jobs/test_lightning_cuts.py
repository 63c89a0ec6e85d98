"""Every cut inside Lightning 2.x, against the uninterrupted run.

``lightning_job.py --sweep saves`` runs the job of ``test_lightning.py`` uninterrupted, saving a
checkpoint at every place Lightning can save one (each training batch's end, each validation's
end, each epoch's end), then resumes a run from each; ``--sweep signals`` sends SIGTERM to the
process group at the end of each training batch of its own run, lets ``ExactResume`` save
``last.ckpt`` and exit 75, and resumes from it. A resumed run is exact when the uninterrupted
run's records up to the checkpoint followed by its own (every training batch's samples, input,
loss, learning rate and Lightning's epoch counters, every validation batch, every epoch's start
and end) are the
uninterrupted run's, and its final weights, optimizer and scheduler equal the uninterrupted
run's bit for bit.

The rule every sweep checks: a resumed run is exact, or ``ExactResume`` said when it loaded the
checkpoint that it cannot be (where Lightning itself does not go on exactly: ``loops.Place``);
and a checkpoint saved where ``Place`` says Lightning goes on exactly is resumed exactly. Each
sweep then checks the cuts issue 21 named: a checkpoint at an epoch's last batch (a periodic one
dividing the epoch, or a preemption in that step), Lightning's default per-epoch checkpoint
without validation, a SIGTERM inside an accumulation window, ``estimated_stepping_batches`` in
``configure_optimizers``, ``ReduceLROnPlateau`` on a metric that never improves, an augmented
validation set, a training set without ``len()`` (Lightning prefetches), 2 workers; and those of
issue 31: ``ReduceLROnPlateau`` under ``max_steps`` (with and without validation), two and three
resumes in a row (``--resumes``: each resumed run saves everywhere and is resumed in turn from
the first checkpoint of each kind of place it saved; a resume is compared with the run it
resumed from), a training step drawing from numpy and ``random``, and a resume with 0 workers
of a run saved with 2. This module runs the first checkpoint of each kind of place for the
chains; ``benchmarks/lightning_resume.py`` resumes from every checkpoint.
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
from locations import SUPPORT

from unbroken.lightning.loops import Place

JOB = SUPPORT / "lightning_job.py"
N, BATCH = 96, 8
PER_EPOCH = N // BATCH  # 12 training batches an epoch; validation after the 6th and the 12th
VAL_BATCHES = 32 // BATCH  # of the validation set

# name: the job's options (two epochs, but three for the plain job). The periodic checkpoint
# (every 7 steps) would land where Lightning does not go on exactly first at step 42 (before a
# validation; at an epoch's last batch at step 84), past the end of these runs.
MAX_STEPS = ("--max-steps", "30", "--epochs", "4")
KINDS = ("--sweep", "saves", "--first", "kinds")  # the first checkpoint of each kind of place
CHAINS = (*KINDS, "--resumes", "3")
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
    # Bounded by max_steps (30 of 2.5 epochs; max_epochs 4 ends the run if epochs go empty).
    "plateau-max-steps-saves": ("--sweep", "saves", "--scheduler", "plateau", *MAX_STEPS),
    "plateau-max-steps-no-val-saves": (
        *("--sweep", "saves", "--scheduler", "plateau", "--no-val", "--checkpoint", "epoch"),
        *MAX_STEPS,
    ),
    # Three resumes in a row, the training step drawing from numpy and random.
    "chains": (*CHAINS, "--scheduler", "plateau", "--draw"),
    "max-steps-chains": (*CHAINS, "--max-steps", "20", "--epochs", "4", "--no-val"),
    # Saved with 2 workers, resumed with 0: exact unless the step draws from numpy or random.
    "workers-2-to-0": (*KINDS, "--workers", "2", "--resume-workers", "0"),
    "workers-2-to-0-draw": (*KINDS, "--workers", "2", "--resume-workers", "0", "--draw"),
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
    name: str  # its cuts, joined by "+": "013-batch+017-batch" resumed from the run "013-batch"
    exact: bool  # against the run it resumed from (the uninterrupted run for the first resume)
    saved_at: dict  # ExactResume's Place where the checkpoint was saved ({} if none was)
    global_step: int
    warnings: list[str]  # ExactResume's, as the checkpoint loaded and the run went on
    records: list[dict]  # the resumed run's own
    finished: bool = False  # signalled where the run ends: it finished (exit 0), saving nothing

    @property
    def place_exact(self) -> bool:
        return Place(**self.saved_at).exact if self.saved_at else True

    @property
    def warned(self) -> bool:
        return any(RESUME_WARNING in w for w in self.warnings)

    @property
    def depth(self) -> int:
        return self.name.count("+") + 1


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
    check_uninterrupted(whole, iterable="--iterable" in SWEEPS[name])
    resumed = []
    for run in sorted((out / "runs").iterdir()):
        about = json.loads((run / "about.json").read_text())
        parent = out / "whole"  # the run it resumed from, whole
        if about["parent"] != "whole":
            parent = out / "runs" / about["parent"] / "resumed"
        reference, final = records(parent), torch.load(parent / "final.pt", weights_only=False)
        before, own = about["records_before"], records(run / "resumed")
        exact = reference[:before] + own == reference and same(
            final, torch.load(run / "resumed" / "final.pt", weights_only=False)
        )
        if (run / "signalled").exists():  # the signalled run did what the whole run did
            exact = exact and records(run / "signalled")[:before] == whole[:before]
        saved_at = about["saved_at"] or {}  # none: the signal came after the last save point
        # ExactResume's warnings but those of saves: the resumed runs' own ModelCheckpoint saves
        # where Lightning does not resume exactly too (last.ckpt at an epoch's end, before the
        # ReduceLROnPlateau step; once inside an accumulation window after a resume).
        ours = [w for w in about["warnings"] if "ExactResume" in w and "is being saved" not in w]
        finished = about.get("finished", False)
        step = about["global_step"]
        resumed.append(Resumed(run.name, exact, saved_at, step, ours, own, finished))
    assert resumed
    return whole, resumed


def check_uninterrupted(whole: list[dict], iterable: bool) -> None:
    """The uninterrupted run against what the README promises, computed without the loader:
    each epoch reads the whole training set once (shuffled, in another order every epoch; a
    stream in its own order, with other augmentations every epoch; the last epoch of a run
    bounded by max_steps the start of one), and validation draws its augmentation from the
    training epoch alone (the same for every validation of an epoch, another in the next)."""
    train = [r for r in whole if r["kind"] == "train"]
    epochs = sorted({r["epoch"] for r in train})
    orders, inputs = [], []
    for e in epochs:
        batches = [r for r in train if r["epoch"] == e]
        assert [r["batch"] for r in batches] == list(range(len(batches)))
        order = [i for r in batches for i in r["indices"]]
        assert len(set(order)) == len(order)
        if len(batches) < PER_EPOCH:  # max_steps ended the run in this epoch
            assert e == epochs[-1]
            continue
        assert sorted(order) == list(range(N))
        orders.append(tuple(order))
        inputs.append(tuple(r["x"] for r in batches))
    assert len(set(inputs)) == len(orders)  # the augmentation differs between epochs
    if iterable:
        assert set(orders) == {tuple(range(N))}
    else:
        assert len(set(orders)) == len(orders)
    val: dict[int, list[str]] = {}
    for r in whole:
        if r["kind"] == "val":
            val.setdefault(r["epoch"], []).append(r["x"])
    for digests in val.values():  # validations of VAL_BATCHES batches each
        each = {tuple(digests[i : i + VAL_BATCHES]) for i in range(0, len(digests), VAL_BATCHES)}
        assert len(each) == 1, "two validations of one epoch differ"
    assert len({tuple(d[:VAL_BATCHES]) for d in val.values()}) == len(val), "an epoch's again"


def check_the_rule(resumed: list[Resumed], strict: bool = True) -> None:
    """Exact, or said to be inexact as the checkpoint loaded; exact and not warned where Place
    says so. ``strict``: and inexact where Place says so (where the job's records can show what
    a resume there loses)."""
    for r in resumed:
        assert r.exact or r.warned, f"{r.name}: a silent wrong result ({r.saved_at})"
        if r.place_exact or strict:
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
        # In the run's last step, or in the step before (acted on after the last): the run ends
        # there anyway, and finishes (exit 0) instead of saving for a requeue that has nothing
        # left to train.
        assert r.finished == (batch >= 3 * PER_EPOCH - 1), r.name
        if r.finished:
            assert not r.saved_at
            continue
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
        assert r.finished == (batch_of(r) >= 2 * PER_EPOCH - 1), r.name  # the run's end
        if (
            batch_of(r) % PER_EPOCH == 0 and not r.finished
        ):  # a signal in an epoch's last step: saved at its end
            assert r.saved_at["hook"] == "train_epoch_end"


def test_a_signal_inside_an_accumulation_window_waits_for_its_optimizer_step(sweeps):
    # issue 21 C: the gradients of the window's earlier batches are not in a checkpoint.
    _, resumed = outcomes(sweeps, "accumulate-signals")
    for r in resumed:
        assert r.exact and not r.warnings, (r.name, r.warnings)
        # Windows of 3 batches; validation after the 6th and 12th batch of an epoch.
        batch = batch_of(r)
        # Acted on at the last window's step (batch 24, the run's last): the run finishes.
        assert r.finished == (batch > 2 * PER_EPOCH - 3 - 1), r.name
        if r.finished:
            continue
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
        # Signalled in every step (the job counts the batches of a stream too); saved but in
        # the last two steps, where the run ends.
        assert r.finished == (batch_of(r) >= 2 * PER_EPOCH - 1), r.name


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


# Issue 31: ReduceLROnPlateau under max_steps, resumes in a row, the step drawing from numpy.


def test_reduce_lr_on_plateau_under_max_steps_resumes_exactly(sweeps):
    # Bounded by max_steps, a resumed run looped forever on empty epochs with validation, and
    # without it trained an empty epoch and the next epoch's order: ExactResume's plateau step
    # told Lightning's fit loop to stop restarting, and its setter turned that into "restart"
    # for the epoch loop. Every cut, with and without validation (the preemption saves are
    # some of them; benchmarks/lightning_resume.py signals every step too).
    for name in ("plateau-max-steps-saves", "plateau-max-steps-no-val-saves"):
        whole, resumed = outcomes(sweeps, name)
        check_the_rule(resumed, strict=False)
        assert sum(r["kind"] == "train" for r in whole) == 30
        assert {r["epoch"] for r in whole if r["kind"] == "epoch"} == {0, 1, 2}
        final = sweeps[name].result() / "whole" / "final.pt"
        assert torch.load(final, weights_only=False)["scheduler"]["_last_lr"] == [0.1 * 0.1]
        # The cuts before a plateau step resume exactly (so it stepped, once).
        assert sum(r.exact and r.global_step < 24 for r in resumed) >= 20


def test_two_and_three_resumes_in_a_row_resume_exactly(sweeps):
    # Resumed from an epoch's last batch (warned), Lightning went on into the next epoch without
    # counting it as started: every checkpoint the resumed run saved then resumed at that
    # epoch's start (its on_train_epoch_start hooks again, batch_idx from 0, validation on
    # other batches), silently. ExactResume now counts the epoch as started.
    _, resumed = outcomes(sweeps, "chains")
    check_the_rule(resumed)
    assert max(r.depth for r in resumed) == 3 and len(resumed) > 100
    last = {r.name for r in resumed if r.depth == 1 and r.saved_at["last_batch"]}
    after_last = [r for r in resumed if r.depth > 1 and r.name.split("+")[0] in last]
    assert after_last and all(r.exact for r in after_last if r.place_exact)
    assert {r.depth for r in after_last if r.place_exact} == {2, 3}


def test_resumes_in_a_row_under_max_steps_are_exact_or_said_not_to_be(sweeps):
    # Resumed from an epoch's end under max_steps (warned), Lightning's epoch counters are off
    # for the rest of the run, and a checkpoint saved anywhere in it may resume at the epoch's
    # start: ExactResume says so as it saves such a checkpoint and as it loads one.
    _, resumed = outcomes(sweeps, "max-steps-chains")
    check_the_rule(resumed, strict=False)
    off = [r for r in resumed if r.saved_at.get("counters_off")]
    assert off and all(r.warned for r in off)
    assert any(not r.exact for r in off)
    assert all(r.exact for r in resumed if r.place_exact)


def test_a_resume_with_0_workers_of_a_run_saved_with_2(sweeps):
    # The loader's draws are the same for any num_workers: exact, and nothing said.
    _, resumed = outcomes(sweeps, "workers-2-to-0")
    check_the_rule(resumed)
    assert not any("global generator" in w for r in resumed for w in r.warnings)
    # A training step drawing from numpy and random draws other numbers after it (the loader
    # leaves those generators as its batch left them with 0 workers, alone with 2): other
    # weights, silently. ExactResume sees the worker counts cross 0 and the step draw.
    _, resumed = outcomes(sweeps, "workers-2-to-0-draw")
    drew = "the training step draws from numpy's and random's global generator"
    for r in resumed:
        assert not r.exact, r.name
        assert any(drew in w and "train loader 0: 2 -> 0" in w for w in r.warnings), r.warnings
