"""The costs behind ``checkpoint_every_seconds="auto"`` and the way to the first step, pinned
where a direct minimisation cannot tell (``test_schedule.py`` checks Daly's interval to 1% of the
optimum): Daly's formula term by term, the run's history keeping its newest sessions, a save's
stall counted once in the next save's cost, and each phase of a restart counted once."""

from __future__ import annotations

import json
import math
import time

import pytest

from unbroken.train.progress import Startup
from unbroken.train.rundir import RunDirectory
from unbroken.train.schedule import KEPT_SESSIONS, AutoInterval, History, daly_interval


@pytest.mark.parametrize("cost, mtbf", [(50.0, 100.0), (10.0, 400.0), (30.0, 20.0 * 60)])
def test_dalys_interval_is_his_formula_term_by_term(cost, mtbf):
    """Daly (2006): sqrt(2CM) (1 + sqrt(C/2M)/3 + C/18M) - C of training, then the save's C.
    At C = 50 s, M = 100 s the third term is 2.8 s of a 119 s interval."""
    young = math.sqrt(2 * cost * mtbf)
    training = young * (1 + math.sqrt(cost / (2 * mtbf)) / 3 + cost / (18 * mtbf)) - cost
    assert daly_interval(cost, mtbf) == pytest.approx(training + cost, rel=1e-12)


def _session(start: float) -> dict:
    return {"start": start, "alive": start + 1.0, "end": None, "cost": 0.5, "interval": 9.0}


def test_the_history_keeps_its_newest_sessions(tmp_path):
    sessions = [_session(100.0 * i) for i in range(KEPT_SESSIONS)]
    (tmp_path / "history.json").write_text(json.dumps({"version": 1, "sessions": sessions}))
    history = History(RunDirectory(tmp_path), write=True)
    history.begin(30.0)
    kept = json.loads((tmp_path / "history.json").read_text())["sessions"]
    assert len(kept) == KEPT_SESSIONS
    assert kept[:-1] == sessions[1:]  # the oldest went
    assert kept[-1] == {**history.current, "interval": 30.0}  # this process, last


def test_a_saves_stall_is_counted_once(tmp_path):
    """A background save holds training 1 s (it copies the state), then writes beside the
    batches, which it does not slow: the next save costs its own stall, not the first's too."""
    writing = False
    auto = AutoInterval(History(RunDirectory(tmp_path), write=False), lambda: writing, True)
    clock = 0.0
    for _ in range(20):  # batches of 0.1 s, nothing in flight
        clock += 0.1
        auto.batch_done(clock)
    clock += 1.0  # the save, after the batch that found it due
    auto.measured(1.0)
    writing = True  # ... now written beside the next batches
    for _ in range(5):
        clock += 0.1
        auto.batch_done(clock)
    writing = False
    auto.measured(0.01)
    assert auto.costs == pytest.approx([1.0, 0.01])


def test_the_phases_to_the_first_step_are_each_counted_once():
    started = time.perf_counter()
    startup = Startup()
    time.sleep(0.05)
    startup.mark("run directory and its lock")
    time.sleep(0.3)  # the resume, 0.25 s of it in the checkpoint's load
    startup.resumed({"scan": 0.05, "read": 0.15, "restore": 0.05})
    startup.first_batch()
    startup.first_step(resumed=True)
    elapsed = time.perf_counter() - started
    phases = dict(startup.phases)
    assert list(phases)[-7:] == [
        "run directory and its lock",
        "checkpoint scan",
        "checkpoint read",
        "checkpoint restore",
        "the rest of the resume",
        "first batch",
        "first batch's step",
    ]
    assert (phases["checkpoint scan"], phases["checkpoint read"]) == (0.05, 0.15)
    assert phases["the rest of the resume"] >= 0.3 - 0.25
    # Together, the time from Trainer() to the first step; the interpreter's part before it.
    counted = sum(seconds for name, seconds in startup.phases if not name.startswith("interp"))
    assert elapsed - 0.05 < counted <= elapsed
    assert startup.total() == pytest.approx(sum(phases.values()))
