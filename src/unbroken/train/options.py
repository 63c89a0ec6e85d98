"""The Trainer's options, owned in one place: ``TrainerOptions``, a frozen value with a field
per option (its default, its doc under it, its check, and whether a resume must match it), and
``TrainerKeywords``, the same fields as the ``Trainer``'s keywords for type checkers.

``Trainer("runs/exp1", max_epochs=3, ...)`` builds a ``TrainerOptions`` from its keywords
(``options_of``), or takes one: ``Trainer(directory, options=TrainerOptions(...))``. Every field
is checked when the value is made, before anything is installed, locked or trained.
``on_resume()`` is what the checkpoint records of them and a resume compares
(``progress.TrainerConfig``, the saved schema). Cost: one check per option, once per Trainer.
"""

from __future__ import annotations

import dataclasses
import difflib
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

from .._checks import check_keep, check_seed, is_int, is_number
from ..preemption import DEFAULT_SIGNALS
from .progress import TrainerConfig

SCHEDULER_INTERVALS = ("step", "epoch")
Check = Callable[[str, Any], None]


def _option(default: Any, check: Check, *, on_resume: bool = False) -> Any:
    """A field: its default, how it is checked, whether a resume must match it. Its doc is the
    string under it, which the reference renders."""
    metadata = {"check": check, "on_resume": on_resume}
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


def _seconds_or_none(name: str, value: Any) -> None:
    if value is not None:
        _seconds(name, value)


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
    """Everything a ``Trainer`` is told but its directory: one field per option, with its
    default, its doc (under it) and its check. Each is checked when the value is made (a
    ``ValueError`` names the option, the value and what it takes). The fields that shape the
    computation are recorded in every checkpoint and must match on resume (``on_resume``); the
    others may change between a run and its resume. A preemption signal and the end of
    training always save.
    """

    max_epochs: int = _option(dataclasses.MISSING, positive)
    """Epochs to train (required); may change on resume."""
    max_steps: int | None = _option(None, _positive_or_none)
    """Stop after this many optimizer steps; may change on resume."""
    seed: int = _option(0, check_seed, on_resume=True)
    """Seeds the process RNGs of a fresh run, in [0, 2**64). Model init happens before
    ``fit``, so seed that yourself. Must match on resume."""
    checkpoint_every_seconds: float | str | None = _option("auto", _interval_seconds)
    """Save when this much wall-clock time passed since the last save, at the next batch
    boundary; ``None`` turns it off. ``"auto"`` (default): the interval that wastes the least
    time, from the measured cost of this run's saves and the failures its run directory has
    seen (Young/Daly; ``train.schedule``). A fresh run saves after its first 2 s to measure,
    then about every ``sqrt(2 x cost x 4 hours)`` until a failure is seen, bounded to [2 s,
    30 min]. The choice is printed when first made and when it changes."""
    checkpoint_every_steps: int | None = _option(None, _positive_or_none)
    """Also save every this many optimizer steps."""
    keep: int = _option(2, check_keep)
    """Committed checkpoints kept (>= 2: with one, a corrupted one leaves nothing to resume
    from)."""
    accumulate: int = _option(1, positive, on_resume=True)
    """Training batches per optimizer step. Must match on resume."""
    clip_grad_norm: float | None = _option(None, _norm_or_none, on_resume=True)
    """The largest gradient norm, or ``None``. Must match on resume."""
    scheduler_interval: str = _option("step", _interval, on_resume=True)
    """When the scheduler steps: ``"step"`` or ``"epoch"``. Must match on resume."""
    callbacks: Sequence[Any] = _option((), _callbacks)
    """Objects with any of ``on_fit_start``, ``on_train_batch_end``, ``on_optimizer_step``
    (after each optimizer step, the epoch's last partial window included),
    ``on_validation_start`` and ``on_validation_end`` (around each validation pass, and again
    when a resumed run goes on inside one), ``on_validation_batch_end``, ``on_epoch_end``,
    ``on_save_start``, ``on_preempted``, ``on_fit_end``. Those with
    ``state_dict``/``load_state_dict`` are checkpointed. The ``logs`` the hooks get hold the
    latest logged value of each name. Kept as a tuple."""
    progress_bar: bool = _option(True, _flag)
    """A tqdm bar: epoch, optimizer step, loss (updated on logged batches), batches per
    second."""
    signals: Iterable[int] = _option(DEFAULT_SIGNALS, _signals)
    """The preemption signals (default SIGTERM, SIGUSR1). They are handled from the moment the
    Trainer is built until ``fit`` returns. One that comes before training starts ends ``fit``
    with ``EXIT_CODE`` and saves nothing. Kept as a tuple."""
    async_save: bool = _option(False, _flag)
    """Write periodic checkpoints in a background thread (preemption and final saves
    block)."""
    tensorboard: bool | None = _option(None, _flag_or_none)
    """``None`` writes TensorBoard events if it is installed, ``True`` requires it, ``False``
    never."""
    log_every: int = _option(50, positive)
    """A batch's loss and the other scalars its step returns are logged (CSV, TensorBoard,
    ``logs``, the progress bar) on every ``log_every``-th batch of its phase. Only these
    batches' values are read on the host. Epoch values are logged at every phase's end."""
    deterministic: bool | None = _option(None, _flag_or_none)
    """``True`` turns on deterministic kernels during ``fit`` (needed for bit-exact resume on
    CUDA). ``None`` changes nothing and says so once if the model is on CUDA; ``False``
    changes nothing."""
    preemption_check_every: int = _option(1, positive)
    """Under ``torch.distributed``, the ranks act every this many batches on whether any rank
    got a preemption signal or is due a wall-clock checkpoint. With a DDP model the flags ride
    on every backward's gradient all-reduce; otherwise each check is one all-reduce of two
    ints. A signal waits for the next check (with DDP, also for the next backward)."""
    checkpoint_timeout: float = _option(600.0, _seconds)
    """Seconds a rank waits for the others in a checkpoint save or load."""
    lease_seconds: float = _option(30.0, _seconds)
    """A run directory in object storage: how long an unknown holder's lease is waited for (a
    holder known dead, on this host or an earlier torchrun attempt, is not)."""
    just_in_time: bool | None = _option(None, _flag_or_none)
    """Under ``torchrun``, when a rank dies (or stops answering), one survivor saves the whole
    job as of the last completed optimizer step (``train.jit``). ``None``: wherever a survivor
    can know every rank's state, else off with a message; ``True``: required (``fit`` raises,
    naming what prevents it); ``False``: off."""
    hang_timeout: float | None = _option(None, _seconds_or_none)
    """With just-in-time saves on: seconds a rank's process may go without running (its
    heartbeat in torchrun's store stands still) while the next rank waits on it. That rank then
    saves the job and exits, and torchrun restarts it (``train.watchdog``). ``None``: ``max(60,
    3 x the slowest step, save or validation batch seen so far)``. The process group's own
    timeout still ends any collective that waits longer."""
    remote_timeout: float = _option(60.0, _seconds)
    """A run directory in object storage: seconds one operation on the store may go without
    progress before it fails. A periodic save that fails so is reported and training goes
    on; a resume fails, naming the store."""

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


class TrainerKeywords(TypedDict, total=False):
    """``TrainerOptions``' fields as the ``Trainer``'s keywords, for type checkers and IDEs;
    documented and checked there (a test keeps the two equal)."""

    max_epochs: int
    max_steps: int | None
    seed: int
    checkpoint_every_seconds: float | str | None
    checkpoint_every_steps: int | None
    keep: int
    accumulate: int
    clip_grad_norm: float | None
    scheduler_interval: str
    callbacks: Sequence[Any]
    progress_bar: bool
    signals: Iterable[int]
    async_save: bool
    tensorboard: bool | None
    log_every: int
    deterministic: bool | None
    preemption_check_every: int
    checkpoint_timeout: float
    lease_seconds: float
    just_in_time: bool | None
    hang_timeout: float | None
    remote_timeout: float


NAMES = tuple(option.name for option in dataclasses.fields(TrainerOptions))


def options_of(keywords: Mapping[str, Any], options: TrainerOptions | None) -> TrainerOptions:
    """The ``Trainer``'s options: made from its keywords, or given whole (not both).

    Args:
        keywords: The options by name.
        options: A ``TrainerOptions``, or ``None``.

    Returns:
        The options, checked.

    Raises:
        TypeError: a keyword is not an option (the closest one is named).
        ValueError: both ``options`` and keywords are given, or an option is invalid.
    """
    for name in keywords:
        if name not in NAMES:
            close = difflib.get_close_matches(name, NAMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"Trainer got an unexpected keyword argument {name!r}{hint}: the options are "
                "TrainerOptions' fields, listed in the API reference"
            )
    if options is None:
        return TrainerOptions(**keywords)
    if keywords:
        raise ValueError(
            f"Trainer got options= and {'=, '.join(keywords)}=: pass the options one way, "
            "as keywords or as a TrainerOptions"
        )
    return options
