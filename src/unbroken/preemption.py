"""``Preemption``: turn SIGTERM/SIGUSR1 into a flag the training loop checks at step boundaries.

Schedulers warn before they kill: Kubernetes sends SIGTERM and waits 30 s, GCP spot 30 s,
AWS spot 2 min, SLURM sends ``--signal=SIGUSR1@90``. Saving a checkpoint *inside* a signal
handler can deadlock or corrupt it (the handler interrupts arbitrary code, maybe a write in
progress), so the handler here only records that a signal came. The loop sees
``preemption.requested`` at its next step boundary, saves, and exits with ``EXIT_CODE`` so a
wrapper script or scheduler can requeue the job.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, NoReturn

import torch.distributed as dist

from .distributed.world import World

EXIT_CODE = 75
"""Exit status after a preemption checkpoint: EX_TEMPFAIL, "try again later" (sysexits.h)."""

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_active: list[tuple[signal.Signals, ...]] = []  # the signals of each Preemption now entered


def active_signals() -> tuple[signal.Signals, ...]:
    """The default preemption signals and any other that an entered ``Preemption`` handles.

    DataLoader workers ignore these (``unbroken.data.workers``): they must outlive a signal sent
    to the whole process group until the training process has saved.
    """
    extra = [s for signals in _active for s in signals if s not in DEFAULT_SIGNALS]
    return DEFAULT_SIGNALS + tuple(dict.fromkeys(extra))


def exit_to_be_requeued(destroy_groups: bool = True) -> NoReturn:
    """End the process with ``EXIT_CODE`` after a preemption checkpoint: ``SystemExit``, so
    that the caller's ``finally`` blocks and exit handlers run.

    Under ``torch.distributed``, the process groups are destroyed first (``destroy_groups``;
    Lightning's teardown still uses them), as torch asks before a process exits, and the
    process then ends with ``os._exit(EXIT_CODE)`` once the exit handlers registered after this
    call have run (those registered before it are skipped; logging is flushed): the
    interpreter's own teardown would destroy the user's ``DistributedDataParallel`` model after
    its process group, which on torch 2.x with gloo aborts the process in about one exit of
    eight (SIGABRT, "terminate called without an active exception", measured with a plain DDP
    script), and the rank would report -6 instead of 75.
    """
    world = World.current()
    if world.initialized and destroy_groups:
        dist.destroy_process_group()
    if world.distributed:
        atexit.register(_end_now)
    raise SystemExit(EXIT_CODE)


def _end_now() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more to say
            pass
    os._exit(EXIT_CODE)


class Preemption:
    """A context manager that installs flag-setting handlers and restores the previous ones.

    ``with Preemption() as preemption: ... if preemption.requested: save(); exit(EXIT_CODE)``

    Args:
        signals: The signals that request a preemption (SIGTERM and SIGUSR1 by default).
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None  # time.monotonic() when the signal came
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        """Whether one of the signals came since the handlers were installed."""
        return self.received is not None

    def seconds_since_signal(self) -> float:
        """How long ago the signal came.

        Returns:
            Seconds since the first signal, or 0.0 if none came.
        """
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def _handle(self, signum: int, frame: Any) -> None:
        # Only set the flag: anything more could run in the middle of a checkpoint write.
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.monotonic()

    @property
    def installed(self) -> bool:
        """Whether the handlers are installed now."""
        return bool(self._previous)

    def install(self) -> Preemption:
        """Install the handlers; a no-op while they are installed.

        ``uninstall`` puts back the previous ones; ``with Preemption():`` does both.

        Returns:
            This ``Preemption``.

        Raises:
            RuntimeError: called outside the main thread (Python installs signal handlers
                there only); pass ``signals=()`` there instead.
        """
        if self.installed or not self.signals:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "Preemption handlers can only be installed from the main thread (a Python rule "
                "for signal.signal); run the training loop in the main thread or pass signals=()"
            )
        self.received = self.received_at = None  # a new installation waits for a new signal
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        _active.append(self.signals)
        return self

    def ignore_until_exit(self) -> None:
        """After the preemption checkpoint, on the way out: ignore the signals from now until
        the process exits, and leave them so (``uninstall`` puts nothing back). A scheduler
        signals again, and ``torchrun`` sends SIGTERM to the ranks still exiting once one rank
        has exited (with 75): a rank killed by it would report -15 instead of 75."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works in the main thread only; the handlers stay flags
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        if self._previous and self.signals in _active:
            _active.remove(self.signals)
        self._previous.clear()

    def uninstall(self) -> None:
        """Put back the handlers that ``install`` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous and self.signals in _active:
            _active.remove(self.signals)
        self._previous.clear()

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
