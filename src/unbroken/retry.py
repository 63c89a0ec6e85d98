"""Remote I/O's retry policy and deadline, owned once, below the checkpoints and the streaming
datasets: which errors are worth another attempt (a connection that failed or timed out; not
credentials, paths or a full local disk), how many and how long apart (``retrying``: bounded
attempts, exponential backoff, then ``RemoteUnavailable`` naming the URL and the last error; a
missing object is not retried, ``FileNotFoundError`` says so at once), and how long a store may
go without answering.

**A store that stops answering** (a frozen server, a network that drops packets) must not hang
the job. Two bounds, each the user's to change:

- The client's own, per request: for S3, botocore's ``connect_timeout`` and ``read_timeout``
  (``CONNECT_TIMEOUT`` and ``READ_TIMEOUT``, at most the deadline below; ``storage_options``'
  ``config_kwargs`` override them). A request that waits longer fails, and s3fs retries it.
- The whole operation's, its retries included (``retrying(deadline=Deadline(seconds))``): an
  operation fails with ``RemoteUnavailable`` once it has gone ``seconds`` without progress.
  Each attempt runs on a helper thread while the caller waits; a transfer reports its bytes as
  they move (``progressed``), so a large upload that moves is never cut and one that stalls is.
  The attempt the caller stopped waiting for ends on its own (the client's timeouts; a transfer
  stops at its next write), and the next operation through the same ``Deadline`` waits for it
  first, so one client's operations never overlap. This bound is needed because the client's
  cannot see everything: a request whose body is blocked on a full socket has no read timeout,
  and s3fs retries each timed-out request 5 times. Cost: a thread start per attempt (docs/benchmarks/unit-costs.md,
  row ``remote_attempt_thread``).

**The global random generators are the user's.** The loader seeds them for each batch, and the
batch's samples draw from them in turn, so a library that draws from them while a sample is
fetched shifts that batch's augmentation: botocore does, for the jitter of its retries (its
``random.random()``), so a transient S3 fault used to change the weights. So:

- For S3, botocore makes one attempt per request (``config_kwargs={"retries":
  {"total_max_attempts": 1}}``, unless ``storage_options`` sets botocore's retries) and
  transient errors are retried by s3fs and by ``retrying`` here, with backoffs that draw nothing.
  That covers the prefetcher's download threads, which run beside the training loop.
- A call made by the thread that reads samples (a worker's, or the training process's main
  thread) puts Python's ``random`` state back as it was before the call (row ``keeping_random``
  of the unit costs), so a
  client of another protocol drawing for its own retries does not shift the sample's draws
  either. (A client drawing from it on a prefetch thread can, for protocols other than S3.)
"""

from __future__ import annotations

import errno
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .errors import RemoteUnavailable

T = TypeVar("T")

CONNECT_TIMEOUT = 5.0
"""Seconds an S3 client waits for a connection (s3fs's default), at most the deadline."""
READ_TIMEOUT = 15.0
"""Seconds an S3 client waits for the next bytes of an answer (s3fs's), at most the deadline."""


# Errors of the storage's client libraries that say the connection failed; s3fs lets some
# through unwrapped (botocore's EndpointConnectionError is no OSError).
_CLIENT_PACKAGES = {"botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google"}


# Errors of this machine, not of the connection: a full or read-only disk, paths, permissions.
_LOCAL_ERRNOS = {
    errno.ENOSPC,
    errno.EROFS,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EISDIR,
    errno.ENOTDIR,
}


def _transient(error: Exception) -> bool:
    """Whether a failed request may succeed if tried again: a connection that failed or timed
    out, not credentials, paths or a full local disk; not a ``RemoteUnavailable`` either: it
    is what an operation inside this one said after its own retries (retried again, the
    attempts would multiply)."""
    if isinstance(error, RemoteUnavailable):
        return False
    if isinstance(error, OSError) and error.errno in _LOCAL_ERRNOS:
        return False
    if isinstance(
        error, (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
    ):  # FileExistsError: a conditional create refused, an answer
        return False
    if isinstance(error, (OSError, TimeoutError)):
        return True
    name = type(error).__name__
    if "Credential" in name or "ParamValidation" in name or "Forbidden" in name:
        return False  # botocore's NoCredentialsError, ParamValidationError; google's 403
    return type(error).__module__.partition(".")[0] in _CLIENT_PACKAGES


def retrying(
    what: str,
    where: str,
    call: Callable[[], T],
    retries: int,
    backoff: float,
    missing: str = "",
    deadline: Deadline | None = None,
) -> T:
    """``call()``, retried ``retries`` times on errors of the connection, ``backoff * 2**k``
    seconds apart; ``what`` (a verb) and ``where`` (a URL) name it in errors, ``missing`` adds
    to the advice when the object does not exist. With a ``deadline``, the whole operation
    fails (``RemoteUnavailable``) once it has gone ``deadline.seconds`` without progress: an
    attempt that runs past it is no longer waited for, and none starts after it."""
    operation = _Operation(deadline)
    for attempt in range(retries + 1):
        try:
            return _keeping_random(lambda: operation.attempt(call))
        except _TimedOut as late:
            raise RemoteUnavailable(
                f"could not {what} {where}: {late} (remote_timeout). Check that the storage "
                "is reachable and answers (the endpoint in storage_options); give a store that "
                "is only slow a larger remote_timeout."
            ) from None
        except FileNotFoundError as error:  # not retried; said with what was asked for
            raise FileNotFoundError(
                f"could not {what} {where}: it does not exist ({error}). Check the URL (and "
                f"the bucket){', ' + missing if missing else ''}"
            ) from error
        except Exception as error:
            if not _transient(error):
                raise
            pause = backoff * 2**attempt
            if attempt == retries or not operation.allows(pause):
                raise RemoteUnavailable(
                    f"could not {what} {where} after {attempt + 1} attempt(s)"
                    f"{operation.spent()}: {type(error).__name__}: {error}. Check the URL, the "
                    "endpoint and the credentials in storage_options, and that the storage is "
                    "reachable."
                ) from error
            time.sleep(pause)
    raise AssertionError("unreachable")


class Deadline:
    """How long one client's remote operations may go without progress (``seconds``), and the
    attempts it stopped waiting for (see the module). Shared by the threads of one client;
    a copy (pickled for another process) starts with none left behind."""

    def __init__(self, seconds: float) -> None:
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
            raise ValueError(f"remote_timeout must be a number of seconds > 0, got {seconds!r}")
        self.seconds = float(seconds)
        self._lock = threading.Lock()
        self._left: list[_Attempt[Any]] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"seconds": self.seconds}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["seconds"])  # type: ignore[misc]

    def _leave(self, attempt: _Attempt[Any]) -> None:
        with self._lock:
            self._left = [left for left in self._left if not left.done.is_set()] + [attempt]

    def _settle(self, operation: _Operation) -> None:
        """Wait for the attempts left behind by earlier operations, within ``operation``'s
        deadline: they must not land after this one."""
        with self._lock:
            self._left = left = [attempt for attempt in self._left if not attempt.done.is_set()]
        for attempt in left:
            if not attempt.done.wait(max(0.0, operation.remaining())):
                raise _TimedOut(
                    f"the store has not answered an earlier request within {self.seconds:g} s"
                )


def progressed() -> None:
    """Tell the operation whose attempt runs on this thread that bytes moved: its deadline
    starts again. In an attempt no longer waited for, raise ``RemoteUnavailable`` instead, so a
    transfer that nobody waits for stops (and cleans up) at its next write. A no-op elsewhere."""
    attempt: _Attempt[Any] | None = getattr(_running, "attempt", None)
    if attempt is None:
        return
    if attempt.abandoned:
        raise RemoteUnavailable("the operation ran past its deadline and was given up")
    attempt.operation.touched = time.monotonic()


_running = threading.local()  # .attempt: the attempt running on this thread


class _TimedOut(Exception):
    """An operation ran past its deadline (said to the caller as ``RemoteUnavailable``)."""


class _Operation:
    """One call of ``retrying``: when it last made progress, against its deadline."""

    def __init__(self, deadline: Deadline | None) -> None:
        self.deadline = deadline
        self.seconds = deadline.seconds if deadline is not None else float("inf")
        self.started = self.touched = time.monotonic()

    def remaining(self) -> float:
        return self.touched + self.seconds - time.monotonic()

    def allows(self, pause: float) -> bool:
        """Whether another attempt may start after a pause of ``pause`` seconds."""
        return self.remaining() > pause

    def spent(self) -> str:
        if self.deadline is None:
            return ""
        return f" in {time.monotonic() - self.started:.1f} s"

    def attempt(self, call: Callable[[], T]) -> T:
        if self.deadline is None:
            return call()
        self.deadline._settle(self)
        attempt = _Attempt(call, self)
        try:
            while not attempt.done.wait(max(0.0, min(self.remaining(), 1.0))):
                if self.remaining() <= 0:
                    raise _TimedOut(f"the store did not answer within {self.seconds:g} s")
        except BaseException:  # the deadline, or the caller interrupted (KeyboardInterrupt)
            if not attempt.done.is_set():
                attempt.abandoned = True
                self.deadline._leave(attempt)
            raise
        return attempt.result()


class _Attempt(Generic[T]):
    """``call()`` on a daemon thread of its own (a thread stuck in a frozen store must not keep
    the interpreter from exiting)."""

    def __init__(self, call: Callable[[], T], operation: _Operation) -> None:
        self.call, self.operation = call, operation
        self.abandoned = False
        self.done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        thread = threading.Thread(target=self._run, name="unbroken-remote", daemon=True)
        thread.start()

    def _run(self) -> None:
        _running.attempt = self
        try:
            self._value = self.call()
        except BaseException as error:  # handed to the caller's thread by result()
            self._error = error
        finally:
            _running.attempt = None
            self.done.set()

    def result(self) -> T:
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._value  # type: ignore[return-value]


def filesystem(
    url: str, storage_options: dict[str, Any], deadline: float | None = None
) -> tuple[Any, str]:
    """``(fsspec filesystem, path)`` of ``url``: a filesystem of this process's own
    (``skip_instance_cache``: fsspec caches them per process, and one inherited through a fork
    would use its parent's event loop), with botocore's jittered retries off
    (``drawing_nothing``) and its timeouts set (at most ``deadline`` seconds). Raises
    ``ValueError`` or ``ImportError`` for a protocol fsspec does not know here."""
    import fsspec

    options = drawing_nothing(url, storage_options, deadline)
    fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    return fs, path


def drawing_nothing(
    url: str, storage_options: dict[str, Any], deadline: float | None = None
) -> dict[str, Any]:
    """``storage_options`` with botocore's retries (whose jitter draws from ``random``) down to
    one attempt for an S3 URL, and its connect and read timeouts (``CONNECT_TIMEOUT``,
    ``READ_TIMEOUT``, at most ``deadline``), unless the options set them (see the module)."""
    import fsspec

    protocol = fsspec.core.split_protocol(url)[0]
    if protocol not in ("s3", "s3a"):
        return storage_options
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    limit = float("inf") if deadline is None else deadline
    config.setdefault("connect_timeout", min(CONNECT_TIMEOUT, limit))
    config.setdefault("read_timeout", min(READ_TIMEOUT, limit))
    return {**storage_options, "config_kwargs": config}


def _keeping_random(call: Callable[[], T]) -> T:
    """``call()``; on the thread that reads samples, with Python's ``random`` state put back
    after it (see the module). Not on other threads: their draws would race the reader's."""
    if threading.current_thread() is not threading.main_thread():
        return call()
    state = random.getstate()
    try:
        return call()
    finally:
        random.setstate(state)
