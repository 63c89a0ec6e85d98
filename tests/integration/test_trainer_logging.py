"""What the Trainer logs, and when it reads values on the host: per-batch values every
``log_every`` batches of a phase, epoch values at every phase's end, and no host read in
between (``LossSum`` keeps the running loss where the loss lives)."""

import logging
import random
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode
from trainer_job import SignalAt, run

import unbroken
from unbroken.preemption import EXIT_CODE
from unbroken.train.csvlog import CSVLog
from unbroken.train.progress import LossSum, Progress, TrainerConfig

# ---------------------------------------------------------------------------------- LossSum


def _losses(count: int, seed: int) -> list[torch.Tensor]:
    """float32 scalars over many magnitudes, so that float64 sums round at most steps."""
    rng = random.Random(seed)
    return [
        torch.tensor(rng.uniform(-1, 1) * 10 ** rng.uniform(-6, 6), dtype=torch.float32)
        for _ in range(count)
    ]


def test_the_device_way_sums_to_the_same_bits_as_the_host_way():
    for seed in range(5):
        host, device = LossSum(on_device=False), LossSum(on_device=True)
        expected = 0.0
        for loss in _losses(2000, seed):
            host.add(loss)
            device.add(loss)
            expected += float(loss)  # what the Trainer did before LossSum: a Python float sum
        assert host.value() == device.value() == expected
        assert device._device is not None and device._device.dtype == torch.float64
        assert host._device is None


def test_a_loss_that_requires_grad_is_added_without_joining_the_graph():
    weight = torch.ones((), requires_grad=True)
    device = LossSum(on_device=True)
    device.add(weight * 2)
    device.add((weight * 3).reshape(1))  # a one-element loss of another shape
    assert device.value() == 5.0
    assert device._device is not None and not device._device.requires_grad


@pytest.mark.parametrize("first, second", [(True, False), (False, True), (True, True)])
def test_a_resumed_sum_continues_bit_for_bit_whichever_way_each_run_adds(first, second):
    """A checkpoint's float, loaded into either way, continues the sum of the uninterrupted run."""
    config = TrainerConfig(seed=0, accumulate=1, clip_grad_norm=None, scheduler_interval="step")
    losses = _losses(1000, seed=7)
    uninterrupted = Progress(config)
    for loss in losses:
        uninterrupted.batch_done(loss)

    killed = Progress(config)
    killed.loss = LossSum(on_device=first)
    for loss in losses[:377]:
        killed.batch_done(loss)
    state = killed.state_dict()
    assert isinstance(state["loss_sum"], float)
    resumed = Progress(config)
    resumed.loss = LossSum(on_device=second)
    resumed.load_state_dict(state)
    for loss in losses[377:]:
        resumed.batch_done(loss)
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert resumed.phase_mean() == uninterrupted.phase_mean()


# ------------------------------------------------------------------------------ log_every


def test_per_batch_rows_are_at_multiples_of_log_every_and_epoch_rows_at_every_phase_end(tmp_path):
    every = 3  # trainer_job: 10 training batches (steps 1-30 over 3 epochs), 5 val batches
    run(tmp_path, log_every=every)
    rows = CSVLog.read(tmp_path / "metrics.csv")
    per_batch = {"loss", "mean_logit"}  # what trainer_job's steps return
    for name in per_batch:
        train = [
            (r["epoch"], r["step"]) for r in rows if r["phase"] == "train" and r["name"] == name
        ]
        assert train == [(s // 10 - (s % 10 == 0), s) for s in range(every, 31, every)], name
        val = [(r["epoch"], r["step"]) for r in rows if r["phase"] == "val" and r["name"] == name]
        assert val == [(epoch, 3) for epoch in range(3)], name
    epoch_rows = [(r["phase"], r["step"], r["name"]) for r in rows if r["name"] not in per_batch]
    assert epoch_rows == [
        row
        for epoch in range(3)
        for row in (
            ("train", 10 * (epoch + 1), "epoch_loss"),
            ("train", 10 * (epoch + 1), "accuracy"),
            ("val", 5, "epoch_loss"),
            ("val", 5, "accuracy"),
            ("train", 10 * (epoch + 1), "callback_batches"),  # trainer_job's Counter
        )
    ]


def test_a_resumed_run_logs_the_uninterrupted_runs_rows_with_log_every(tmp_path):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    run(reference, log_every=4)
    # Preempted mid-training (batch 7: after the rows of 4, before those of 8) and mid-validation.
    for signal_at in (SignalAt("train", 7), SignalAt("val", 27)):
        with pytest.raises(SystemExit) as exit:
            run(interrupted, log_every=4, callbacks=[signal_at])
        assert exit.value.code == EXIT_CODE
    run(interrupted, log_every=4)
    assert (interrupted / "metrics.csv").read_bytes() == (reference / "metrics.csv").read_bytes()


def test_callbacks_see_the_latest_logged_values_between_log_batches(tmp_path):
    seen = []

    class Record:
        def on_train_batch_end(self, trainer, logs):
            seen.append((trainer.progress.batches, logs.get("train/loss")))

    run(tmp_path, epochs=1, log_every=4, callbacks=[Record()])
    assert [batch for batch, _ in seen] == list(range(1, 11))
    assert [value for _, value in seen[:3]] == [None] * 3  # nothing logged yet
    assert seen[3][1] == seen[4][1] == seen[5][1] == seen[6][1] is not None
    assert seen[7][1] != seen[3][1]


def test_log_every_must_be_a_positive_int():
    with pytest.raises(ValueError, match="log_every must be a positive int, got 0"):
        unbroken.Trainer("unused", max_epochs=1, log_every=0, signals=())


# ---------------------------------------------------------------------- no host sync per batch

HOST_READS = {"item", "__float__", "__int__", "__bool__", "__index__", "__format__", "tolist"}


class CountHostReads(TorchFunctionMode):
    """Counts the tensor methods that copy a value to the host (a sync on an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _host_reads(directory, batches: int, log_every: int) -> list[str]:
    """The host reads of a fit of 2 epochs of ``batches`` training and validation batches each,
    with the running loss forced onto the device way (as for a loss on a GPU)."""
    torch.manual_seed(0)
    x, y = torch.randn(batches * 2, 4), torch.randn(batches * 2, 1)
    dataset = torch.utils.data.TensorDataset(x, y)
    train = unbroken.DataLoader(dataset, batch_size=2, shuffle=True, seed=0)
    val = unbroken.DataLoader(dataset, batch_size=2, seed=0)
    model = torch.nn.Linear(4, 1)

    def step(model, batch):
        out = model(batch[0])
        return {"loss": torch.nn.functional.mse_loss(out, batch[1]), "mean": out.mean()}

    trainer = unbroken.Trainer(
        directory,
        max_epochs=2,
        log_every=log_every,
        checkpoint_every_seconds=None,
        progress_bar=False,
        tensorboard=False,
        signals=(),
    )
    trainer.progress.loss = LossSum(on_device=True)
    with CountHostReads() as counter:
        trainer.fit(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            train,
            val,
            training_step=step,
            validation_step=step,
        )
    return counter.reads


def test_no_host_read_per_batch_on_the_device_way(tmp_path):
    few = _host_reads(tmp_path / "few", batches=8, log_every=100)
    many = _host_reads(tmp_path / "many", batches=16, log_every=100)
    # Twice the batches, no batch logged: the same reads (phase ends and the final checkpoint).
    assert many == few
    # Logged batches read their two values once each: 2 phases x 2 epochs x (16-8)/4 more.
    logged_few = _host_reads(tmp_path / "logged-few", batches=8, log_every=4)
    logged_many = _host_reads(tmp_path / "logged-many", batches=16, log_every=4)
    assert len(logged_many) - len(logged_few) == 2 * 2 * 2 * (16 - 8) // 4


class _Terminal:
    """stderr as tqdm sees a terminal: it draws its bar instead of turning itself off."""

    def __init__(self):
        self.text = []

    def isatty(self):
        return True

    def write(self, text):
        self.text.append(text)

    def flush(self):
        pass


def test_a_drawn_progress_bar_counts_every_batch_and_changes_nothing(tmp_path, monkeypatch):
    # tqdm turns itself off when stderr is no terminal, and the Trainer then iterates the loader
    # directly; a drawn bar counts the batches in a generator of its own.
    import tqdm

    quiet = run(tmp_path / "quiet", epochs=1, log_every=4)
    terminal, counted = _Terminal(), []
    update = tqdm.tqdm.update
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(tqdm.tqdm, "update", lambda bar, n=1: (counted.append(n), update(bar, n)))
    drawn = run(tmp_path / "drawn", epochs=1, log_every=4, progress_bar=True)
    monkeypatch.undo()
    text = "".join(terminal.text)
    assert "epoch 0 train" in text and "epoch 0 val" in text, text[-500:]
    assert sum(counted) == 10 + 5  # the epoch's training batches, then its validation batches
    for name, tensor in quiet.state_dict().items():
        assert torch.equal(tensor, drawn.state_dict()[name]), name
    quiet_log = (tmp_path / "quiet" / "metrics.csv").read_bytes()
    assert (tmp_path / "drawn" / "metrics.csv").read_bytes() == quiet_log


# --------------------------------------------------------------- what a run says at INFO


def _said(caplog) -> tuple[list[str], list[str]]:
    """The unbroken logger's lines since the last call: at INFO or above, and at DEBUG."""
    records = [r for r in caplog.records if r.name == "unbroken"]
    caplog.clear()
    info = [r.getMessage() for r in records if r.levelno >= logging.INFO]
    return info, [r.getMessage() for r in records if r.levelno == logging.DEBUG]


def test_a_run_says_one_line_as_it_starts_and_one_as_it_ends(tmp_path, caplog):
    # trainer_job: 10 training and 5 validation batches an epoch, 5 optimizer steps (accumulate
    # 2), 3 epochs; the checkpoints are named by batches seen, both phases: step-000000045 last.
    caplog.set_level(logging.DEBUG, logger="unbroken")
    checkpoints = tmp_path / "checkpoints"
    final = f"final checkpoint {checkpoints / 'step-000000045'}"
    run(tmp_path)
    info, debug = _said(caplog)
    assert info == [
        f"no checkpoint in {checkpoints}: starting fresh",
        f"finished: 3 epochs, 15 optimizer steps; {final}",
    ]
    assert (checkpoints / "step-000000045" / "manifest.json").is_file()
    # The details, for a user who asks for them (logging.DEBUG).
    assert any(x.startswith("started fresh, first step after ") for x in debug), debug
    assert "checkpoint interval 2.0 s (auto: the first save measures its cost)" in debug, debug

    run(tmp_path)  # the same command again: nothing to train
    info, debug = _said(caplog)
    assert info == [
        f"already complete: 3 epochs, 15 optimizer steps; {final}; nothing to train (raise "
        "max_epochs or max_steps to train on, or train in a new directory)"
    ]
    assert not any("first step after" in x for x in debug), debug  # no step was taken

    run(tmp_path, epochs=4)  # more epochs: it resumes, and ends anew
    info, _ = _said(caplog)
    assert info[0] == (
        f"resumed from checkpoint {checkpoints / 'step-000000045'} (epoch 3, train batch 0, "
        "optimizer step 15)"
    )
    assert info[1].startswith("resumed, first step after "), info  # what the restart cost
    assert info[2:] == [
        f"finished: 4 epochs, 20 optimizer steps; final checkpoint {checkpoints / 'step-000000060'}"
    ]


def test_a_preempted_then_resumed_run_says_where_and_how_it_ends(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="unbroken")
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[SignalAt("train", 7)])
    info, _ = _said(caplog)
    assert info[0] == f"no checkpoint in {checkpoints}: starting fresh"
    assert re.fullmatch(
        r"SIGTERM received; checkpoint at epoch 0, train batch 7, optimizer step 3 committed "
        rf"\d+\.\d+ s after the signal; exiting with {EXIT_CODE} to be requeued",
        info[1],
    ), info
    assert len(info) == 2, info
    run(tmp_path, max_steps=12)  # stops inside epoch 2, which validates and ends
    info, _ = _said(caplog)
    assert info[0] == (
        f"resumed from checkpoint {checkpoints / 'step-000000007'} (epoch 0, train batch 7, "
        "optimizer step 3)"
    )
    assert info[1].startswith("resumed, first step after "), info
    assert info[2:] == [
        "finished: 3 epochs, 12 optimizer steps (max_steps=12 reached); final checkpoint "
        f"{checkpoints / 'step-000000039'}"
    ]
    assert (checkpoints / "step-000000039" / "manifest.json").is_file()
    run(tmp_path, max_steps=12)
    info, _ = _said(caplog)
    assert info == [
        "already complete: 3 epochs, 12 optimizer steps (max_steps=12 reached); final "
        f"checkpoint {checkpoints / 'step-000000039'}; nothing to train (raise max_epochs or "
        "max_steps to train on, or train in a new directory)"
    ]


def test_a_run_whose_last_batch_was_saved_saves_its_end_and_a_rerun_finds_it_complete(
    tmp_path, caplog
):
    # A periodic save after the last batch (here every 4th step of 4) is at the tick the end is
    # at; the end itself (the epoch's loss logged, the next epoch) comes later, and is saved.
    caplog.set_level(logging.INFO, logger="unbroken")
    dataset = torch.utils.data.TensorDataset(torch.arange(16.0).reshape(8, 2))

    def fit(log: list) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        trainer = unbroken.Trainer(
            tmp_path,
            max_epochs=1,
            checkpoint_every_steps=4,
            checkpoint_every_seconds=None,
            callbacks=[Calls(log)],
            progress_bar=False,
            tensorboard=False,
            signals=(),
        )
        trainer.fit(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            unbroken.DataLoader(dataset, batch_size=2, seed=0),
            training_step=lambda model, batch: model(batch[0]).mean(),
        )
        return model.weight.detach().clone()

    class Calls:
        def __init__(self, log: list) -> None:
            self.log = log

        def on_epoch_end(self, trainer, logs) -> None:
            self.log.append("on_epoch_end")

    first: list = []
    weight = fit(first)
    final = tmp_path / "checkpoints" / "step-000000004"
    assert _said(caplog)[0][-1] == f"finished: 1 epoch, 4 optimizer steps; final checkpoint {final}"
    rerun: list = []
    assert torch.equal(fit(rerun), weight)
    assert _said(caplog)[0] == [
        f"already complete: 1 epoch, 4 optimizer steps; final checkpoint {final}; nothing to "
        "train (raise max_epochs or max_steps to train on, or train in a new directory)"
    ]
    assert first == ["on_epoch_end"] and rerun == []  # the epoch ended once
