"""Where a process's time went from its start to its first training step, phase by phase.

The Trainer logs it once the first batch is done (``unbroken: resumed, first step after
3.1 s: ...``): what a restart costs is the sum of these phases, and the ones a resume adds to a fresh
start (finding, reading and restoring the checkpoint) are named apart from the interpreter's,
the imports' and the user's own setup, so that a slow restart says where it is slow. A restart's
line is at INFO; a fresh start's at DEBUG (its one INFO line says it starts fresh).

The process's start is read from Linux's ``/proc`` (its age against the system's uptime, to
10 ms); elsewhere the first phase is left out.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from .progress import say


def process_age() -> float | None:
    """Seconds since this process started, or ``None`` where ``/proc`` does not say."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        # The 22nd field, counted after the command name (which may hold spaces) ends.
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Startup:
    """The phases of one process's way to its first step, marked as they end (``mark``)."""

    def __init__(self) -> None:
        now = time.perf_counter()
        age = process_age()
        self.phases: list[tuple[str, float]] = []
        if age is not None:
            self.phases.append(("interpreter, imports and your code before Trainer()", age))
        self._last = now
        self._batched = self.reported = False

    def mark(self, phase: str) -> None:
        """``phase`` ended now (it started when the one before ended)."""
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def resumed(self, seconds: dict[str, float]) -> None:
        """The resume ended now: ``seconds`` of it by the checkpoint's load phases (``scan``,
        ``read``, ``restore``; none when no checkpoint was found), and the rest."""
        now = time.perf_counter()
        rest = now - self._last - sum(seconds.values())
        self.phases.extend((f"checkpoint {name}", value) for name, value in seconds.items())
        self.phases.append(("the rest of the resume", max(0.0, rest)))
        self._last = now

    def total(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def first_batch(self) -> None:
        """Called at every batch: the first one's arrival ends a phase."""
        if not self._batched:
            self._batched = True
            self.mark("first batch")

    def first_step(self, resumed: bool) -> None:
        """Called after every batch: after the first one's step, log the phases, once (at
        INFO after a resume, what the restart cost; at DEBUG after a fresh start)."""
        if self.reported:
            return
        self.reported = True
        self.mark("first batch's step")
        phases = "; ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases)
        how = "resumed" if resumed else "started fresh"
        level = logging.INFO if resumed else logging.DEBUG
        say(f"{how}, first step after {self.total():.2f} s: {phases}", level=level)
