"""Where ``ExactResume`` takes a place to be exact, in a tiny Lightning fit in this process: a
validation that runs inside a gradient accumulation window is not one (a checkpoint saved there
is warned about, and a preemption save waits for the window's optimizer step); and the state
"before the last batch" that it saves for a loader Lightning prefetched from exists only while
that batch is of the loader's current epoch."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch

import unbroken
from unbroken import EXIT_CODE
from unbroken.lightning import ExactResume

BATCHES, ACCUMULATE, VALIDATE_EVERY = 6, 2, 3  # validation after batch 3: inside a window


class _Tiny(L.LightningModule):
    def __init__(self, preempt_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.preempt_at = preempt_at  # the training batch in which SIGTERM comes

    def training_step(self, batch, batch_idx):
        if batch_idx == self.preempt_at and self.current_epoch == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # only a flag: the save waits for a place
        return self.net(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(batch).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return unbroken.DataLoader(torch.randn(4 * BATCHES, 2), batch_size=4, seed=0)

    def val_dataloader(self):
        return unbroken.DataLoader(torch.randn(4, 2), batch_size=4, seed=0)


def _fit(tmp_path, model: L.LightningModule, **options) -> L.Trainer:
    torch.manual_seed(0)
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATE,
        val_check_interval=VALIDATE_EVERY,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **options,
    )
    trainer.fit(model)
    return trainer


def _saved_at(path) -> dict:
    checkpoint = torch.load(path, weights_only=False)
    return checkpoint["callbacks"]["unbroken.ExactResume"]["saved_at"]


def test_a_validation_inside_an_accumulation_window_is_no_exact_place(tmp_path):
    saving = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "every", save_top_k=-1)
    with pytest.warns(UserWarning, match="cannot resume exactly: the gradients accumulated") as got:
        _fit(tmp_path, _Tiny(), callbacks=[ExactResume(signals=()), saving])
    warned = [w for w in got if "cannot resume exactly" in str(w.message)]
    assert len(warned) == 1  # the validation after batch 3; not the one after batch 6
    places = sorted(
        (_saved_at(p)["hook"], _saved_at(p)["accumulating"]) for p in (tmp_path / "every").iterdir()
    )
    assert places == [("validation_end", False), ("validation_end", True)]


def test_a_preemption_save_waits_for_the_windows_step_after_a_validation(tmp_path):
    """SIGTERM in batch 3: Lightning validates after it, inside the window of batches 3-4; the
    save waits for batch 4's optimizer step."""
    saving = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", save_top_k=0, save_last=False)
    with pytest.raises(SystemExit) as exited:
        _fit(tmp_path, _Tiny(preempt_at=2), callbacks=[ExactResume(), saving])
    assert exited.value.code == EXIT_CODE
    last = tmp_path / "ckpt" / "last.ckpt"
    assert _saved_at(last) == {
        "hook": "train_batch_end",
        "accumulating": False,
        "validates_next": False,
        "last_batch": False,
        "epoch_end_steps": False,
        "by_max_steps": False,
        "counters_off": False,
        "last_step": False,
    }
    assert torch.load(last, weights_only=False)["global_step"] == 2  # batches 1-4: two steps


def test_the_state_before_the_last_batch_is_of_the_current_epoch_only():
    loader = unbroken.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=1)
    iterator = iter(loader)
    next(iterator)
    second = next(iterator)
    before = loader._state_before_last_batch()
    assert before is not None and (before["epoch"], before["batches"]) == (0, 1)
    again = unbroken.DataLoader(list(range(6)), batch_size=2, shuffle=True, seed=1)
    again.load_state_dict(before)
    assert torch.equal(next(iter(again)), second)  # the batch Lightning fetched ahead, again
    next(iterator)
    assert next(iterator, None) is None  # the epoch ended: the loader is at epoch 1's start
    assert loader.state_dict()["epoch"] == 1
    assert loader._state_before_last_batch() is None
    held = iter(loader)
    next(held)
    assert loader._state_before_last_batch()["epoch"] == 1
    loader.set_epoch(5)  # moved on by the user (or Lightning) before a batch of epoch 5
    assert loader._state_before_last_batch() is None
    held = iter(loader)
    next(held)
    loader.load_state_dict(before)  # moved to a saved position: no batch received there yet
    assert loader._state_before_last_batch() is None
