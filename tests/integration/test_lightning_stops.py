"""A run that has decided to stop ends as the uninterrupted one did, whatever preempts it.

In a tiny Lightning fit in this process (6 batches an epoch, a validation after every second,
3 epochs: 18 steps), each stop source decides at step 10, mid-epoch: ``EarlyStopping`` at the
validation after it (before and after ``ExactResume`` in the callbacks), a ``Timer`` at its
``on_train_batch_end``, the user in its training step and in a callback's ``on_validation_end``.
A SIGTERM lands at each place around that decision: step 10's training step, the validation
after it, its ``on_validation_end`` (a callback after ``ExactResume``). The run must end as the
uninterrupted one (exit 0, its global_step and weights bit for bit), or save and exit 75 and
resume into exactly that. So must a SIGTERM in the run's last step, and a run resumed from a
checkpoint saved after the decision. A ``ModelCheckpoint`` that writes nothing is warned about.
"""

from __future__ import annotations

import datetime
import os
import signal
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer

import unbroken
from unbroken import EXIT_CODE
from unbroken.lightning import ExactResume

STOP_AT = 10  # the step each stop source decides at: epoch 1, batch 4 of 6, validated after
LAST = 18  # the run's last step (3 epochs of 6)


class Tiny(L.LightningModule):
    """``val_loss`` improves until step 8 and no more: ``EarlyStopping(patience=1)`` stops at
    the validation after step 10. ``signal_in``: "training_step" or "validation" sends SIGTERM
    there at step ``signal_at``; ``stop_in_step``: the training step of step 10 sets
    ``trainer.should_stop``."""

    def __init__(self, signal_in="", signal_at=STOP_AT, stop_in_step=False, floor=0.2):
        super().__init__()
        self.floor = floor  # where val_loss stops improving
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2))
        self.head = torch.nn.Linear(8, 1)
        self.signal_in, self.signal_at, self.stop_in_step = signal_in, signal_at, stop_in_step
        g = torch.Generator().manual_seed(3)
        self.data = torch.utils.data.TensorDataset(torch.randn(12, 4, generator=g))

    def train_dataloader(self):
        return unbroken.DataLoader(self.data, batch_size=2, shuffle=True, seed=0)

    def val_dataloader(self):
        return unbroken.DataLoader(self.data, batch_size=12)

    def training_step(self, batch, batch_idx):
        step = self.global_step + 1  # the step this batch makes
        if self.signal_in == "training_step" and step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.stop_in_step and step == STOP_AT:
            self.trainer.should_stop = True
        return self.head(self.net(batch[0])).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        if self.signal_in == "validation" and self.global_step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.log("val_loss", max(self.floor, 1.0 - 0.1 * self.global_step))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SignalAtValidationEnd(L.Callback):
    """SIGTERM in ``on_validation_end`` after step ``at`` (placed after ``ExactResume``)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_validation_end(self, trainer, pl_module):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


class UserStop(L.Callback):
    """The user's own stop: ``trainer.should_stop`` at the validation's end after step 10."""

    def on_validation_end(self, trainer, pl_module):
        if trainer.global_step == STOP_AT:
            trainer.should_stop = True


class StepTimer(Timer):
    """Lightning's ``Timer`` on a clock that reads the optimizer steps as seconds, so that it
    stops the run at step 10 every time (at its ``on_train_batch_end``)."""

    def __init__(self, at: int = STOP_AT) -> None:
        super().__init__(duration=datetime.timedelta(seconds=at), interval="step")
        self.steps = 0

    def on_train_batch_end(self, trainer, *args, **kwargs):
        self.steps = trainer.global_step
        super().on_train_batch_end(trainer, *args, **kwargs)

    def time_elapsed(self, stage=None) -> float:
        return float(self.steps)


def early_stopping() -> EarlyStopping:
    return EarlyStopping(monitor="val_loss", patience=1, min_delta=0.03)


# source: (the callbacks before ExactResume, those after it, the model's stop_in_step)
SOURCES = {
    "early-stopping-after": (lambda: [], lambda: [early_stopping()], False),
    "early-stopping-before": (lambda: [early_stopping()], lambda: [], False),
    "timer": (lambda: [], lambda: [StepTimer()], False),
    "timer-at-9": (lambda: [], lambda: [StepTimer(9)], False),  # no validation was due there
    "user-step": (lambda: [], lambda: [], True),
    "user-callback": (lambda: [UserStop()], lambda: [], False),
    "none": (lambda: [], lambda: [], False),
}


def fit(
    root: Path,
    source: str,
    signal_in: str = "",
    signal_at: int = STOP_AT,
    ckpt_path: str | None = None,
    saver: ModelCheckpoint | None = None,
    once_an_epoch: bool = False,
    **options,
) -> tuple[int | None, L.Trainer, Tiny]:
    """Fit ``Tiny`` with the stop ``source`` and a SIGTERM at ``signal_in`` after step
    ``signal_at``: (exit code: None if ``fit`` returned, the trainer, the model).
    ``once_an_epoch``: validate at each epoch's end only, over 4 epochs, ``val_loss`` improving
    until step 6: an ``EarlyStopping`` then decides at the end of epoch 1 (step 12)."""
    before, after, stop_in_step = SOURCES[source]
    torch.manual_seed(0)  # the weights' initialization, and the generators the run starts with
    in_step = signal_in if signal_in in ("training_step", "validation") else ""
    model = Tiny(in_step, signal_at, stop_in_step, floor=0.4 if once_an_epoch else 0.2)
    callbacks = [*before(), ExactResume(), *after()]
    if signal_in == "on_validation_end":
        callbacks.append(SignalAtValidationEnd(signal_at))
    saving = saver or ModelCheckpoint(root / "ckpt", save_top_k=0, save_last=True)
    trainer = L.Trainer(
        default_root_dir=root,
        max_epochs=4 if once_an_epoch else 3,
        val_check_interval=1.0 if once_an_epoch else 2,
        num_sanity_val_steps=0,
        callbacks=[*callbacks, saving],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **options,
    )
    code = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(model, ckpt_path=ckpt_path)
        except SystemExit as exited:
            code = exited.code
    return code, trainer, model


def ended(trainer: L.Trainer, model: Tiny) -> tuple[int, dict[str, torch.Tensor]]:
    return trainer.global_step, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each source's uninterrupted run: its last step and weights."""
    runs = {}
    for source in SOURCES:
        code, trainer, model = fit(tmp_path_factory.mktemp(source), source)
        assert code is None
        runs[source] = ended(trainer, model)
    return runs


def test_each_source_stops_the_uninterrupted_run_at_step_10(uninterrupted):
    for source, (step, _) in uninterrupted.items():
        assert step == {"none": LAST, "timer-at-9": 9}.get(source, STOP_AT), source


def end_of_preempted_run(
    tmp_path: Path, source: str, signal_in: str, signal_at: int, once_an_epoch: bool = False
):
    """(its exit code, its last step and weights; after a resume if it exited 75)."""
    code, trainer, model = fit(tmp_path, source, signal_in, signal_at, once_an_epoch=once_an_epoch)
    if code == EXIT_CODE:  # saved on preemption: resume it, as the scheduler would
        last = tmp_path / "ckpt" / "last.ckpt"
        resumed, trainer, model = fit(
            tmp_path / "resumed", source, ckpt_path=str(last), once_an_epoch=once_an_epoch
        )
        assert resumed is None
    return code, ended(trainer, model)


def assert_same_end(got, expected, what: str) -> None:
    (step, weights), (expected_step, expected_weights) = got, expected
    assert step == expected_step, f"{what}: ended at step {step}, not {expected_step}"
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights), what


@pytest.mark.parametrize("place", ["training_step", "validation", "on_validation_end"])
@pytest.mark.parametrize("source", [s for s in SOURCES if s not in ("none", "timer-at-9")])
def test_a_sigterm_where_the_run_decides_to_stop_ends_it_as_the_uninterrupted_run(
    tmp_path, uninterrupted, source, place
):
    # The run ends at step 10 anyway: nothing to save, no requeue; it finishes with exit 0.
    code, end = end_of_preempted_run(tmp_path, source, place, STOP_AT)
    assert_same_end(end, uninterrupted[source], f"{source}, SIGTERM in {place}")
    assert code is None, f"{source}, SIGTERM in {place}: exit {code}, though the run had ended"


def test_a_timer_after_exact_resume_stops_the_run_before_its_save(tmp_path, uninterrupted):
    # The Timer stops the run at step 9's on_train_batch_end, where no validation was due:
    # ExactResume, before it in the callbacks, saved there and the resumed run stopped at 10.
    # ExactResume now runs after it, and sees the run end.
    code, end = end_of_preempted_run(tmp_path, "timer-at-9", "training_step", 9)
    assert_same_end(end, uninterrupted["timer-at-9"], "SIGTERM in the Timer's step")
    assert code is None


@pytest.mark.parametrize("place", ["training_step", "validation"])
def test_a_sigterm_in_the_last_step_lets_the_run_finish(tmp_path, uninterrupted, place):
    # The last step (and the validation after it) of a run bounded by max_epochs: it is
    # complete, and a requeue would run it once for nothing.
    code, end = end_of_preempted_run(tmp_path, "none", place, LAST)
    assert_same_end(end, uninterrupted["none"], f"SIGTERM in the last step's {place}")
    assert code is None


def test_a_sigterm_in_the_last_step_of_limited_epochs_lets_the_run_finish(tmp_path):
    # limit_train_batches=3: the epoch's last batch is not its loader's; the run still ends.
    code, trainer, model = fit(tmp_path / "whole", "none", limit_train_batches=3)
    assert code is None and trainer.global_step == 9
    reference = ended(trainer, model)
    code, trainer, model = fit(tmp_path, "none", "training_step", 9, limit_train_batches=3)
    assert_same_end(ended(trainer, model), reference, "SIGTERM in the last limited step")
    assert code is None


def test_a_sigterm_before_the_decision_still_saves_and_resumes_into_it(tmp_path, uninterrupted):
    # At step 8 no source has decided: save, exit 75, and the resumed run stops at step 10.
    code, end = end_of_preempted_run(tmp_path, "early-stopping-after", "training_step", 8)
    assert code == EXIT_CODE
    assert_same_end(end, uninterrupted["early-stopping-after"], "SIGTERM at step 8")


@pytest.mark.parametrize("place", ["training_step", "validation", "on_validation_end"])
def test_an_early_stopping_deciding_at_the_epochs_end_is_waited_for(tmp_path, place):
    # Validating once an epoch, EarlyStopping decides at on_train_epoch_end, where Lightning
    # calls it after every other callback. A signal seen there (after ExactResume's check at
    # the validation's end) was saved for before the decision: the run resumed from that epoch
    # end trained on. Now the save waits; the run stops at step 12 and exits 0. A signal seen
    # at the validation's end is saved there, before the decision, and the resumed run makes it.
    code, trainer, model = fit(tmp_path / "whole", "early-stopping-after", once_an_epoch=True)
    assert code is None and trainer.global_step == 2 * 6
    reference = ended(trainer, model)
    code, end = end_of_preempted_run(tmp_path, "early-stopping-after", place, 12, True)
    assert_same_end(end, reference, f"SIGTERM in {place} before the epoch end's decision")
    assert code == (None if place == "on_validation_end" else EXIT_CODE)


@pytest.mark.parametrize("source", ["early-stopping-after", "timer", "user-callback"])
def test_a_checkpoint_saved_after_the_decision_resumes_into_a_stopped_run(
    tmp_path, uninterrupted, source
):
    # ModelCheckpoint saves at the validation's end after the stop was decided; the process is
    # killed before it ends. Lightning does not save trainer.should_stop: the resumed run
    # trained on to step 18. ExactResume keeps it, and the resumed run stops.
    every = ModelCheckpoint(
        tmp_path / "every", "{step}", save_top_k=-1, save_on_train_epoch_end=False
    )
    fit(tmp_path, source, saver=every)
    decided = tmp_path / "every" / f"step={STOP_AT}.ckpt"
    code, trainer, model = fit(tmp_path / "resumed", source, ckpt_path=str(decided))
    assert code is None
    assert_same_end(ended(trainer, model), uninterrupted[source], f"{source}, resumed")
    saved = torch.load(decided, weights_only=False)["callbacks"]["unbroken.ExactResume"]
    assert saved["should_stop"] is True


def test_exact_resume_runs_after_the_stop_deciders(tmp_path):
    first, stop, timer = ExactResume(), early_stopping(), StepTimer()
    mine = L.Callback()
    trainer = L.Trainer(
        default_root_dir=tmp_path, logger=False, callbacks=[mine, first, stop, timer]
    )
    first.setup(trainer, None, "fit")
    kinds = [type(c) for c in trainer.callbacks]
    assert kinds.index(ExactResume) == kinds.index(StepTimer) + 1
    assert kinds.index(L.Callback) < kinds.index(EarlyStopping)  # the others keep their order


@pytest.mark.parametrize(
    "options, warned",
    [
        ({"save_top_k": 0}, True),
        ({"save_top_k": 0, "save_last": False}, True),
        ({"save_top_k": 0, "save_last": True}, False),
        ({"save_on_train_epoch_end": False}, False),  # save_top_k=1: the latest checkpoint
    ],
)
def test_a_model_checkpoint_that_writes_nothing_is_warned_about_at_fit_start(
    tmp_path, options, warned
):
    saver = ModelCheckpoint(tmp_path / "ckpt", **options)
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, callbacks=[saver])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ExactResume().setup(trainer, None, "fit")
    said = [str(w.message) for w in caught if "writes no checkpoint" in str(w.message)]
    assert len(said) == int(warned)
    if warned:
        assert "save_top_k=0 and no save_last" in said[0] and "save_last=True" in said[0]
