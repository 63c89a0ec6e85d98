"""One training job per run directory in object storage: a lease in generations, renewed by a
heartbeat, that every change to the run directory passes first.

A local run directory is locked by the kernel (``lock``), which frees the lock when its holder
dies. An object store has no such lock, so the lease is objects: ``.lock.<n>`` (``n``
zero-padded) is generation ``n``, the highest generation present is the lease, and its holder is
the one job that may change the run directory. A generation is JSON naming its holder: a random
token, the host, the machine (its boot id and pid namespace), the pid and the process's start
time, torchrun's run id and restart count.

- **The only way in is a conditional create** (S3's ``If-None-Match: *``) of the generation above
  the highest: of two jobs creating it, one gets it and the other is refused (``DirectoryInUse``,
  naming the winner). Nothing is deleted to take a lease over, so two jobs taking over one stale
  lease cannot both win. The new holder deletes the generations below its own.
- **Taken at once** if its holder is known to be gone: it released the lease as it ended; its
  process on this machine is gone (pid and start time: a reused pid is another process); or this
  job is the same torchrun job restarted (the same run id, a greater restart count). **Taken
  after ``seconds``** if its holder is unknown (another machine) or alive here: at once if its
  last renewal is older than ``seconds`` by the store's own clock (read from a probe object: no
  machine's clock is trusted), else after watching it that long without a renewal. A renewal
  seen means a live holder, and the job is refused.
- **The holder renews** every ``seconds / 4`` from a daemon thread: it lists the generations
  (its own gone, or one above it, means the lease is lost: a lease deleted is never written
  again by its old holder), rewrites its own, then lists them again. At its end it marks its
  generation released, for the next job to take at once.
- **The fence.** Every write, delete, rename and upload abort of the run directory's
  ``Storage`` calls ``fence()`` first, and an upload again before it completes. It lets
  the call through if the last confirmed renewal began less than ``2/3 * seconds`` ago (on a
  clock that counts time the machine was suspended); otherwise it renews and confirms from the
  store first. A lease lost raises ``DirectoryInUse`` naming the new holder, which ends the job
  before it changes anything more. So a holder frozen past its lease (SIGSTOP, a paused VM) and
  resumed, or cut off from the store, cannot delete or overwrite what the new holder wrote.
- **A take-over that met a renewal waits.** If the generation taken over was renewed while this
  job took it (its holder woke up just then), that holder may still trust its last renewal: the
  new holder waits ``seconds`` before it writes, by which time the old one has seen the new
  generation and stopped.

Limits: the margin of ``seconds / 3`` covers a request's way to the store; a process frozen
between its fence and the store's receipt of that one request can still land it (S3 has no
fencing token). Only rank 0 of a job holds the lease; the other ranks upload checkpoint parts
unfenced, and a checkpoint commits by rank 0's manifest, which is fenced.

Costs: 3 requests to take a new run directory's lease, 7 to take a released or dead holder's
(and one per older generation deleted), 3 more (a probe object) for an unknown holder and 3 per
look while watching it; 3 requests per renewal (every 7.5 s by default); none per write while
renewals succeed. A job restarted after a crash on the same machine, or by torchrun, or after a
preemption (a released lease) starts at once; a job whose predecessor died on another machine
waits up to ``seconds`` (30 by default: ``Trainer(lease_seconds=...)``). The wait, and whose
lease was taken, is printed (``unbroken: took the lease on ... over from ... after 0.05 s``).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..checkpoint.storage import Stat, Storage, join
from ..errors import DirectoryInUse
from .lock import describe, gone, identity
from .progress import say

NAME, DIGITS = ".lock.", 12  # generation n is .lock.000000000007
_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)
_held: set[str] = set()  # the URLs whose lease this process holds or is taking
_registry = threading.Lock()


def _clock() -> float:
    """Seconds on a clock that keeps counting while the machine is suspended (Linux's
    ``CLOCK_BOOTTIME``): a paused VM must not trust a renewal from before its pause."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


def _generation(name: str) -> bool:
    return name.startswith(NAME) and name[len(NAME) :].isdigit()


class Lease:
    """This job's lease on the run directory ``directory`` (a URL; see the module), renewed
    every ``seconds / 4``. ``clock`` and ``sleep`` are the time it decides by (a clock that
    counts a suspended machine's time) and its pause between looks at a holder it watches."""

    def __init__(
        self,
        storage: Storage,
        directory: str,
        seconds: float,
        *,
        clock: Callable[[], float] = _clock,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.storage, self.directory, self.seconds = storage, directory.rstrip("/"), seconds
        # Injectable so that tests decide what time it is, not the machine's load.
        self._clock, self._sleep = clock, sleep
        self._once = storage.tried_once()
        self.me = {"token": secrets.token_hex(8), **identity()}
        self.generation = 0  # this job's, once acquired
        self.confirmed = -math.inf  # the clock as the last confirmed renewal began
        self.lost: str | None = None  # why it is no longer this job's
        self.waited = 0.0  # the seconds acquire() took
        self._renewals = 0
        self._older: list[int] = []  # the generations below this job's, to delete
        self._lock = threading.Lock()  # one confirmation at a time (the heartbeat, a fence)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # The store, through the storage's public operations (their retries and deadline).
    def _store(self) -> Storage:
        """The storage; on the heartbeat's thread, tried once (the next beat tries again), so
        that a store that does not answer keeps the heartbeat from holding up a write's own
        confirmation for a whole retry cycle."""
        return self._once if threading.current_thread() is self._thread else self.storage

    def _path(self, generation: int) -> str:
        return join(self.directory, f"{NAME}{generation:0{DIGITS}d}")

    def _body(self, released: bool = False) -> bytes:
        self._renewals += 1
        return json.dumps({**self.me, "renewal": self._renewals, "released": released}).encode()

    def _generations(self) -> list[int]:
        found = (entry.name for entry in self._store().list_directory(self.directory))
        return sorted(int(n[len(NAME) :]) for n in found if _generation(n))

    def _stat(self, generation: int) -> Stat | None:
        try:
            return self._store().stat(self._path(generation))
        except FileNotFoundError:
            return None

    def _read(self, generation: int) -> tuple[Stat, dict[str, Any]] | None:
        """A generation's ``Stat`` (its version and the store's time of its last renewal) and
        holder, ``None`` if gone."""
        stat = self._stat(generation)
        try:
            if stat is None:
                return None
            data = self._store().read_bytes(self._path(generation))
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(data)
        except ValueError:
            holder = None  # unreadable: an unknown holder
        return stat, holder if isinstance(holder, dict) else {}

    def _create(self, generation: int) -> bool:
        began = self._clock()
        try:
            self._store().create(self._path(generation), self._body())
        except FileExistsError:
            return False
        self.generation, self.confirmed = generation, began
        return True

    # Taking it.
    def acquire(self) -> None:
        key = self.directory
        with _registry:
            if key in _held:
                raise DirectoryInUse(
                    f"{self.directory} is in use by another Trainer.fit in this process (pid "
                    f"{os.getpid()}); train in another directory, or let that fit() return first."
                )
            _held.add(key)
        try:
            began = self._clock()
            taken = self._acquire()
            self.waited = self._clock() - began
        except BaseException:
            with _registry:
                _held.discard(key)
            raise
        if taken is not None:  # what a restart waited for, and why
            say(f"took the lease on {self.directory} over {taken} after {self.waited:.2f} s")
        self._collect()
        self._thread = threading.Thread(target=self._renew, name="unbroken-lease", daemon=True)
        self._thread.start()

    def _acquire(self) -> str | None:
        """Take the lease; say whose it was and why it was free (``None``: nobody's, or
        released)."""
        watched: tuple[int, Any] | None = None
        since = self._clock()
        while True:
            generations = self._generations()
            if not generations:
                self._take_over(0, None)
                return None
            top = generations[-1]
            read = self._read(top)
            if read is None:
                continue  # deleted as an older generation: a newer one is there now
            stat, holder = read
            tag, modified = stat.version, stat.modified
            why = gone(holder, self.me)
            if why is None and watched is None:
                watched, since = (top, tag), self._clock()
                why = self._stale(modified)
                if why is None:
                    say(
                        f"the lease on {self.directory} is held by {describe(holder)} (another "
                        f"machine, or alive here): waiting up to {self.seconds:g} s "
                        "(lease_seconds) for it to renew it"
                    )
            elif why is None and watched != (top, tag):
                raise self._in_use(holder, "the lease was renewed or taken while this job waited")
            elif why is None and self._clock() - since > self.seconds:
                why = f"not renewed for {self.seconds:g} s"  # its holder is gone
            if why is not None:
                self._take_over(top, tag)
                return None if holder.get("released") else f"from {describe(holder)} ({why})"
            self._sleep(min(1.0, self.seconds / 6))

    def _stale(self, modified: datetime) -> str | None:
        """Whether generation's last renewal (``modified``) is over ``seconds`` old by the
        store's clock (a probe object's time of creation)."""
        store, probe = self._store(), join(self.directory, f".lock-probe-{self.me['token']}")
        try:
            store.overwrite(probe, b"")
            now = store.stat(probe).modified
            store.delete(probe)
            age = (now - modified).total_seconds()
        except Exception:
            return None  # not known: watched instead
        # +1: the store's times are whole seconds.
        return (
            f"not renewed for {age:.0f} s by the store's clock" if age > self.seconds + 1 else None
        )

    def _take_over(self, top: int, tag: str | None) -> None:
        """Create the generation above ``top`` (last seen as ``tag``), or be refused."""
        if not self._create(top + 1):
            read = self._read(top + 1)
            raise self._in_use(read[1] if read else {}, "it took the lease first")
        seen = self._stat(top) if top else None
        if top and (seen is None or seen.version != tag):
            # Its holder renewed while this job took the lease over, and may still trust that
            # renewal: it sees the new generation within `seconds` and stops writing.
            self._sleep(self.seconds)
            self.confirm()
        listed = self._generations()
        self._check(listed)
        self._older = [generation for generation in listed if generation < self.generation]

    def _collect(self) -> None:
        """Delete the generations below this job's (best effort: they mean nothing now)."""
        for generation in self._older:
            try:
                self.storage.delete(self._path(generation))
            except Exception:
                pass

    # Holding it.
    def fence(self) -> None:
        """Return if this job may still change the run directory; else raise
        ``DirectoryInUse`` (see the module). Cheap while the heartbeat keeps up."""
        if self.lost is not None:
            raise DirectoryInUse(self.lost)
        if self._clock() - self.confirmed >= self.seconds * 2 / 3:
            self.confirm(unless_fresh=True)

    def confirm(self, unless_fresh: bool = False) -> None:
        """Renew the lease, and make sure it is still this job's (``DirectoryInUse`` if not)."""
        with self._lock:
            if self.lost is not None:
                raise DirectoryInUse(self.lost)
            began = self._clock()
            if unless_fresh and began - self.confirmed < self.seconds * 2 / 3:
                return  # the heartbeat confirmed it while this waited
            self._check(self._generations())  # never writes a lease deleted under it again
            self._store().overwrite(self._path(self.generation), self._body())
            self._check(self._generations())  # nobody took it before the renewal landed
            self.confirmed = began

    def _check(self, generations: list[int]) -> None:
        if generations[-1:] != [self.generation]:
            self._lose(generations[-1] if generations[-1:] > [self.generation] else None)

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 4):
            try:
                self.confirm()
            except DirectoryInUse as error:
                warnings.warn(f"unbroken.Trainer: {error}", stacklevel=1)
                return  # the fence stops this job's next change
            except Exception:
                continue  # not reached now: tried again; the fence does not trust it meanwhile

    def release(self) -> None:
        """Stop renewing; mark the lease released (if still this job's) for the next job to
        take at once."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        try:
            with self._lock:
                if self.lost is None and self._generations()[-1:] == [self.generation]:
                    self.storage.overwrite(self._path(self.generation), self._body(released=True))
        except Exception:
            pass  # not marked: the next job takes it as its holder's end shows, or after `seconds`
        with _registry:
            _held.discard(self.directory)

    # Errors.
    def _in_use(self, holder: dict[str, Any], why: str) -> DirectoryInUse:
        return DirectoryInUse(
            f"{self.directory} is in use by another training job ({describe(holder)}): {why}. "
            "Two jobs writing one run directory would duplicate its checkpoints and log rows. "
            "Stop that job first, or train in another directory."
        )

    def _lose(self, newer: int | None) -> None:
        if newer is None:
            why = (
                f"its lease {self._path(self.generation)} is gone (deleted, or taken over by a "
                "job that has ended since)"
            )
        else:
            read = self._read(newer)
            why = (
                f"{describe(read[1]) if read else 'another job'} took its lease over (generation "
                f"{newer}) as this job did not renew it for {self.seconds:g} s (lease_seconds: "
                "a process frozen, or cut off from the store?)"
            )
        self.lost = (
            f"the run directory {self.directory} is no longer this job's: {why}. This job stops "
            "before it changes anything more there, so the other job's checkpoints and log stay "
            "whole. Resume the run once no other job trains there."
        )
        raise DirectoryInUse(self.lost)
