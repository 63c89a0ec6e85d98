"""When a periodic checkpoint is due: every so many optimizer steps, every so many seconds, or at
an interval chosen from this run's own costs (``checkpoint_every_seconds="auto"``).

A save stops training for ``C`` seconds; a failure loses the work since the last save and the
restart. With failures at random (exponential) times, ``M`` seconds apart on average, the
interval that wastes the least wall-clock time is Young's (1974) ``sqrt(2 C M)``; we use Daly's
(2006) refinement, ``sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` of training between
saves (``M`` once ``C >= 2M``), bounded to [``MIN_SECONDS``, ``MAX_SECONDS``]. Neither the
restart's cost nor how long a background save takes to reach the disk changes that optimum
(each adds the same waste at every interval), so only the blocking part counts:

- ``C``, measured: the median of this run's last saves (``COST_WINDOW``) of the time the
  training loop was held, the wait for the previous save included; for a background save also
  the time its writing took from the training batches that ran beside it (their time above the
  median batch without a save in flight). A resumed run starts from the cost its run directory's
  history recorded; a fresh one saves first after ``FIRST_SECONDS`` (2 s: its first steps) to
  measure it.
- ``M``, observed in the run directory's history (``history.json``, ``History``: one record per
  process that trained there: when it started, when it last saved, how it ended). A process
  that ended without saying so (SIGKILL, a crash, a lost machine) is a failure; it lived from
  its start until its restart, or, if the restart came later than that, until the middle of the
  interval after its last save (it would have saved again had it lived longer). A preemption
  that saved in time lost nothing and is no failure. ``M`` is the time lived divided by the
  failures; before any failure, ``PRIOR_MTBF`` (4 hours: a node of a large GPU cluster, a spot
  instance), or the time lived if longer.

The interval is logged with its reasons when a process first chooses it, and again only when
its reasons change (a failure seen, the prior given up, a bound reached or left) or it moves by
a factor of ``SAY_FACTOR`` (1.5) or more from the one last logged: at INFO once failures shaped
it, at DEBUG before any (a first run's reasoning is a detail). The waste is flat around
the optimum: at ``k`` times the best interval the time lost to saves and failures is
``(k + 1/k) / 2`` of the least, so within a factor of 1.5 it is at most 8% more (of a waste
that is itself a few percent). A 10% rule printed noise: a run's first saves cost more (caches
are cold), so the median of the first few moved the interval 10-15% at each of them.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from .._checks import is_number
from .._files import atomic_write
from ..checkpoint.manager import Checkpointer
from ..distributed.world import World
from .options import TrainerOptions
from .progress import Progress, say
from .rundir import RunDirectory

MIN_SECONDS, MAX_SECONDS = 2.0, 1800.0  # the bounds of an automatic interval
# A fresh run's first automatic save, which measures the cost of saving: after its first steps,
# so that a young run's first failure does not lose everything it trained (it was 60 s).
FIRST_SECONDS = MIN_SECONDS
PRIOR_MTBF = 4 * 3600.0  # the mean time between failures assumed before one is seen
COST_WINDOW = 5  # the saves whose median is the cost
SAY_FACTOR = 1.5  # a new interval this far from the last printed is printed
HISTORY, KEPT_SESSIONS = "history.json", 100

_clock = time.monotonic  # intervals; a name of its own so tests can move time
_now = time.time  # the history's times: they compare across processes and machines


def daly_interval(cost: float, mtbf: float) -> float:
    """Seconds from one save's start to the next's that waste the least (Daly 2006, bounded):
    ``cost`` seconds of blocking per save, failures ``mtbf`` seconds apart on average."""
    if cost >= 2 * mtbf:
        compute = mtbf
    else:
        ratio = cost / (2 * mtbf)
        compute = math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost
    return min(MAX_SECONDS, max(MIN_SECONDS, compute + cost))


class History:
    """``history.json`` in the run directory: one record per process that trained there, the
    newest ``KEPT_SESSIONS``. Written by the first rank only (atomically on a local disk;
    uploaded whole to object storage) when it starts, after each save and when it ends. It only
    tunes the interval: one that cannot be read is reported and started anew."""

    def __init__(self, run: RunDirectory, write: bool) -> None:
        self.run, self.write = run, write
        self.sessions: list[dict[str, Any]] = []
        if write:
            self.sessions = self._read()
        started = _now()
        self.current: dict[str, Any] = {"start": started, "alive": started, "end": None}

    def _read(self) -> list[dict[str, Any]]:
        path = self.run.local / HISTORY
        try:
            self.run.download(HISTORY)
            if not path.exists():
                return []
            sessions = json.loads(path.read_text())["sessions"]
            if not all(_is_session(s) for s in sessions):
                raise ValueError("a session is not {start, alive, end, cost, interval}")
            return list(sessions)
        except (OSError, ValueError, KeyError, TypeError) as error:
            warnings.warn(
                f"unbroken.Trainer: the run's history {path} cannot be read ({error}); it "
                "is started anew (it only tunes checkpoint_every_seconds='auto')",
                stacklevel=3,
            )
            return []

    def begin(self, interval: float | None) -> None:
        self.current["interval"] = interval
        self._write()

    def saved(self, cost: float | None, interval: float | None) -> None:
        self.current.update(alive=_now(), cost=cost, interval=interval)
        self._write()

    def end(self, how: str) -> None:
        """``how``: ``"finished"`` or ``"preempted"`` (saved in time: no work lost)."""
        self.current.update(alive=_now(), end=how)
        self._write()

    def _write(self) -> None:
        if not self.write:
            return
        sessions = [*self.sessions, self.current][-KEPT_SESSIONS:]
        path = self.run.local / HISTORY
        try:
            atomic_write(path, json.dumps({"version": 1, "sessions": sessions}).encode())
            self.run.upload(HISTORY)
        except OSError as error:  # a full disk is reported by the checkpoint, not here
            warnings.warn(f"unbroken.Trainer: cannot write {path}: {error}", stacklevel=3)

    def failures(self) -> tuple[int, float]:
        """The failures seen, and the seconds the run's processes lived, this one included."""
        failures, lived = 0, _now() - self.current["start"]
        for session, after in zip(self.sessions, [*self.sessions[1:], self.current]):
            end = session["alive"]
            if session["end"] is None:
                failures += 1
                # Died before its next save was due: at its restart, or mid-interval.
                interval = session.get("interval")
                end = (
                    after["start"] if interval is None else min(after["start"], end + interval / 2)
                )
            lived += max(0.0, end - session["start"])
        return failures, lived

    def last_cost(self) -> float | None:
        costs = [s.get("cost") for s in self.sessions if s.get("cost") is not None]
        return costs[-1] if costs else None


def _is_session(session: Any) -> bool:
    return (
        isinstance(session, dict)
        and is_number(session.get("start"))
        and is_number(session.get("alive"))
        and session.get("end") in (None, "finished", "preempted")
    )


class SaveSchedule:
    """When a periodic checkpoint is due: after the batch that completes every ``every_steps``-th
    optimizer step (``by_steps``: the same on every rank), and once ``every_seconds`` of
    wall-clock time passed since the last save (``by_time``: by this process's clock, so a
    data-parallel job agrees on it first). ``every_seconds="auto"``: chosen by ``AutoInterval``
    (see the module) on the first rank (``first``); the others follow its decisions. This process
    is recorded in the run's ``history`` as the schedule is made, and every save's blocking time
    is ``measured`` and recorded there, whichever the interval.
    """

    def __init__(
        self,
        every_steps: int | None,
        every_seconds: float | str | None,
        history: History,
        in_flight: Callable[[], bool] | None = None,
        first: bool = True,
    ) -> None:
        self.every_steps, self.history = every_steps, history
        self.auto = AutoInterval(history, in_flight, first) if every_seconds == "auto" else None
        if self.auto is not None:
            every_seconds = self.auto.interval
        assert not isinstance(every_seconds, str), every_seconds
        self.every_seconds = every_seconds
        self.last_save = _clock()
        history.begin(every_seconds)

    @classmethod
    def of_run(
        cls, options: TrainerOptions, run: RunDirectory, checkpointer: Checkpointer, world: World
    ) -> SaveSchedule:
        """The Trainer's schedule: its options, its run's history, on this rank."""
        return cls(
            options.checkpoint_every_steps,
            options.checkpoint_every_seconds,
            History(run, write=world.first),
            # Blocking saves take nothing from the batches: no batch is timed for them.
            in_flight=(lambda: checkpointer.in_flight) if options.async_save else None,
            first=world.first,
        )

    def saved(self) -> None:
        self.last_save = _clock()

    def measured(self, blocked: float) -> None:
        """The save that just returned held training ``blocked`` seconds."""
        if self.auto is not None:
            self.auto.measured(blocked)
            self.every_seconds = self.auto.interval
        else:
            self.history.saved(blocked, self.every_seconds)

    def by_steps(self, progress: Progress) -> bool:
        every_steps = self.every_steps
        return bool(
            every_steps
            and progress.phase == "train"
            and progress.micro == 0
            and progress.steps % every_steps == 0
        )

    def by_time(self) -> bool:
        now = _clock()
        if self.auto is not None:
            self.auto.batch_done(now)
        return bool(self.every_seconds and now - self.last_save >= self.every_seconds)


class AutoInterval:
    """``checkpoint_every_seconds="auto"`` (see the module): the interval from the measured cost
    of this run's saves and the failures in its history. ``in_flight`` says whether a background
    save is being written (``None``: saves block, and no batch is timed). ``decide``: this rank
    chooses (the first); the others never call a save due by time and follow the first rank's."""

    def __init__(
        self, history: History, in_flight: Callable[[], bool] | None, decide: bool
    ) -> None:
        self.history, self.in_flight, self.decide = history, in_flight, decide
        self.costs: list[float] = []
        self.batch: deque[float] = deque(maxlen=50)  # recent batch times, no save in flight
        self.stolen = 0.0  # time a background save took from the batches beside it
        self._last_batch: float | None = None
        self._said: tuple[float, tuple] | None = None  # the last printed: interval, reasons
        cost = history.last_cost()
        if cost is not None:
            self.costs.append(cost)
        self.interval: float | None = None
        if decide:
            self.interval = self._choose() if cost is not None else self._first()

    def batch_done(self, now: float) -> None:
        """Called after every batch: the batch's time, and whether a save was written beside it."""
        if self.in_flight is None:
            return
        last, self._last_batch = self._last_batch, now
        if last is None:
            return
        took = now - last
        if self.in_flight():
            if self.batch:
                self.stolen += max(0.0, took - statistics.median(self.batch))
        else:
            self.batch.append(took)

    def measured(self, blocked: float) -> None:
        """A save held training ``blocked`` seconds (for a background save: what its writing
        took from the batches beside it, measured since the save before, is added)."""
        self.costs = [*self.costs[-(COST_WINDOW - 1) :], blocked + self.stolen]
        self.stolen = 0.0
        self._last_batch = None  # the save's own time is not a batch's
        if self.decide:
            self.interval = self._choose()
        self.history.saved(self.costs[-1], self.interval)

    def _first(self) -> float:
        first = FIRST_SECONDS
        self._said = (first, ("first save",))
        say(
            f"checkpoint interval {first:.1f} s (auto: the first save measures its cost)",
            level=logging.DEBUG,
        )
        return first

    def _choose(self) -> float:
        cost = statistics.median(self.costs)
        failures, lived = self.history.failures()
        mtbf = lived / failures if failures else max(PRIOR_MTBF, lived)
        interval = daly_interval(cost, mtbf)
        bound = "the lower bound; " if interval <= MIN_SECONDS else ""
        bound = "the upper bound; " if interval >= MAX_SECONDS else bound
        assumed = not failures and lived < PRIOR_MTBF
        reasons = (failures, assumed, bound)
        if self._new(interval, reasons):
            self._said = (interval, reasons)
            if failures:
                seen = f"{failures} failure{'s' * (failures != 1)} in {lived:.0f} s of this run"
            elif assumed:
                seen = f"none seen in {lived:.0f} s, so {PRIOR_MTBF / 3600:.0f} h assumed"
            else:
                seen = f"none seen in {lived:.0f} s of this run"
            say(
                f"checkpoint interval {interval:.1f} s ({bound}auto: a save blocks training "
                f"{cost:.3f} s, the median of {len(self.costs)}; mean time between failures "
                f"{mtbf:.0f} s, {seen})",
                level=logging.INFO if failures else logging.DEBUG,
            )
        return interval

    def _new(self, interval: float, reasons: tuple) -> bool:
        """Whether ``interval``, chosen for ``reasons``, is worth printing (see the module)."""
        if self._said is None:
            return True
        said, said_reasons = self._said
        return reasons != said_reasons or max(interval / said, said / interval) >= SAY_FACTOR
