"""checkpoint_every_seconds="auto": Daly's interval against a direct minimisation of the expected
waste, the failure rate read from the run's history, the measured cost, and the Trainer's
record of its processes; the time to the first step, by phase."""

import json
import logging
import math
import os
import re

import pytest
import torch
from trainer_job import Crash, CrashAt, SignalAt, run

import unbroken
from unbroken.train import schedule
from unbroken.train.progress import process_age
from unbroken.train.rundir import RunDirectory
from unbroken.train.schedule import (
    FIRST_SECONDS,
    MAX_SECONDS,
    MIN_SECONDS,
    PRIOR_MTBF,
    AutoInterval,
    History,
    SaveSchedule,
    daly_interval,
)


@pytest.fixture
def details(caplog):
    """The "unbroken" logger at DEBUG: the interval's reasons and a fresh start's phases."""
    caplog.set_level(logging.DEBUG, logger="unbroken")


def _expected_time_per_work(interval: float, cost: float, mtbf: float) -> float:
    """Wall-clock seconds per second of training, with saves every `interval` (from one save's
    start to the next) costing `cost`, failures exponential with mean `mtbf`, an instant
    restart: a segment of length L = interval succeeds with probability exp(-L/M); each failure
    wastes on average the time lived in the segment. Expected time to finish a segment:
    M (exp(L/M) - 1) (the standard result, restart cost 0)."""
    work = interval - cost
    return mtbf * math.expm1(interval / mtbf) / work


@pytest.mark.parametrize(
    "cost, mtbf", [(0.3, 30.0), (0.3, 300.0), (2.0, 3600.0), (0.05, 14400.0), (5.0, 60.0)]
)
def test_daly_is_the_interval_that_wastes_the_least(cost, mtbf):
    """Against a direct numerical minimisation of the exact expected time (not Daly's formula):
    the waste at Daly's interval is within 1% of the true minimum."""
    chosen = daly_interval(cost, mtbf)
    candidates = [cost * 1.001 + i * (mtbf / 20000) for i in range(1, 200000)]
    best = min(candidates, key=lambda t: _expected_time_per_work(t, cost, mtbf))
    at_best = _expected_time_per_work(best, cost, mtbf)
    assert _expected_time_per_work(chosen, cost, mtbf) <= at_best * 1.01, (chosen, best)
    # Young's first-order value, for a cheap save, is close to it.
    if cost < mtbf / 1000:
        assert chosen == pytest.approx(math.sqrt(2 * cost * mtbf) + cost, rel=0.05)


def test_the_interval_is_bounded():
    assert daly_interval(1e-6, 10.0) == MIN_SECONDS
    assert daly_interval(100.0, 1e9) == MAX_SECONDS
    assert daly_interval(10.0, 4.0) == pytest.approx(14.0)  # cost >= 2 M: M of training


def _history(tmp_path, sessions):
    (tmp_path / "history.json").write_text(json.dumps({"version": 1, "sessions": sessions}))
    run = RunDirectory(tmp_path)
    return History(run, write=True)


def _session(start, alive, end=None, cost=None, interval=None):
    return {"start": start, "alive": alive, "end": end, "cost": cost, "interval": interval}


def test_failures_are_the_processes_that_ended_without_saying_so(tmp_path, monkeypatch):
    monkeypatch.setattr(schedule, "_now", lambda: 1000.0)
    history = _history(
        tmp_path,
        [
            # Killed: restarted at 30, before the middle of its next interval (12 + 40 / 2).
            _session(0.0, 12.0, cost=0.5, interval=40.0),
            # Preempted, saved in time: lived 30 -> 50, no failure.
            _session(30.0, 50.0, end="preempted", cost=0.4, interval=20.0),
            # Killed; restarted much later (a queue): it lived to 60 + 20 / 2 = 70 at most.
            _session(55.0, 60.0, cost=0.6, interval=20.0),
            # Killed, saving never by time: lived from its start to the next one.
            _session(500.0, 500.0),
        ],
    )
    monkeypatch.setattr(schedule, "_now", lambda: 600.0)
    history.current["start"] = 580.0  # this process: 20 s so far
    failures, lived = history.failures()
    assert failures == 3
    assert lived == pytest.approx(30 + 20 + 15 + 80 + 20)
    assert history.last_cost() == 0.6


def test_a_history_that_cannot_be_read_is_reported_and_started_anew(tmp_path):
    (tmp_path / "history.json").write_text('{"version": 1, "sessions": [{"start": "x"}]}')
    with pytest.warns(UserWarning, match="history.*cannot be read.*started anew"):
        history = History(RunDirectory(tmp_path), write=True)
    assert history.sessions == []
    history.begin(None)
    written = json.loads((tmp_path / "history.json").read_text())
    assert len(written["sessions"]) == 1 and written["sessions"][0]["end"] is None


def test_the_history_is_written_durably_beside_nothing_else(tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), fsync(fd)))
    history = History(RunDirectory(tmp_path), write=True)
    history.begin(None)
    history.end("finished")
    assert len(synced) == 2 * 2  # each write: the file and its directory (_files.atomic_write)
    assert os.listdir(tmp_path) == ["history.json"]  # no temporary left
    assert json.loads((tmp_path / "history.json").read_text())["sessions"][0]["end"] == "finished"


def test_auto_measures_first_then_assumes_hours_then_learns_from_failures(
    tmp_path, monkeypatch, capfd, details
):
    monkeypatch.setattr(schedule, "_now", lambda: 100.0)
    fresh = AutoInterval(_history(tmp_path, []), lambda: False, decide=True)
    assert fresh.interval == FIRST_SECONDS == MIN_SECONDS  # after its first steps, not a minute
    fresh.measured(0.5)
    assert fresh.interval == pytest.approx(daly_interval(0.5, PRIOR_MTBF))
    assert 110 < fresh.interval < 130  # sqrt(2 x 0.5 x 4 h) = 120 s
    assert "checkpoint interval 120" in capfd.readouterr().err
    fresh.measured(0.6)
    fresh.measured(5.0)  # one slow save (a busy disk): the median of the last five is the cost
    assert fresh.interval == pytest.approx(daly_interval(0.6, PRIOR_MTBF))
    # Three processes killed, 90 s lived: M = 30 s; the cost is the history's last.
    killed = [_session(i * 30.0, i * 30.0 + 10, cost=0.4, interval=5.0) for i in range(3)]
    monkeypatch.setattr(schedule, "_now", lambda: 90.0)
    learned = AutoInterval(_history(tmp_path, killed), lambda: False, decide=True)
    failures, lived = learned.history.failures()
    assert failures == 3
    assert learned.interval == pytest.approx(daly_interval(0.4, lived / 3))
    assert "3 failures" in capfd.readouterr().err
    # Killed before any save: the first is due after the first steps again.
    unsaved = [_session(i * 8.0, i * 8.0) for i in range(4)]
    monkeypatch.setattr(schedule, "_now", lambda: 32.0)
    hurried = AutoInterval(_history(tmp_path, unsaved), lambda: False, decide=True)
    assert hurried.interval == pytest.approx(MIN_SECONDS)


def _said(capfd):
    return [x for x in capfd.readouterr().err.splitlines() if "checkpoint interval" in x]


def test_the_interval_is_printed_when_chosen_and_when_it_changes_not_at_every_save(
    tmp_path, monkeypatch, capfd, details
):
    """The costs `make demo`'s first process measured (a run's first saves are slower) moved
    the interval 10-15% at each of its first saves, and each move was printed; now a line says
    the first choice, the first measured one, and then only a move by half or more, or new
    reasons (the prior given up, a bound reached)."""
    monkeypatch.setattr(schedule, "_now", lambda: 100.0)
    auto = AutoInterval(_history(tmp_path, []), lambda: False, decide=True)
    for cost in [0.015, 0.011, 0.008, 0.009, 0.010, 0.008, 0.009] * 3:
        auto.measured(cost)
    first, measured = _said(capfd)
    assert "2.0 s (auto: the first save measures its cost)" in first
    assert f"interval {daly_interval(0.015, PRIOR_MTBF):.1f} s (auto: " in measured
    assert auto.interval < daly_interval(0.015, PRIOR_MTBF) / 1.25  # moved, quietly
    for _ in range(3):  # a slower disk: saves cost five times as much
        auto.measured(0.05)
    (slower,) = _said(capfd)
    assert f"interval {daly_interval(0.05, PRIOR_MTBF):.1f} s" in slower, slower
    # Alive longer than the prior assumes: M is the time lived, a new reason (x 1.4 alone is quiet).
    monkeypatch.setattr(schedule, "_now", lambda: 100.0 + 2 * PRIOR_MTBF)
    auto.measured(0.05)
    (longer,) = _said(capfd)
    assert "none seen in 28800 s of this run)" in longer, longer
    # A run that fails every few seconds saves as often as it may, and says why.
    killed = [_session(i * 4.0, i * 4.0 + 3, cost=0.008, interval=2.0) for i in range(5)]
    monkeypatch.setattr(schedule, "_now", lambda: 20.0)
    AutoInterval(_history(tmp_path, killed), lambda: False, decide=True)
    (bounded,) = _said(capfd)
    assert "checkpoint interval 2.0 s (the lower bound; auto: " in bounded, bounded


def test_a_background_save_costs_the_time_it_takes_from_the_batches_beside_it(tmp_path):
    writing = False
    auto = AutoInterval(_history(tmp_path, []), lambda: writing, decide=True)
    clock = 0.0
    for _ in range(20):  # batches of 0.1 s, nothing in flight
        clock += 0.1
        auto.batch_done(clock)
    writing = True
    for _ in range(10):  # 10 batches of 0.25 s beside a background save: 1.5 s taken
        clock += 0.25
        auto.batch_done(clock)
    auto.measured(0.01)  # the next save's own stall
    assert auto.costs[-1] == pytest.approx(1.51)
    assert auto.stolen == 0.0  # counted once


def test_only_the_first_rank_decides_by_time(tmp_path):
    other = SaveSchedule(None, "auto", History(RunDirectory(tmp_path), write=False), first=False)
    assert other.every_seconds is None and not other.by_time()
    other.measured(0.3)
    assert other.every_seconds is None and not (tmp_path / "history.json").exists()


@pytest.mark.parametrize("bad", ["sometimes", 0, -1.0, float("nan"), True])
def test_checkpoint_every_seconds_is_auto_a_number_or_none(tmp_path, bad):
    with pytest.raises(ValueError, match="checkpoint_every_seconds must be 'auto', a number"):
        unbroken.Trainer(tmp_path, max_epochs=1, checkpoint_every_seconds=bad)


def _sessions(directory):
    return json.loads((directory / "history.json").read_text())["sessions"]


def test_the_trainer_records_its_processes_and_learns_from_a_crash(tmp_path, capfd):
    """A crash, a preemption and the end, as the history records them; the next run's interval
    counts the crash as a failure and starts from the measured cost."""
    with pytest.raises(Crash):
        run(tmp_path, callbacks=[CrashAt(9)], checkpoint_every_seconds="auto")
    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[SignalAt("train", 14)], checkpoint_every_seconds="auto")
    err = capfd.readouterr().err
    assert "1 failure in" in err, err  # the second process saw the first's crash
    run(tmp_path, checkpoint_every_seconds="auto")
    sessions = _sessions(tmp_path)
    assert [s["end"] for s in sessions] == [None, "preempted", "finished"]
    assert all(s["cost"] is not None and s["cost"] > 0 for s in sessions)  # steps saved
    assert all(s["start"] <= s["alive"] for s in sessions)
    assert sessions[0]["alive"] <= sessions[1]["start"] <= sessions[2]["start"]


def test_the_way_to_the_first_step_is_printed_by_phase(tmp_path, capfd, details):
    with pytest.raises(SystemExit):
        run(tmp_path, callbacks=[SignalAt("train", 5)])
    fresh = capfd.readouterr().err
    assert re.search(r"started fresh, first step after \d+\.\d\d s: .*first batch's step", fresh)
    torch.manual_seed(0)
    run(tmp_path)
    resumed = capfd.readouterr().err
    line = next(x for x in resumed.splitlines() if "resumed, first step after" in x)
    phases = dict(p.rsplit(" ", 2)[:2] for p in line.split(": ", 2)[2].split("; "))
    for phase in (
        "your code from Trainer() to fit()",
        "run directory and its lock",
        "checkpoint scan",
        "checkpoint read",
        "checkpoint restore",
        "the rest of the resume",
        "first batch",
        "first batch's step",
    ):
        assert phase in phases, (phase, line)
    total = float(re.search(r"first step after (\d+\.\d\d) s", line).group(1))
    assert sum(map(float, phases.values())) == pytest.approx(total, abs=0.02 * len(phases))


def test_process_age_is_read_on_linux():
    age = process_age()
    assert age is None or 0 < age < 24 * 3600


def test_load_latest_says_where_its_time_went(tmp_path):
    model = torch.nn.Linear(3, 2)
    with unbroken.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, {"model": model})
        restored = checkpointer.load_latest({"model": model})
    assert set(restored.seconds) == {"scan", "read", "restore"}
    assert all(0 < s < 60 for s in restored.seconds.values())


@pytest.mark.parametrize("cost, mtbf", [(10.0, 20.0), (1.5, 1.0), (3.0, 400.0)])
def test_daly_is_his_published_formula_term_by_term(cost, mtbf):
    """Daly (2006), for a save of cost d < 2M: sqrt(2dM) [1 + 1/3 sqrt(d/2M) +
    1/9 (d/2M)] - d of training, the save's d added (an interval here is save to save). At
    d/2M = 1/4 its three terms are 1, 1/6 and 1/36; the minimisation above is too flat near the
    optimum to see a wrong constant in the last."""
    x = cost / (2 * mtbf)
    published = math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost
    assert daly_interval(cost, mtbf) == pytest.approx(max(MIN_SECONDS, published + cost), rel=1e-12)
    if (cost, mtbf) == (10.0, 20.0):
        assert daly_interval(cost, mtbf) == pytest.approx(20 * (1 + 1 / 6 + 1 / 36), rel=1e-12)


def test_the_history_keeps_the_newest_sessions(tmp_path, monkeypatch):
    monkeypatch.setattr(schedule, "_now", lambda: 1e6)
    old = [
        _session(float(i), float(i) + 0.5, end="finished") for i in range(schedule.KEPT_SESSIONS)
    ]
    history = _history(tmp_path, old)
    history.begin(None)
    kept = _sessions(tmp_path)
    assert len(kept) == schedule.KEPT_SESSIONS
    assert kept[-1]["start"] == 1e6 and kept[-1]["end"] is None  # this process, recorded
    assert [s["start"] for s in kept[:-1]] == [float(i) for i in range(1, len(old))]  # oldest out


def test_a_save_between_two_batches_is_not_a_batch_beside_the_next_background_save(tmp_path):
    """The time from the last batch before a save to the first batch after it holds the save
    itself, already counted as its ``blocked`` time: the batch clock starts again after it."""
    writing = False
    auto = AutoInterval(_history(tmp_path, []), lambda: writing, decide=True)
    clock = 0.0
    for _ in range(20):  # batches of 0.1 s, nothing in flight
        clock += 0.1
        auto.batch_done(clock)
    clock += 5.0  # a save held training 5 s; its background write goes on after it
    auto.measured(5.0)
    writing = True
    for _ in range(10):  # batches of 0.1 s beside the write: it takes nothing from them
        clock += 0.1
        auto.batch_done(clock)
    assert auto.stolen == pytest.approx(0.0, abs=1e-9)
    auto.measured(0.01)
    assert auto.costs == pytest.approx([5.0, 0.01])
