"""One training job per run directory in object storage: a lease object with a heartbeat.

A local run directory is locked by the kernel (``lock``), which frees the lock when its holder
dies. An object store has no such lock, so the holder writes ``.lock`` with a conditional
create (S3's ``If-None-Match: *``: of two jobs creating it, one fails) and rewrites it every
``seconds / 3`` from a daemon thread. A job that finds ``.lock`` held:

- takes it over at once if its last renewal is older than ``seconds`` by the store's own clock
  (read from a probe object written for the purpose: no machine's clock is trusted);
- otherwise watches it for up to ``seconds``: a renewal means a live holder, and the job is
  refused (``DirectoryInUse``, naming the holder); none means the holder died (SIGKILL, a lost
  machine), and the job takes the lease over.

So a job restarted at once after its predecessor was killed waits at most ``seconds`` (30 by
default: ``Trainer(lease_seconds=...)``). Taking over deletes the stale lease and creates a new
one conditionally, so of two jobs taking over together one is refused. A holder that could not
renew for longer than ``seconds`` (a network partition) may have lost its lease to another job:
it warns when it finds the lease no longer its own.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
import warnings
from typing import Any

from ..checkpoint.objects import ObjectStorage
from ..checkpoint.storage import join, parent
from ..errors import DirectoryInUse

NAME = ".lock"


class Lease:
    def __init__(self, storage: ObjectStorage, directory: str, seconds: float) -> None:
        self.storage, self.path, self.seconds = storage, join(directory, NAME), seconds
        self.token = secrets.token_hex(8)
        self._renewals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        self._renewals += 1
        holder = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid()}
        return json.dumps({**holder, "renewal": self._renewals}).encode()

    def acquire(self) -> None:
        fs, path = self.storage.fs, self.path
        watched: tuple[Any, Any] | None = None
        since = time.monotonic()
        while True:
            try:
                self.storage._call(
                    "lock", path, lambda: fs.pipe_file(path, self._body(), mode="create")
                )
                break
            except FileExistsError:
                pass
            try:
                info = self.storage._call("look at", path, lambda: fs.info(path, refresh=True))
            except FileNotFoundError:
                continue  # released meanwhile: create it again
            seen = (info.get("ETag"), info.get("LastModified"))
            if watched is None:
                watched, since = seen, time.monotonic()
                if self._stale(info):
                    self._take_over()
                    continue
            elif seen != watched:
                raise DirectoryInUse(
                    f"{parent(path)} is in use by another training job ({self._holder()}): it "
                    f"renewed its lease ({path}) while this job waited. Two jobs writing one "
                    "run directory would duplicate its checkpoints and log rows. Stop that job "
                    "first, or train in another directory."
                )
            elif time.monotonic() - since > self.seconds:
                self._take_over()  # not renewed for a whole lease: its holder is gone
                watched = None
                continue
            time.sleep(min(1.0, self.seconds / 6))
        self._thread = threading.Thread(target=self._renew, name="unbroken-lease", daemon=True)
        self._thread.start()

    def _stale(self, info: dict[str, Any]) -> bool:
        """Whether the lease was last renewed over ``seconds`` ago by the store's clock."""
        fs, probe = self.storage.fs, f"{self.path}-probe-{self.token}"
        try:
            self.storage._call("probe", probe, lambda: fs.pipe_file(probe, b""))
            now = fs.info(probe, refresh=True).get("LastModified")
            fs.rm_file(probe)
        except Exception:
            return False  # not known: watch it instead
        modified = info.get("LastModified")
        if now is None or modified is None:
            return False
        return bool((now - modified).total_seconds() > self.seconds + 1)  # +1: whole seconds

    def _take_over(self) -> None:
        try:
            self.storage.fs.rm_file(self.path)
        except FileNotFoundError:
            pass

    def _holder(self) -> str:
        try:
            holder = json.loads(self.storage.fs.cat_file(self.path))
            return f"pid {holder['pid']} on {holder['host']}"
        except Exception:
            return "holder unknown"

    def _mine(self) -> bool:
        try:
            return bool(json.loads(self.storage.fs.cat_file(self.path))["token"] == self.token)
        except Exception:
            return False

    def _renew(self) -> None:
        fs, path = self.storage.fs, self.path
        while not self._stop.wait(self.seconds / 3):
            try:
                if not fs.exists(path):  # lost with the store's data (or deleted): take it again
                    try:
                        fs.pipe_file(path, self._body(), mode="create")
                    except FileExistsError:
                        pass  # another job made it meanwhile: said below
                if not self._mine():
                    warnings.warn(
                        f"unbroken.Trainer: the lease on {parent(path)} is no longer this job's "
                        f"(it could not renew it for {self.seconds} s?): another job may be "
                        "writing the run directory",
                        stacklevel=1,
                    )
                    return
                fs.pipe_file(path, self._body())
            except Exception:
                continue  # a failed renewal is tried again; the lease lasts `seconds`

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._mine():
                try:
                    self.storage.fs.rm_file(self.path)
                except Exception:
                    pass  # it lapses after `seconds`
