"""The Trainer's refusals have types: ``StateMismatch`` for a checkpoint saved under other
settings, ``CorruptState`` for a saved state no run could have produced; both still ValueErrors."""

import os
import signal

import pytest
import torch
from conftest import tmpfs
from torch import nn

import unbroken
from unbroken.errors import CorruptState, StateMismatch
from unbroken.train.checkpointing import MetricState
from unbroken.train.csvlog import CSVLog
from unbroken.train.globalrng import GlobalRNG
from unbroken.train.progress import Progress, TrainerConfig

CONFIG = TrainerConfig(seed=0, accumulate=2, clip_grad_norm=0.5, scheduler_interval="step")


def _saved(**changes) -> dict:
    """A Progress state as a run with CONFIG saves it after a few batches, with `changes`."""
    progress = Progress(CONFIG)
    for loss in (1.0, 2.0, 3.0):
        progress.batch_done(torch.tensor(loss))
    return {**progress.state_dict(), **changes}


def _caused_by(error: BaseException, kind: type) -> BaseException:
    """`error` or the first of its causes that is a `kind` (the checkpoint's restore may name
    the entry in an error of its own and chain the entry's refusal)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__
    raise AssertionError(f"no {kind.__name__} in the chain of {error!r}")


# ------------------------------------------------------------------------------- Progress


@pytest.mark.parametrize(
    "field, other",
    [("seed", 1), ("accumulate", 3), ("clip_grad_norm", None), ("scheduler_interval", "epoch")],
)
def test_another_configuration_is_a_state_mismatch_naming_the_setting(field, other):
    progress = Progress({**CONFIG, field: other})
    with pytest.raises(StateMismatch) as error:
        progress.load_state_dict(_saved())
    assert isinstance(error.value, ValueError)
    assert (error.value.field, error.value.saved, error.value.current) == (
        field,
        CONFIG[field],
        other,
    )
    assert f"{field}={CONFIG[field]!r}, but this Trainer has {field}={other!r}" in str(error.value)
    assert progress.batches == 0  # refused before anything changed


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"epoch": -1}, "epoch"),
        ({"ticks": "3"}, "ticks"),
        ({"micro": True}, "micro"),
        ({"phase": "test"}, "phase"),
        ({"loss_sum": "6.0"}, "loss_sum"),
        ({"config": None}, "config"),
    ],
)
def test_a_malformed_progress_state_is_corrupt_state(changes, field):
    progress = Progress(CONFIG)
    with pytest.raises(CorruptState, match=field) as error:
        progress.load_state_dict(_saved(**changes))
    assert isinstance(error.value, ValueError) and error.value.field == field
    assert progress.batches == 0


def test_a_progress_state_missing_a_counter_is_corrupt_state():
    state = _saved()
    del state["steps"]
    with pytest.raises(CorruptState, match=r"missing \['steps'\]") as error:
        Progress(CONFIG).load_state_dict(state)
    assert error.value.field == "steps"
    with pytest.raises(CorruptState, match="expected a dict"):
        Progress(CONFIG).load_state_dict([1, 2])


def test_a_good_progress_state_round_trips():
    progress = Progress(CONFIG)
    progress.load_state_dict(_saved())
    assert progress.state_dict() == _saved() and progress.saved_at == 3


# ------------------------------------------------------- the Trainer's other own entries


def test_a_malformed_metric_state_is_corrupt_state():
    from torchmetrics.aggregation import MeanMetric

    entry = MetricState(MeanMetric())
    good = entry.state_dict()
    for bad in ({"states": good["states"]}, {**good, "updates": -1}, {"updates": 1}, None):
        with pytest.raises(CorruptState):
            MetricState(MeanMetric()).load_state_dict(bad)
    MetricState(MeanMetric()).load_state_dict(good)


def test_a_malformed_or_truncated_log_state_is_corrupt_state(tmp_path):
    log = CSVLog(tmp_path / "m.csv")
    log.log(1, 0, "train", "loss", 1.0)
    state = log.state_dict()
    log.close()
    with pytest.raises(CorruptState, match="expected") as error:
        CSVLog(tmp_path / "m.csv").load_state_dict({"bytes": "x"})
    assert error.value.field == "bytes"
    (tmp_path / "m.csv").write_text("step,epoch,phase,name,value\n")
    with pytest.raises(CorruptState, match="was truncated or replaced"):
        CSVLog(tmp_path / "m.csv").load_state_dict(state)


def test_rng_states_malformed_or_for_other_devices(monkeypatch):
    with pytest.raises(CorruptState, match="expected the keys"):
        GlobalRNG().load_state_dict({"torch": torch.get_rng_state()})
    state = GlobalRNG().state_dict()
    state["cuda"] = [torch.zeros(8, dtype=torch.uint8)] * (torch.cuda.device_count() + 1)
    with pytest.raises(StateMismatch, match="resume on the same devices") as error:
        GlobalRNG().load_state_dict(state)
    assert error.value.field == "CUDA devices" and isinstance(error.value, ValueError)


# ------------------------------------------------------------------------- through fit()


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        return torch.full((2,), float(index)), torch.tensor(float(index % 2))


class _SignalInValidation:
    def on_validation_batch_end(self, trainer, logs) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def _fit(directory, *, seed=0, val=True, callbacks=()):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    loader = unbroken.DataLoader(_Data(), batch_size=4, shuffle=True, seed=0)
    val_loader = unbroken.DataLoader(_Data(), batch_size=4, seed=0) if val else None

    def step(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x).squeeze(1), y)

    trainer = unbroken.Trainer(
        directory,
        max_epochs=1,
        seed=seed,
        progress_bar=False,
        tensorboard=False,
        callbacks=callbacks,
    )
    trainer.fit(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        val_loader,
        training_step=step,
        validation_step=step,
    )


def test_fit_refuses_a_checkpoint_of_another_seed_with_a_state_mismatch(tmp_path):
    with pytest.raises(SystemExit):
        _fit(tmp_path, callbacks=[_SignalInValidation()])
    with pytest.raises(ValueError, match=r"seed=0, but this Trainer has seed=1") as error:
        _fit(tmp_path, seed=1)
    mismatch = _caused_by(error.value, StateMismatch)
    assert (mismatch.field, mismatch.saved, mismatch.current) == ("seed", 0, 1)


def test_fit_refuses_to_finish_a_validation_phase_without_a_val_loader(tmp_path):
    with pytest.raises(SystemExit):
        _fit(tmp_path, callbacks=[_SignalInValidation()])
    log = (tmp_path / "metrics.csv").read_text()
    with pytest.raises(StateMismatch, match="pass the same val_loader") as error:
        _fit(tmp_path, val=False)
    assert error.value.field == "val_loader" and isinstance(error.value, ValueError)
    assert (tmp_path / "metrics.csv").read_text() == log  # nothing was trained or logged
    _fit(tmp_path)  # with it, the run finishes


@pytest.fixture
def read_only_disk(tmp_path):
    """A tmpfs holding a run directory, then remounted read-only (root: mode bits do not stop
    it, a read-only file system does)."""
    import subprocess

    with tmpfs(tmp_path / "disk") as mountpoint:
        (mountpoint / "run").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mountpoint)], check=True)
        yield mountpoint


@pytest.mark.parametrize("exists", [True, False])
def test_a_read_only_run_directory_says_what_the_trainer_needs(read_only_disk, exists):
    import errno

    directory = read_only_disk / ("run" if exists else "new")
    model = nn.Linear(2, 1)
    loader = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), seed=0)
    trainer = unbroken.Trainer(directory, max_epochs=1, signals=())
    with pytest.raises(OSError, match="is not writable") as refused:
        trainer.fit(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loader,
            training_step=lambda model, batch: model(batch[0]).sum(),
        )
    assert refused.value.errno == errno.EROFS
    assert str(directory) in str(refused.value) and "unbroken inspect" in str(refused.value)
