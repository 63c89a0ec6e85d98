"""The Trainer's options as one checked value (``TrainerOptions``), and the hooks users of EMA
weights need: an EMA callback on ``on_optimizer_step`` that swaps its weights in for validation
resumes bit for bit, cut in training, at an epoch's last (partial) accumulation window and
inside validation."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import get_type_hints

import pytest
from locations import ROOT
from trainer_job import SignalAt, run

import unbroken
from unbroken.testing import assert_same
from unbroken.train import TrainerOptions
from unbroken.train import options as options_module
from unbroken.train.options import TrainerKeywords

# Each option with a value it refuses, and what its error must say.
REFUSED = {
    "max_epochs": (0, "max_epochs must be a positive int, got 0"),
    "max_steps": (-1, "max_steps must be a positive int, got -1"),
    "seed": (-3, r"seed must be an int in \[0, 2\*\*64\), got -3"),
    "checkpoint_every_seconds": (
        0,
        "checkpoint_every_seconds must be 'auto', a number > 0 or None, got 0",
    ),
    "checkpoint_every_steps": (True, "checkpoint_every_steps must be a positive int, got True"),
    "keep": (1, "keep must be an int >= 2, got 1"),
    "accumulate": (2.0, "accumulate must be a positive int, got 2.0"),
    "clip_grad_norm": (-1.0, r"clip_grad_norm must be a number > 0 .* or None, got -1.0"),
    "scheduler_interval": ("batch", "scheduler_interval must be 'step' or 'epoch', got 'batch'"),
    "callbacks": (5, "callbacks must be an iterable of callback objects, got 5"),
    "progress_bar": ("no", "progress_bar must be True or False, got 'no'"),
    "signals": ((999,), r"signals must be signal numbers .*, got \(999,\)"),
    "async_save": (1, "async_save must be True or False, got 1"),
    "tensorboard": ("yes", "tensorboard must be True, False or None, got 'yes'"),
    "log_every": (0, "log_every must be a positive int, got 0"),
    "deterministic": (2, "deterministic must be True, False or None, got 2"),
    "preemption_check_every": (0, "preemption_check_every must be a positive int, got 0"),
    "checkpoint_timeout": (0, "checkpoint_timeout must be a number of seconds > 0, got 0"),
    "lease_seconds": (-1, "lease_seconds must be a number of seconds > 0, got -1"),
    "remote_timeout": (0, "remote_timeout must be a number of seconds > 0, got 0"),
    "just_in_time": ("on", "just_in_time must be True, False or None, got 'on'"),
    "hang_timeout": (0, "hang_timeout must be a number of seconds > 0, got 0"),
}


def _field_docs() -> dict[str, list[str]]:
    """Each field of ``TrainerOptions`` and the docstrings under it, read from its source."""
    tree = ast.parse(inspect.getsource(options_module))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainerOptions"]
    docs: dict[str, list[str]] = {}
    for statement, after in zip(cls.body, [*cls.body[1:], None]):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            under = after if isinstance(after, ast.Expr) else None
            value = getattr(under, "value", None)
            docs[statement.target.id] = [value.value] if isinstance(value, ast.Constant) else []
    return docs


def test_every_option_has_one_default_one_doc_and_one_check():
    fields = {option.name: option for option in dataclasses.fields(TrainerOptions)}
    assert sorted(fields) == sorted(REFUSED)  # a new option needs a refused value here
    # One doc each, under its field; the class and the Trainer describe none of them.
    docs = _field_docs()
    assert list(docs) == list(fields) and all(len(d) == 1 and d[0] for d in docs.values())
    assert "Args:" not in (TrainerOptions.__doc__ or "")
    arguments = (unbroken.Trainer.__doc__ or "").split("Args:")[1].split("Raises:")[0]
    listed = re.findall(r"^ {8}\**(\w+):", arguments, re.MULTILINE)
    assert listed == ["directory", "options", "storage_options", "keywords"]
    for name, option in fields.items():  # what a resume must match is said where it is flagged
        assert ("Must match on resume." in docs[name][0]) == option.metadata["on_resume"], name
    # One check each: the field's own, which gives the error.
    for name, (value, message) in REFUSED.items():
        with pytest.raises(ValueError, match=message):
            fields[name].metadata["check"](name, value)
    # One default each: the Trainer's signature declares none.
    parameters = inspect.signature(unbroken.Trainer).parameters
    assert not set(parameters) & set(fields)


def test_the_trainer_keywords_are_typed_as_the_options():
    keywords = get_type_hints(TrainerKeywords)
    assert list(keywords) == [option.name for option in dataclasses.fields(TrainerOptions)]
    assert keywords == get_type_hints(TrainerOptions)
    assert not TrainerKeywords.__required_keys__  # options= may stand for all of them


def test_an_unknown_keyword_is_a_type_error_naming_the_closest_option(tmp_path):
    with pytest.raises(TypeError, match=r"'max_epoch' \(did you mean 'max_epochs'\?\)"):
        unbroken.Trainer(tmp_path / "run", max_epoch=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'zzz': the options are TrainerOptions' fields"):
        unbroken.Trainer(tmp_path / "run", max_epochs=1, zzz=1)  # type: ignore[call-arg]
    assert not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # no handler installed


@pytest.mark.slow  # mypy over unbroken and torch: ~15 s with a cold cache
def test_a_type_checker_checks_the_trainer_keywords(tmp_path):
    """mypy sees each keyword's type and refuses an unknown one (``Unpack[TrainerKeywords]``)."""
    pytest.importorskip("mypy")
    script = tmp_path / "uses.py"
    script.write_text(
        "import unbroken\n"
        "unbroken.Trainer('d', max_epochs='x')\n"
        "unbroken.Trainer('d', max_epoch=1)\n"
        "unbroken.Trainer('d', max_epochs=1, callbacks=[object()], signals={15}, keep=3)\n"
    )
    root = ROOT
    found = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", str(script)],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        timeout=600,
    ).stdout
    errors = [line for line in found.splitlines() if ": error:" in line]
    assert len(errors) == 2, found
    assert 'uses.py:2: error: Argument "max_epochs" to "Trainer" has incompatible type' in found
    assert 'uses.py:3: error: Unexpected keyword argument "max_epoch"' in found


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_invalid_option_is_named_in_its_error_before_anything_happens(tmp_path, name):
    value, message = REFUSED[name]
    keywords = {"max_epochs": 1, name: value}
    with pytest.raises(ValueError, match=message):
        unbroken.Trainer(tmp_path / "run", **keywords)
    with pytest.raises(ValueError, match=message):
        TrainerOptions(**keywords)
    assert not (tmp_path / "run").exists()  # nothing locked or created
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # no handler installed


def test_the_options_as_one_value_or_as_keywords(tmp_path):
    options = TrainerOptions(max_epochs=2, accumulate=3, callbacks=[], progress_bar=False)
    assert options.callbacks == () and dataclasses.is_dataclass(options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.accumulate = 4  # type: ignore[misc]
    trainer = unbroken.Trainer(tmp_path, options=options)
    assert trainer.options is options
    trainer.preemption.uninstall()
    with pytest.raises(ValueError, match="Trainer got options= and accumulate="):
        unbroken.Trainer(tmp_path, options=options, accumulate=2)
    keywords = unbroken.Trainer(tmp_path, max_epochs=2, accumulate=3, progress_bar=False)
    keywords.preemption.uninstall()
    assert keywords.options == options


def test_what_a_resume_must_match_is_flagged_on_the_options():
    flagged = TrainerOptions(max_epochs=1, seed=4, clip_grad_norm=0.5).on_resume()
    assert flagged == {
        "seed": 4,
        "accumulate": 1,
        "clip_grad_norm": 0.5,
        "scheduler_interval": "step",
    }


# ------------------------------------------------------------------------------- the hooks


class EMA:
    """Exponential moving average of the float weights, updated after every optimizer step and
    swapped in for validation; its state (the average, the swapped-out weights while swapped,
    the steps seen) is checkpointed, so that a run resumed inside validation does not swap
    twice."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay, self.steps = decay, 0
        self.average: dict | None = None
        self.training_weights: dict | None = None  # while the average is swapped in

    def on_optimizer_step(self, trainer) -> None:
        weights = trainer.model.state_dict()
        if self.average is None:
            self.average = {k: v.detach().clone() for k, v in weights.items()}
        else:
            for key, value in weights.items():
                self.average[key].mul_(self.decay).add_(value.detach(), alpha=1 - self.decay)
        self.steps += 1

    def on_validation_start(self, trainer) -> None:
        if self.training_weights is None and self.average is not None:
            self.training_weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            trainer.model.load_state_dict(self.average)

    def on_validation_end(self, trainer, logs) -> None:
        if self.training_weights is not None:
            trainer.model.load_state_dict(self.training_weights)
            self.training_weights = None

    def state_dict(self) -> dict:
        return {"average": self.average, "weights": self.training_weights, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.average, self.training_weights = state["average"], state["weights"]
        self.steps = state["steps"]


# 48 samples in batches of 5: 10 training batches an epoch, in windows of 3, the last of one
# batch; validation: 5 batches after them (ticks 11-15 in epoch 0).
JOB = {"accumulate": 3, "epochs": 2}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ema")
    ema = EMA()
    model = run(directory, callbacks=[ema], **JOB)
    return directory, ema, model


def test_the_optimizer_step_hook_sees_every_step_the_partial_window_too(uninterrupted):
    _, ema, _ = uninterrupted
    assert ema.steps == 2 * 4  # 3 + 3 + 3 + 1 batches an epoch: 4 steps
    assert ema.training_weights is None  # swapped back after each validation


@pytest.mark.parametrize(
    "phase, batch",
    [("train", 5), ("train", 10), ("val", 12), ("val", 15)],
    ids=["mid-window", "the-partial-window", "inside-validation", "validation's-last"],
)
def test_an_ema_callback_resumes_bit_for_bit(tmp_path, uninterrupted, phase, batch):
    reference, ema_reference, model_reference = uninterrupted
    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[EMA(), SignalAt(phase, batch)], **JOB)
    ema = EMA()
    model = run(tmp_path, callbacks=[ema], **JOB)
    assert_same(model.state_dict(), model_reference.state_dict(), "weights")
    assert_same(ema.average, ema_reference.average, "EMA weights")
    assert ema.steps == ema_reference.steps
    # Validation ran on the EMA weights in both runs: the same validation losses.
    log, expected = (
        [row for row in (d / "metrics.csv").read_text().splitlines() if ",val," in row]
        for d in (Path(tmp_path), reference)
    )
    assert log == expected and any(re.search(r",val,loss,", row) for row in log)
