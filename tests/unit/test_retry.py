"""``unbroken.retry.retrying``, the one retry policy of remote I/O: the global ``random`` is the
user's (the loader seeds it for each batch and the samples draw from it), so retrying a call
draws nothing from it, neither for its backoff nor, on the thread that reads samples, through
a client library drawing for its own retries; transient errors are retried a bounded number of
times, backing off, then raised as ``RemoteUnavailable`` naming the URL."""

from __future__ import annotations

import random
import threading
import time

import pytest

from unbroken.errors import RemoteUnavailable
from unbroken.retry import retrying


class _Flaky:
    """Fails with a refused connection ``failures`` times, then answers; ``draws``: each
    attempt draws from ``random`` first, as botocore's retry jitter does."""

    def __init__(self, failures: int, draws: bool = False) -> None:
        self.failures, self.draws, self.attempts = failures, draws, 0

    def __call__(self) -> str:
        self.attempts += 1
        if self.draws:
            random.random()
        if self.attempts <= self.failures:
            raise ConnectionRefusedError(f"attempt {self.attempts} refused")
        return "answer"


def _keeps_random(run) -> None:
    random.seed(1234)
    before = random.getstate()
    run()
    assert random.getstate() == before, "retrying drew from the user's random"


@pytest.mark.parametrize("thread", ["main", "prefetch"])
def test_a_retried_call_backs_off_without_drawing_from_random(thread):
    flaky = _Flaky(failures=3)
    results: list[str] = []

    def call() -> None:
        results.append(retrying("download", "s3://bucket/key", flaky, retries=4, backoff=0.001))

    if thread == "main":
        _keeps_random(call)
    else:  # a prefetch thread, beside the thread that reads samples
        worker = threading.Thread(target=call)
        _keeps_random(lambda: (worker.start(), worker.join()))
    assert results == ["answer"] and flaky.attempts == 4


def test_a_client_drawing_for_its_own_retries_leaves_random_as_it_was():
    flaky = _Flaky(failures=2, draws=True)
    _keeps_random(lambda: retrying("list", "s3://bucket/run", flaky, retries=2, backoff=0.001))
    assert flaky.attempts == 3


def test_retries_are_bounded_and_back_off_exponentially():
    flaky = _Flaky(failures=10)
    started = time.perf_counter()
    with pytest.raises(RemoteUnavailable, match=r"could not upload s3://b/k after 4 attempt"):
        retrying("upload", "s3://b/k", flaky, retries=3, backoff=0.02)
    assert flaky.attempts == 4
    assert time.perf_counter() - started >= 0.02 * (1 + 2 + 4)
