"""Loader workers outlive a preemption signal until the training process has saved.

Schedulers signal the whole process group (``docker stop``, systemd, Kubernetes, SLURM), so a
SIGTERM reaches every DataLoader worker as well as the training process. torch's workers die of
it (their C handler re-raises SIGTERM unless their parent sent it), and the training process
then fails with "DataLoader worker ... is killed by signal" before it can save.

So in a worker the preemption signals stay blocked, and a small thread takes them with
``sigwaitinfo``, which says who sent each one: a SIGTERM from the training process itself (how
torch and ``multiprocessing`` stop a worker that does not exit by itself) ends the worker as
torch's handler would; any other is dropped. The training process, which handles the signals,
saves and then shuts its workers down as usual.

A worker is exposed between its start and its ``worker_init_fn``: the training process blocks
the signals while it starts workers (a forked or spawned child inherits the blocked mask), so a
signal in that window waits in the worker for the thread, and in the training process it is
delivered when the mask is put back: late by milliseconds, never lost.

A worker whose training process died (SIGKILL) exits quietly rather than print a connection
error's traceback (``_quiet_if_orphaned``). A worker that died (a segfault, the OOM killer) is
reported with torch's message even when a batch it had queued is what found it gone
(``await_death_report``).

Cost: two ``pthread_sigmask`` calls per ``iter()`` with workers; one idle thread per worker.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType

from ..preemption import active_signals

_POSIX = hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigwaitinfo")


def worker_init(user_init: Callable[[int], None] | None) -> Callable[[int], None]:
    """``worker_init_fn`` for torch's loader: shield the worker, then call the user's."""
    signals = tuple(int(s) for s in active_signals())
    return functools.partial(_init, signals, os.getpid(), user_init)


def _init(
    signals: tuple[int, ...],
    trainer_pid: int,
    user_init: Callable[[int], None] | None,
    worker_id: int,
) -> None:
    if _POSIX and signals:
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # this thread and those it starts
        threading.Thread(
            target=_drop_signals,
            args=(signals, trainer_pid),
            daemon=True,
            name="unbroken-worker-signals",
        ).start()
    sys.excepthook = functools.partial(_quiet_if_orphaned, trainer_pid, sys.excepthook)
    if user_init is not None:
        user_init(worker_id)


def _quiet_if_orphaned(
    trainer_pid: int,
    report: Callable[..., None],
    kind: type[BaseException],
    error: BaseException,
    trace: TracebackType | None,
) -> None:
    """A worker's ``sys.excepthook``. When the training process dies (SIGKILL, OOM), a worker
    that was handing it a batch's tensors loses the connection: ``multiprocessing``'s thread
    that sends shared memory reports it through this hook, as a ``ConnectionResetError``
    traceback that reads as a failure. Orphaned, the worker exits quietly instead (torch's
    worker would exit on its own a few seconds later); anything else is reported as before."""
    if issubclass(kind, (ConnectionError, EOFError)) and _orphaned(trainer_pid):
        os._exit(0)
    report(kind, error, trace)


def _orphaned(trainer_pid: int, wait: float = 1.0) -> bool:
    """Whether the training process is gone. The connection breaks while the kernel tears the
    killed process down, a moment before its children are given to another parent: wait for
    that (on this error path only) rather than report a failure that is not one."""
    deadline = time.monotonic() + wait
    while os.getppid() == trainer_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _drop_signals(signals: tuple[int, ...], trainer_pid: int) -> None:
    while True:
        info = signal.sigwaitinfo(signals)
        if info.si_signo == signal.SIGTERM and info.si_pid == trainer_pid:
            os._exit(0)  # the training process is stopping this worker: what torch's handler does


DEATH_WAIT = 2.0  # seconds a broken connection to a worker waits for torch's report of its death


def await_death_report(error: BaseException) -> None:
    """Report a dead worker as torch does, when a batch found it gone first.

    A worker that queued a batch of tensors keeps their memory until the training process
    takes it over through a socket of the worker's. If the worker dies meanwhile (a segfault,
    the OOM killer), the kernel closes that socket a moment before the worker can be seen dead:
    torch's loader then raises ``ConnectionResetError``, ``ConnectionRefusedError`` or
    ``EOFError`` (its own loader does, in a third to most of such deaths) rather than its
    message, "DataLoader worker (pid N) is killed by signal: Segmentation fault.". That message
    comes from torch's SIGCHLD handler, which checks the open iterators' workers, reports a
    death once, and runs wherever the main thread is when the signal comes: later, in other
    code, or inside a ``__del__`` that swallows it.

    So on such an error, with torch's iterator still open, this raises SIGCHLD in this thread
    every 10 ms for up to ``DEATH_WAIT`` seconds: torch's handler runs at once and raises its
    report as soon as the worker can be seen dead, the broken connection as its context. If
    the signal came first and its report was swallowed, the dead worker (a child process that
    torch named ``pt_data_worker``) is reported here in torch's words. A spurious SIGCHLD is
    harmless (the signal does not queue: a handler must expect that). If no worker died, the
    error is raised as it was, that much later: a failure path only.
    """
    if not isinstance(error, (ConnectionError, EOFError)):
        return
    if "in DataLoader worker process" in str(error):  # raised by the user's code in a worker
        return
    if not hasattr(signal, "SIGCHLD") or threading.current_thread() is not threading.main_thread():
        return  # Windows; signal handlers run in the main thread only
    deadline = time.monotonic() + DEATH_WAIT
    while time.monotonic() < deadline:
        signal.raise_signal(signal.SIGCHLD)  # torch's handler, if any, runs before this returns
        report = _dead_worker()
        if report is not None:
            signal.raise_signal(signal.SIGCHLD)  # seen dead just now: torch's words first
            raise RuntimeError(report)
        time.sleep(0.01)


def _dead_worker() -> str | None:
    """torch's report of a loader worker that died and that nobody has waited for yet."""
    if not (hasattr(os, "waitid") and hasattr(os, "WNOWAIT")):
        return None
    try:  # WNOWAIT: the child stays for torch (and anyone else) to wait for
        child = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if child is None:  # no child has ended
            return None
        with open(f"/proc/{child.si_pid}/comm") as comm:
            if comm.read().strip() != "pt_data_worker":
                return None
    except OSError:  # no child at all; no /proc
        return None
    name = f"DataLoader worker (pid {child.si_pid})"
    if child.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        report = f"{name} is killed by signal: {signal.strsignal(child.si_status)}. "
        if child.si_status == signal.SIGBUS:
            report += (
                "It is possible that dataloader's workers are out of shared memory. Please try "
                "to raise your shared memory limit."
            )
        return report
    if child.si_status != 0:
        return (
            f"{name} exited unexpectedly with exit code {child.si_status}. Details are lost due "
            "to multiprocessing. Rerunning with num_workers=0 may give better error trace."
        )
    return None


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Block the preemption signals in this thread while it starts worker processes."""
    if not _POSIX:  # Windows: no process groups to signal
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, active_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
