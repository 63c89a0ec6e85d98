"""The Trainer's options as one frozen value: a field per option, its doc beside it, its check in
one place, and a flag for the fields that must match on resume.

``Trainer("runs/exp1", max_epochs=3, ...)`` builds a ``TrainerOptions`` from its keywords (or
takes one: ``Trainer(directory, options=TrainerOptions(...))``). Every field is checked when the
value is made, before anything is installed, locked or trained; an error names the option, the
value received and what is expected. ``on_resume()`` is what the checkpoint records of them and a
resume compares (``progress.TrainerConfig``, the saved schema): the fields that shape the
computation.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from .._checks import is_int, is_number
from ..preemption import DEFAULT_SIGNALS
from .progress import TrainerConfig

SCHEDULER_INTERVALS = ("step", "epoch")
Check = Callable[[str, Any], None]


def _option(default: Any, doc: str, check: Check, *, on_resume: bool = False) -> Any:
    """A field: its default, what it means, how it is checked, whether a resume must match it."""
    metadata = {"doc": doc, "check": check, "on_resume": on_resume}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


# The checks, each naming the option and what it expects.
def positive(name: str, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _positive_or_none(name: str, value: Any) -> None:
    if value is not None:
        positive(name, value)


def _seconds(name: str, value: Any) -> None:
    if not is_number(value) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


def _interval_seconds(name: str, value: Any) -> None:
    if value != "auto" and value is not None and (not is_number(value) or not value > 0):
        raise ValueError(f"{name} must be 'auto', a number > 0 or None, got {value!r}")


def _norm_or_none(name: str, value: Any) -> None:
    if value is not None and (not is_number(value) or not value > 0):
        raise ValueError(
            f"{name} must be a number > 0 (the largest gradient norm) or None, got {value!r}"
        )


def _seed(name: str, value: Any) -> None:
    if not is_int(value) or not 0 <= value < 1 << 64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")


def _keep(name: str, value: Any) -> None:
    if not is_int(value) or value < 2:
        raise ValueError(
            f"{name} must be an int >= 2, got {value!r}: with a single checkpoint, one that is "
            "corrupted leaves nothing to resume from"
        )


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _flag_or_none(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be True, False or None, got {value!r}")


def _interval(name: str, value: Any) -> None:
    if value not in SCHEDULER_INTERVALS:
        raise ValueError(f"{name} must be 'step' or 'epoch', got {value!r}")


def _callbacks(name: str, value: Any) -> None:
    if not isinstance(value, tuple):
        raise ValueError(f"{name} must be an iterable of callback objects, got {value!r}")


def _signals(name: str, value: Any) -> None:
    valid = set(signal.valid_signals())
    if not isinstance(value, tuple) or not all(is_int(s) and s in valid for s in value):
        raise ValueError(f"{name} must be signal numbers (e.g. signal.SIGTERM), got {value!r}")


@dataclass(frozen=True)
class TrainerOptions:
    """Everything a ``Trainer`` is told, but its directory (``describe()``: each in one line).

    ``accumulate``, ``clip_grad_norm``, ``scheduler_interval`` and ``seed`` shape the
    computation: they are recorded in checkpoints and must match on resume. The others may
    change between a run and its resume. A preemption signal and the end of training always
    save.

    Args:
        max_epochs: Epochs to train.
        max_steps: Stop after this many optimizer steps.
        seed: Seeds the process RNGs of a fresh run. Model init happens before ``fit``, so seed
            that yourself.
        checkpoint_every_seconds: Save when this much wall-clock time passed since the last
            save, at the next batch boundary; ``None`` turns it off. ``"auto"`` (default): the
            interval that wastes the least time, from the measured cost of this run's saves and
            the failures its run directory has seen (Young/Daly; ``train.schedule``). A fresh
            run saves after its first 2 s to measure, then about every
            ``sqrt(2 x cost x 4 hours)`` until a failure is seen, bounded to [2 s, 30 min]. The
            choice is printed when first made and when it changes.
        checkpoint_every_steps: Also save every this many optimizer steps (default ``None``).
        keep: Committed checkpoints kept (>= 2).
        accumulate: Training batches per optimizer step.
        clip_grad_norm: The largest gradient norm, or ``None``.
        scheduler_interval: When the scheduler steps: ``"step"`` or ``"epoch"``.
        callbacks: Objects with any of ``on_fit_start``, ``on_train_batch_end``,
            ``on_optimizer_step`` (after each optimizer step, the epoch's last partial window
            included), ``on_validation_start`` and ``on_validation_end`` (around each
            validation pass, and again when a resumed run goes on inside one),
            ``on_validation_batch_end``, ``on_epoch_end``, ``on_save_start``, ``on_preempted``,
            ``on_fit_end``. Those with ``state_dict``/``load_state_dict`` are checkpointed. The
            ``logs`` the hooks get hold the latest logged value of each name.
        progress_bar: A tqdm bar.
        signals: The preemption signals (default SIGTERM, SIGUSR1). They are handled from the
            moment the Trainer is built until ``fit`` returns. One that comes before training
            starts ends ``fit`` with ``EXIT_CODE`` and saves nothing.
        async_save: Write periodic checkpoints in a background thread (preemption and final
            saves block).
        tensorboard: ``None`` writes TensorBoard events if it is installed, ``True`` requires
            it, ``False`` never.
        log_every: A batch's loss and the other scalars its step returns are logged (CSV,
            TensorBoard, ``logs``, the progress bar) on every ``log_every``-th batch of its
            phase (default 50). Only these batches' values are read on the host. Epoch values
            are logged at every phase's end.
        deterministic: ``True`` turns on deterministic kernels during ``fit`` (needed for
            bit-exact resume on CUDA). ``None`` (default) changes nothing and says so once if
            the model is on CUDA; ``False`` changes nothing.
        preemption_check_every: Under ``torch.distributed``, the ranks agree every this many
            batches whether any rank got a preemption signal or is due a wall-clock checkpoint
            (one all-reduce of two ints; default 1). A signal waits for the next agreement.
        checkpoint_timeout: Seconds a rank waits for the others in a checkpoint save or load
            (default 600).
        lease_seconds: A run directory in object storage: how long an unknown holder's lease
            is waited for (a holder known dead is not).
        just_in_time: Under ``torchrun``, when a rank dies (or stops answering), one survivor
            saves the whole job as of the last completed optimizer step (``train.jit``).
            ``None`` (default): wherever a survivor can know every rank's state, else off with
            a message; ``True``: required (``fit`` raises, naming what prevents it); ``False``:
            off.
        remote_timeout: A run directory in object storage: seconds one operation on the store
            may go without progress before it fails (default 60). A periodic save that fails
            so is reported and training goes on; a resume fails, naming the store.

    Raises:
        ValueError: an option is out of range or of the wrong type.
    """

    max_epochs: int = _option(
        dataclasses.MISSING, "epochs to train; may change on resume", positive
    )
    max_steps: int | None = _option(
        None, "stop after this many optimizer steps; may change on resume", _positive_or_none
    )
    seed: int = _option(
        0,
        "seeds the process RNGs of a fresh run (seed the model's init yourself)",
        _seed,
        on_resume=True,
    )
    checkpoint_every_seconds: float | str | None = _option(
        "auto",
        "save when this much wall-clock time passed since the last save, at the next batch "
        "boundary; 'auto': from the measured save cost and failure rate; None: never by time",
        _interval_seconds,
    )
    checkpoint_every_steps: int | None = _option(
        None, "also save every this many optimizer steps", _positive_or_none
    )
    keep: int = _option(2, "committed checkpoints kept", _keep)
    accumulate: int = _option(1, "training batches per optimizer step", positive, on_resume=True)
    clip_grad_norm: float | None = _option(
        None, "largest gradient norm, or None", _norm_or_none, on_resume=True
    )
    scheduler_interval: str = _option(
        "step", "when the scheduler steps: 'step' or 'epoch'", _interval, on_resume=True
    )
    callbacks: tuple[Any, ...] = _option(
        (), "objects with any of the Trainer's hooks; those with state are checkpointed", _callbacks
    )
    progress_bar: bool = _option(True, "a tqdm bar", _flag)
    signals: tuple[int, ...] = _option(DEFAULT_SIGNALS, "the preemption signals", _signals)
    async_save: bool = _option(False, "write periodic checkpoints in a background thread", _flag)
    tensorboard: bool | None = _option(
        None,
        "TensorBoard events: None if it is installed, True required, False never",
        _flag_or_none,
    )
    log_every: int = _option(
        50, "log a batch's values every this many batches of its phase", positive
    )
    deterministic: bool | None = _option(
        None, "True: deterministic kernels during fit (bit-exact resume on CUDA)", _flag_or_none
    )
    preemption_check_every: int = _option(
        1, "under torch.distributed, the ranks agree on a signal every this many batches", positive
    )
    checkpoint_timeout: float = _option(
        600.0, "seconds a rank waits for the others in a checkpoint save or load", _seconds
    )
    lease_seconds: float = _option(
        30.0,
        "a run directory in object storage: how long an unknown holder's lease is waited for "
        "(a holder known dead, on this host or an earlier torchrun attempt, is not)",
        _seconds,
    )
    just_in_time: bool | None = _option(
        None,
        "under torchrun, when a rank dies a survivor saves the job as of the last step; None: "
        "wherever the state allows, True: required, False: off",
        _flag_or_none,
    )
    remote_timeout: float = _option(
        60.0,
        "a run directory in object storage: seconds an operation on the store may go without "
        "progress before it fails",
        _seconds,
    )

    def __post_init__(self) -> None:
        # Given as lists or generators, kept as tuples: the value is frozen.
        for name in ("callbacks", "signals"):
            value = getattr(self, name)
            if isinstance(value, Iterable) and not isinstance(value, tuple | str):
                object.__setattr__(self, name, tuple(value))
        for option in dataclasses.fields(self):
            option.metadata["check"](option.name, getattr(self, option.name))

    def on_resume(self) -> TrainerConfig:
        """The fields a resumed run must match.

        Returns:
            Those fields by name, as the checkpoint records them.
        """
        fields = dataclasses.fields(self)
        return cast(
            TrainerConfig,
            {f.name: getattr(self, f.name) for f in fields if f.metadata["on_resume"]},
        )

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Each option's doc in one line.

        Returns:
            The docs, by option name.
        """
        return {f.name: f.metadata["doc"] for f in dataclasses.fields(cls)}
