"""The hang watchdog's parts (``train.watchdog``), in one process: the limit it derives, and when
one rank's watch counts the next rank as hung. Two watchdogs share an in-memory store, each
with its own clock; a stopped process is one whose watchdog polls no more. The whole path (a
SIGSTOPped rank under torchrun, saved for and restarted) is in test_just_in_time.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from unbroken.distributed.world import World
from unbroken.train.watchdog import FACTOR, FLOOR, LEFT, SAVED, Watchdog, hang_limit


def test_the_limit_is_the_option_or_a_multiple_of_the_slowest_interval_never_under_a_minute():
    assert FLOOR == 60.0 and FACTOR == 3.0
    assert hang_limit(0.0, None) == 60.0  # nothing measured yet
    assert hang_limit(0.05, None) == 60.0  # fast steps: the floor
    assert hang_limit(20.0, None) == 60.0
    assert hang_limit(25.0, None) == 75.0  # a 25 s save: three times it
    assert hang_limit(400.0, None) == 1200.0
    assert hang_limit(400.0, 3) == 3.0  # the option, whatever was measured
    assert hang_limit(0.0, 120.5) == 120.5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pair(hang_timeout=None):
    """Ranks 0 and 1 of 2, each watching the other, on one store, with their own clocks."""
    store, ranks = dist.HashStore(), []
    for rank in range(2):
        jit = SimpleNamespace(agreement=SimpleNamespace(world=World(rank, 2)))
        progress, clock = SimpleNamespace(ticks=0), Clock()
        watchdog = Watchdog(jit, progress, hang_timeout, store=store, clock=clock)
        ranks.append(SimpleNamespace(watchdog=watchdog, progress=progress, clock=clock))
    return ranks


def run(ranks, seconds, step=5.0, polling=(0, 1), ticking=()):
    """``seconds`` pass in polls of ``step``; the ranks in ``polling`` poll (the others are
    stopped), those in ``ticking`` also finish a batch each poll. Returns what each poll of
    rank 0 found."""
    found = []
    for _ in range(int(seconds / step)):
        for rank in polling:
            ranks[rank].clock.now += step
            if rank in ticking:
                ranks[rank].progress.ticks += 1
            result = ranks[rank].watchdog.poll()
            if rank == 0:
                found.append(result)
        for rank in set(range(2)) - set(polling):
            ranks[rank].clock.now += step  # stopped: its time passes, it does nothing
    return found


def test_a_peer_that_stops_running_while_this_rank_waits_on_it_hangs_after_the_limit():
    ranks = pair()
    run(ranks, 20, ticking=(0, 1))  # training: both beat and tick
    ranks[1].progress.ticks += 1  # rank 1 finishes tick 5, then is stopped
    # Rank 0's first poll after the stop still sees rank 1's last heartbeat arrive: from
    # there, 60 s are not more than the limit.
    assert run(ranks, 65, polling=(0,)) == [None] * 13
    ((reason, leads),) = run(ranks, 5, polling=(0,))
    assert leads
    assert reason == (
        "rank 1 hung: its process has not run for 65 s (no heartbeat in torchrun's store), "
        "while rank 0 waited on it after tick 4; the limit is 60 s (3 x the slowest interval "
        "between two batches, at least 60 s; Trainer(hang_timeout=...) sets it)"
    )


def test_ranks_that_beat_are_never_hung_however_long_a_save_or_a_step_lasts():
    ranks = pair()
    run(ranks, 20, ticking=(0, 1))
    assert set(run(ranks, 600)) == {None}  # a 10-minute save: no tick, every heartbeat
    # That save sets the derived limit: three times 600 s, once it is over.
    run(ranks, 5, ticking=(0, 1))
    assert ranks[0].watchdog.slowest == 605.0 and ranks[0].watchdog.limit == 1815.0
    assert set(run(ranks, 1800, polling=(0,))) == {None}  # rank 1 stopped, under the limit
    assert run(ranks, 20, polling=(0,))[-1] is None
    assert run(ranks, 5, polling=(0,))[-1][0].startswith("rank 1 hung")


def test_a_rank_that_makes_progress_waits_on_no_one():
    ranks = pair(hang_timeout=10)
    run(ranks, 5, step=1)
    # Rank 1's heartbeat stands still (its key stays), rank 0 goes on training: not hung.
    assert set(run(ranks, 60, polling=(0,), ticking=(0,))) == {None}


def test_a_rank_that_was_paused_itself_judges_no_one_for_that_gap():
    ranks = pair(hang_timeout=10)
    run(ranks, 10, step=1, polling=(1, 0))  # rank 0 reads each heartbeat of rank 1's
    for rank in ranks:  # the whole job paused for a minute (a suspended VM), then runs again
        rank.clock.now += 60
    assert run(ranks, 1, step=1, polling=(0,)) == [None]  # before rank 1's next heartbeat
    assert ranks[0].watchdog.slowest == 0.0  # the gap is no step of the loop either


def test_a_rank_whose_loop_ended_or_that_has_not_started_is_not_watched():
    ranks = pair(hang_timeout=10)
    assert set(run(ranks, 60, polling=(0,))) == {None}  # rank 1 never beat
    ranks[1].watchdog.store.set("beat/1", LEFT)  # what its thread writes when fit ends
    assert set(run(ranks, 60, polling=(0,))) == {None}


def test_once_a_rank_saved_for_a_hung_one_the_others_follow_it_out():
    ranks = pair(hang_timeout=10)
    run(ranks, 5, step=1)
    ranks[1].watchdog.store.set(SAVED, "rank 2 hung: ...")
    assert run(ranks, 1, step=1) == [("rank 2 hung: ...", False)]


@pytest.mark.parametrize("option", [0, -1.0, "60"])
def test_the_option_refuses_what_is_not_a_number_of_seconds(option, tmp_path):
    import unbroken

    with pytest.raises(ValueError, match="hang_timeout must be a number of seconds > 0, got"):
        unbroken.Trainer(tmp_path, max_epochs=1, hang_timeout=option)


class Held(Exception):
    """Raised by the test's stand-in for ``jit._hold``, which waits for ``os._exit``."""


def test_once_the_watchdog_acts_the_loop_changes_nothing_until_the_process_ends(monkeypatch):
    """``JustInTime.halted``: the loop's thread stops at its next optimizer step (having
    cleared ``consistent`` first, so a watchdog that reads it True saves a record the live
    objects still match), its next record and its own failure path; the watchdog's thread
    goes on through ``on_failure``."""
    import threading

    from unbroken.train import jit

    def held():
        raise Held

    monkeypatch.setattr(jit, "_hold", held)
    saves = object.__new__(jit.JustInTime)  # only the attributes these methods read
    saves.enabled, saves.consistent, saves.record, saves.halted = True, True, None, None
    saves.changing()  # not halted: a step goes on
    assert not saves.consistent
    saves.consistent, saves.halted = True, threading.get_ident() + 1  # another thread's
    with pytest.raises(Held):
        saves.changing()
    assert not saves.consistent  # cleared before it stopped
    with pytest.raises(Held):
        saves.take()
    with pytest.raises(Held):
        saves.on_failure(RuntimeError("Connection reset by peer"))
    saves.halted = threading.get_ident()  # this thread is the watchdog's
    saves.on_failure(RuntimeError("hung"))  # goes on (no record: nothing to save)
