"""Hung ranks, noticed by default: a heartbeat through torchrun's store, and a just-in-time save.

A rank whose process stops running (SIGSTOP, a frozen host, a thread that holds the GIL for
good) never closes its sockets: its peers wait in their next collective until the process
group's timeout, 30 minutes by default. ``Watchdog`` notices it sooner. Under torchrun, with
just-in-time saves on, each rank runs one daemon thread that every few seconds (``POLL``, or a
tenth of the limit where that is shorter):

- publishes this rank's heartbeat (a count of its own polls) under a key of this attempt in
  torchrun's store;
- reads the heartbeat of the next rank (a ring: one key read a poll, whatever the world size);
- notes how long this rank's own ``progress.ticks`` stayed unchanged: a step, a save, a
  validation batch or a phase's end. The slowest of these, once over, sets the limit.

The limit (``hang_limit``) is ``Trainer(hang_timeout=...)``, or by default
``max(FLOOR, FACTOR x the slowest interval seen so far)``. The next rank hangs when its
heartbeat has not moved for longer than the limit while this rank's ticks have not moved either
(it waits on it). A live process beats even while it saves, validates or compiles for long:
the thread needs only the GIL for a moment, which a long step or save holds for at most its
own length. A rank that was paused itself (its own polls far apart) judges no one for that gap.

Then the main thread sits in a collective and cannot act, so the watchdog thread does. It halts
the main thread's loop (``JustInTime.halted``: the loop stops at its next optimizer step, record
or failure, so the live objects stay those of the last record), runs the same election and
``save_alone`` as a failure (``JustInTime.on_failure``), tells the other ranks (key ``SAVED``)
and ends the process with ``EXIT_HUNG``. The others wait on the hung rank too: each follows at
its next poll, through the same election (it waits for the commit) and exit. torchrun's agent
then stops the group (SIGKILL reaches the stopped rank, after the agent's 30 s grace) and
restarts it from the new checkpoint. The log says which rank hung, and for how long.

Not noticed here: a process that runs but never returns (a deadlock in a step, a stuck
kernel): its thread beats on. The process group's timeout ends that wait.

Costs: nothing in a step (the thread reads a plain int); a store write and three reads a poll
(every 5 s at most) per rank, on a ``TCPStore`` connection of its own.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..distributed.process_group import attempt_store
from .jit import JustInTime
from .progress import Progress, say

FLOOR = 60.0  # seconds: the least limit derived, whatever the steps and saves
FACTOR = 3.0  # the derived limit's multiple of the slowest interval seen
POLL = 5.0  # seconds between two heartbeats, at most (a tenth of the limit below 50 s)
LEFT = "left"  # a rank's heartbeat once its loop ended: no longer watched
SAVED = "saved"  # the key of the reason a rank saved the job for a hung one, once it did
EXIT_HUNG = 1  # the exit status of the rank that saved for a hung one


def hang_limit(slowest: float, hang_timeout: float | None) -> float:
    """How long a peer's heartbeat may stand still before it counts as hung.

    Args:
        slowest: The longest this rank's ticks stood still so far (seconds): a step, a save,
            a validation batch, a phase's end.
        hang_timeout: ``Trainer(hang_timeout=...)``: the limit itself, or None to derive it.

    Returns:
        ``hang_timeout``, or ``max(FLOOR, FACTOR * slowest)``.
    """
    if hang_timeout is not None:
        return float(hang_timeout)
    return max(FLOOR, FACTOR * slowest)


class Hung(RuntimeError):
    """A peer's process has not run for longer than the limit: what a just-in-time save is for."""


@dataclass
class Seen:
    """A value as this rank last saw it, and when (this rank's clock) it last changed."""

    value: Any
    since: float


class Watchdog:
    """One rank's watch of the next rank's heartbeat (see the module).

    Args:
        jit: The Trainer's just-in-time saves, which save the job for a hung peer.
        progress: The loop's counters; only ``ticks`` is read.
        hang_timeout: The limit in seconds, or None to derive it (``hang_limit``).
        store: The store of this attempt (by default a connection of its own to torchrun's).
        clock: Seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        jit: JustInTime,
        progress: Progress,
        hang_timeout: float | None,
        store: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        world = jit.agreement.world
        self.jit, self.progress, self.hang_timeout, self.clock = jit, progress, hang_timeout, clock
        self.rank, self.peer = world.rank, (world.rank + 1) % world.size
        if store is None:
            store = attempt_store(timedelta(seconds=POLL * 6))
        self.store = dist.PrefixStore("hang", store)
        now = clock()
        self.beats = 0
        self.slowest = 0.0  # the longest completed interval between two changes of ticks
        self.mine = Seen(progress.ticks, now)
        self.theirs: Seen | None = None  # None until the peer's first heartbeat
        self.polled = now
        self.lock = threading.Lock()  # stop() against acting: one of the two, never both
        self.stopped = False
        self.woken = threading.Event()  # stop() ends the thread's sleep
        self.thread: threading.Thread | None = None

    @classmethod
    def start(
        cls, jit: JustInTime, progress: Progress, hang_timeout: float | None
    ) -> Watchdog | None:
        """A running watchdog where just-in-time saves are on (torchrun, 2+ ranks), else None."""
        if not jit.enabled:
            return None
        watchdog = cls(jit, progress, hang_timeout)
        watchdog.thread = threading.Thread(
            target=watchdog._run, name="unbroken-hang-watchdog", daemon=True
        )
        watchdog.thread.start()
        return watchdog

    @property
    def limit(self) -> float:
        return hang_limit(self.slowest, self.hang_timeout)

    def poll(self) -> tuple[str, bool] | None:
        """Beat once, and look at the peer, and at whether a rank saved for a hung one.

        Returns:
            None, or what to do and why, for the log: ``(reason, True)``: the next rank hangs,
            this rank saves the job for it; ``(reason, False)``: another rank saved the job
            for a hung one, this rank follows it out (it waits on the hung rank too).
        """
        now = self.clock()
        limit = self.limit
        if now - self.polled > limit / 2:  # this rank did not run itself: restart every wait
            self.mine.since = now
            if self.theirs is not None:
                self.theirs.since = now
        self.polled = now
        ticks = self.progress.ticks
        if ticks != self.mine.value:
            self.slowest = max(self.slowest, now - self.mine.since)
            self.mine = Seen(ticks, now)
        self.beats += 1
        self.store.set(f"beat/{self.rank}", str(self.beats))
        if self.store.check([SAVED]):
            return self.store.get(SAVED).decode(), False
        key = f"beat/{self.peer}"
        if not self.store.check([key]):
            return None  # the peer has not started its watch yet
        beat = self.store.get(key).decode()
        if self.theirs is None or beat != self.theirs.value:
            self.theirs = Seen(beat, now)
        if beat == LEFT:
            return None
        still, waiting = now - self.theirs.since, now - self.mine.since
        if still <= limit or waiting <= limit:
            return None
        how = (
            "hang_timeout"
            if self.hang_timeout is not None
            else f"{FACTOR:g} x the slowest interval between two batches, at least {FLOOR:g} s; "
            "Trainer(hang_timeout=...) sets it"
        )
        return (
            f"rank {self.peer} hung: its process has not run for {still:.0f} s (no heartbeat "
            f"in torchrun's store), while rank {self.rank} waited on it after tick {ticks}; "
            f"the limit is {limit:.0f} s ({how})"
        ), True

    def stop(self) -> None:
        """The loop ended (or failed, and its own failure path saves): watch no more, and tell
        the rank watching this one. Returns once the thread is done, unless it is acting."""
        with self.lock:
            self.stopped = True
        self.woken.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * POLL)

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    if self.stopped:
                        self.store.set(f"beat/{self.rank}", LEFT)
                        return
                    found = self.poll()
                    if found is not None:
                        self.jit.halted = threading.get_ident()
                if found is not None:
                    self._act(*found)
                self.woken.wait(min(POLL, self.limit / 10))
        except Exception as error:  # the store went away (the agent is gone): watch no more
            say(f"the hang watchdog stopped: {type(error).__name__}: {error}", every_rank=True)

    def _act(self, reason: str, leads: bool) -> None:
        """Save the job for the hung rank (the election picks one saver: ``on_failure``), then
        end this process so that torchrun restarts the job; the first to act tells the others
        (``SAVED``), which wait on the hung rank too. The main thread is halted
        (``JustInTime.halted``); only ``os._exit`` ends a process whose main thread waits in a
        collective."""
        try:
            if leads:
                say(reason, every_rank=True, level=logging.WARNING)
            self.jit.on_failure(Hung(reason))
            if leads:
                self.store.set(SAVED, reason)
            say(
                f"rank {self.rank} exits with {EXIT_HUNG} so that torchrun restarts the job",
                every_rank=True,
            )
        finally:
            logging.shutdown()  # the lines above reach the job's log first
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_HUNG)
