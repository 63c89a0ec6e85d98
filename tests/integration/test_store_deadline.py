"""``retrying``'s deadline, by itself (no store): an operation fails once it has gone
``Deadline.seconds`` without progress, whatever its attempt is blocked in; a transfer that
reports progress is never cut; no attempt starts past the deadline; the attempt given up is no
longer waited for, stops at its next progress, and the next operation waits for it first, so
one client's operations never overlap."""

from __future__ import annotations

import threading
import time

import pytest

from unbroken.errors import RemoteUnavailable
from unbroken.retry import Deadline, drawing_nothing, progressed, retrying

SECONDS = 0.5


def test_a_call_that_never_answers_fails_within_the_deadline():
    release = threading.Event()
    started = time.monotonic()
    try:
        with pytest.raises(RemoteUnavailable, match=r"could not list s3://b/run: the store did"):
            retrying("list", "s3://b/run", release.wait, 3, 0.01, deadline=Deadline(SECONDS))
        assert time.monotonic() - started < SECONDS + 1.0
    finally:
        release.set()


def test_a_transfer_that_moves_is_not_cut_and_one_that_stops_is():
    def moving() -> str:
        for _ in range(int(4 * SECONDS / 0.05)):  # four deadlines long, moving all along
            time.sleep(0.05)
            progressed()
        return "done"

    assert retrying("upload", "s3://b/k", moving, 0, 0.01, deadline=Deadline(SECONDS)) == "done"
    stopped_at: list[float] = []

    def stalls() -> None:
        for _ in range(4):
            time.sleep(0.05)
            progressed()
        stopped_at.append(time.monotonic())
        threading.Event().wait(5 * SECONDS)  # nothing moves any more

    with pytest.raises(RemoteUnavailable, match="did not answer"):
        retrying("upload", "s3://b/k", stalls, 0, 0.01, deadline=Deadline(SECONDS))
    assert time.monotonic() - stopped_at[0] < SECONDS + 1.0


def test_no_attempt_starts_past_the_deadline():
    attempts = []

    def refused() -> None:
        attempts.append(time.monotonic())
        raise ConnectionRefusedError("refused")

    with pytest.raises(RemoteUnavailable, match=r"after 3 attempt\(s\) in"):
        retrying("read", "s3://b/k", refused, 10, 0.15, deadline=Deadline(SECONDS))
    assert len(attempts) == 3  # backoffs 0.15 and 0.3 fit in 0.5 s; 0.6 more would not


def test_an_operation_inside_one_that_already_gave_up_is_not_retried_again():
    inner = []

    def outer() -> None:  # e.g. an upload that checks a lease object before it completes
        retrying("read", "s3://b/.lock", lambda: inner.append(1) or _refuse(), 2, 0.001)

    with pytest.raises(RemoteUnavailable, match=r"could not read s3://b/.lock after 3 attempt"):
        retrying("upload", "s3://b/k", outer, 4, 0.001, deadline=Deadline(SECONDS))
    assert len(inner) == 3  # not 3 x 5


def _refuse() -> None:
    raise ConnectionRefusedError("refused")


def test_the_attempt_given_up_stops_at_its_next_progress_and_the_next_call_waits_for_it():
    deadline = Deadline(SECONDS)
    release, events = threading.Event(), []

    def stuck() -> None:
        release.wait()  # a request to a frozen store
        events.append("stuck answered")
        try:
            progressed()  # its next write
        except RemoteUnavailable:
            events.append("stuck stopped")
            raise

    with pytest.raises(RemoteUnavailable):
        retrying("upload", "s3://b/k", stuck, 0, 0.01, deadline=deadline)
    threading.Timer(SECONDS / 2, release.set).start()  # the store answers again
    assert retrying(
        "list", "s3://b", lambda: events.append("next") or 1, 0, 0.01, deadline=deadline
    )
    assert events == ["stuck answered", "stuck stopped", "next"]
    # One still stuck past the next call's own deadline: that call fails without starting.
    release.clear()
    with pytest.raises(RemoteUnavailable):
        retrying("upload", "s3://b/k", release.wait, 0, 0.01, deadline=deadline)
    ran = []
    with pytest.raises(RemoteUnavailable, match="has not answered an earlier request"):
        retrying("list", "s3://b", lambda: ran.append(1), 0, 0.01, deadline=deadline)
    release.set()
    assert ran == []


def test_a_deadline_is_a_positive_number_and_sets_the_clients_timeouts():
    with pytest.raises(ValueError, match="remote_timeout must be a number of seconds > 0"):
        Deadline(0)
    config = drawing_nothing("s3://b/k", {}, 2.0)["config_kwargs"]
    assert (config["connect_timeout"], config["read_timeout"]) == (2.0, 2.0)
    mine = {"config_kwargs": {"read_timeout": 300}}
    assert drawing_nothing("s3://b/k", mine, 2.0)["config_kwargs"]["read_timeout"] == 300
    assert "config_kwargs" not in drawing_nothing("gs://b/k", {}, 2.0)
