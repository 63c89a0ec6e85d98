"""``CSVLog``: an append-only metrics log that a resume rewinds to the checkpoint.

A run killed after its last checkpoint has logged rows that the resumed run will log again.
The log's state is its size in bytes when the checkpoint was taken and the sha256 of those
bytes (``{"bytes": n, "sha256": hex}``): the checkpoint's seal covers the log up to there.
Loading it checks that the file's first ``n`` bytes still hash to it (a changed digit or a
replaced file is a ``CorruptState`` naming both hashes, never a resume over other rows), then
truncates the file back to ``n`` bytes, so the file after a resume is byte for byte the
uninterrupted run's. A state saved without the hash (``{"bytes": n}``, by unbroken before it
recorded one) loads with a warning: its rows are checked by size only.
Values are written with ``repr`` (shortest round-trip form), so equal floats give equal text.

Rows are long-format ``step,epoch,phase,name,value``: new names never change the header.
Cost: one ``write`` per value, handed to the OS (one ``write`` call, no fsync) once per
``RunLog.log``: on logged batches only; one ``fsync`` and one sha256 update per checkpoint (a
running hash over the rows logged since the last one, kept in memory until then: a checkpoint
never rereads the log); one read of the log's kept part at a resume.

``open_tensorboard`` does the same for TensorBoard when it is installed: events are stepped by
the loop's tick count, and a resumed writer purges the events its killed predecessor wrote
after the checkpoint (TensorBoard's ``purge_step``), so the curves show no replayed stretch.
``RunLog`` is where the Trainer's values go: both, and the latest value of each. It takes
tensors as they are and reads each on the host once, when it writes it (a sync on a GPU): the
Trainer calls it on the batches it logs (every ``log_every``) and at the end of each phase.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptState
from .rundir import METRICS, TENSORBOARD, RunDirectory

HEADER = "step,epoch,phase,name,value\n"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def prefix_sha256(path: str | os.PathLike, size: int) -> Any:
    """The running sha256 of the first ``size`` bytes of file ``path`` (``hashlib``'s object,
    to be updated further).

    Raises:
        OSError: the file cannot be read, or holds fewer than ``size`` bytes.
    """
    with open(path, "rb") as file:
        return read_sha256(file, size, str(path))


def read_sha256(file: Any, size: int, name: str) -> Any:
    """The running sha256 of the next ``size`` bytes read from the binary ``file`` (a local
    file, or a store's object opened for reading), in parts of 4 MiB.

    Raises:
        OSError: ``file`` (named ``name`` in the message) ends before ``size`` bytes.
    """
    digest, left = hashlib.sha256(), size
    while left and (chunk := file.read(min(left, 1 << 22))):
        digest.update(chunk)
        left -= len(chunk)
    if left:
        raise OSError(f"{name} holds {size - left} bytes, fewer than {size}")
    return digest


def line(step: int, epoch: int, phase: str, name: str, value: float) -> str:
    """A row of the log, as ``CSVLog.log`` writes it."""
    return f"{step},{epoch},{phase},{name},{float(value)!r}\n"


def log_state(path: str | os.PathLike, size: int) -> dict[str, Any]:
    """A log's state as ``CSVLog.state_dict`` records it, read from the file: for a rank that
    saves for the job with rank 0's log (``train.jit``). A file it cannot read gives the state
    without its hash (a resume then warns, and checks the size only)."""
    try:
        return {"bytes": size, "sha256": prefix_sha256(path, size).hexdigest()}
    except OSError:
        return {"bytes": size}


class CSVLog:
    """``publish(size)``, if given, is called with the size each state records (and ``None``
    when the log closes): a run directory in object storage uploads the file then (``rundir``).
    ``name``: where the log lives, for errors (the object's URL, when ``path`` is a local working
    copy of it)."""

    def __init__(
        self,
        path: str | os.PathLike,
        publish: Callable[[int | None], None] | None = None,
        name: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.name = name or str(self.path)
        self.publish = publish
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", encoding="utf-8", newline="")
        # The sha256 of the bytes logged so far, updated as rows are written; None while not
        # known (a log opened with rows in it, before its state is loaded or it restarts).
        self._sha256: Any = None
        self._unhashed: list[bytes] = []  # rows logged since, not yet in ``_sha256``
        if fresh:
            self._file.write(HEADER)
            self._file.flush()
            self._sha256 = hashlib.sha256(HEADER.encode())
        # The bytes logged so far (what ``state_dict`` records), counted as they are written:
        # the ranks' agreements carry it every batch, without a flush or a seek.
        self.size = self.path.stat().st_size

    def log(self, step: int, epoch: int, phase: str, name: str, value: float) -> None:
        row = line(step, epoch, phase, name, value)
        self._file.write(row)
        data = row.encode()
        self.size += len(data)
        if self._sha256 is not None:
            self._unhashed.append(data)  # hashed at the next state_dict, in one update

    def flush_buffer(self) -> None:
        """Hand what was logged to the OS (no fsync): it outlives this process, not the machine."""
        self._file.flush()

    def flush(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()
            if self.publish is not None:
                self.publish(None)

    def restart(self) -> None:
        """Empty the log: a run with no checkpoint to resume from starts again from zero, so
        rows that a killed process logged before its first checkpoint are not kept."""
        self._file.flush()
        self._file.truncate(0)
        self._file.seek(0)
        self._file.write(HEADER)
        self._file.flush()
        self.size, self._sha256 = len(HEADER), hashlib.sha256(HEADER.encode())
        self._unhashed.clear()

    def state_dict(self) -> dict:
        """``{"bytes": n, "sha256": hex}``: the log's size and the sha256 of its bytes."""
        self._file.flush()
        size = self._file.tell()
        if self._sha256 is None or size != self.size:  # not known, or written around log()
            self._sha256 = prefix_sha256(self.path, size)
            self.size = size
        else:
            self._sha256.update(b"".join(self._unhashed))
        self._unhashed.clear()
        if self.publish is not None:
            self.publish(size)  # before the checkpoint that records it commits
        return {"bytes": size, "sha256": self._sha256.hexdigest()}

    def load_state_dict(self, state: dict) -> None:
        """Check the log's first ``bytes`` against the state's sha256, then cut it there.

        Raises:
            CorruptState: the state is malformed, or the file is shorter than it records or
                its first bytes hash otherwise (the log was changed since the checkpoint).
        """
        size = state.get("bytes") if isinstance(state, dict) else None
        if not isinstance(size, int) or size < len(HEADER):
            raise CorruptState(
                f"CSVLog state: expected {{'bytes': int >= {len(HEADER)}}}, got {state!r}",
                field="bytes",
            )
        saved = state.get("sha256")
        if saved is not None and not (isinstance(saved, str) and _SHA256.fullmatch(saved)):
            raise CorruptState(
                f"CSVLog state: expected 'sha256' to be 64 hex digits, got {saved!r}",
                field="sha256",
            )
        self._file.flush()
        current = self.path.stat().st_size
        if current < size:
            raise CorruptState(
                f"{self.name} has {current} bytes but the checkpoint says {size} were logged: "
                "the log was truncated or replaced since (or deleted). Restore it (from a copy, "
                "or an earlier version of the object if the store keeps them) and start again, "
                "or train in a new run directory"
            )
        found = prefix_sha256(self.path, size)
        if saved is None:
            warnings.warn(
                f"unbroken: the checkpoint records that {self.name} held {size} bytes but no "
                "sha256 of them (it was saved by an earlier version of unbroken): those rows "
                "are kept as they are, checked by their size only. The next checkpoint "
                "records their sha256.",
                stacklevel=2,
            )
        elif found.hexdigest() != saved:
            raise CorruptState(
                f"{self.name} changed since the checkpoint was taken: the sha256 of its first "
                f"{size} bytes (the rows logged up to the checkpoint) is {found.hexdigest()}, "
                f"and the checkpoint says {saved}. Rows were edited or the file replaced. "
                "Restore it (from a copy, or an earlier version of the object if the store "
                "keeps them) and start again, or train in a new run directory",
                field="sha256",
            )
        self._cut(size, found)

    def _cut(self, size: int, digest: Any) -> None:
        """Truncate the log to ``size`` bytes, ``digest`` being their running sha256."""
        self._file.truncate(size)  # rows logged after the checkpoint are logged again on resume
        self._file.seek(size)
        self.size, self._sha256 = size, digest
        self._unhashed.clear()

    @staticmethod
    def read(path: str | os.PathLike) -> list[dict]:
        """The rows of a log, e.g. ``[r for r in CSVLog.read(p) if r["name"] == "loss"]``."""
        lines = Path(path).read_text(encoding="utf-8").splitlines()[1:]
        rows = []
        for line in lines:
            step, epoch, phase, name, value = line.split(",")
            rows.append(
                {
                    "step": int(step),
                    "epoch": int(epoch),
                    "phase": phase,
                    "name": name,
                    "value": float(value),
                }
            )
        return rows


def open_tensorboard(wanted: bool | None, directory: Path, purge_from: int) -> Any:
    """A ``SummaryWriter`` that purges earlier sessions' events from step ``purge_from`` on.

    ``wanted=None`` writes only if TensorBoard is installed, ``True`` requires it, ``False``
    gives None.
    """
    if wanted is False:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if wanted:
            raise ImportError(
                "Trainer(tensorboard=True) needs the tensorboard package: pip install tensorboard"
            ) from None
        return None
    return SummaryWriter(str(directory), purge_step=purge_from)


@dataclass(frozen=True)
class LossRow:
    """Where the loop logged a batch's loss, the number the ranks' agreement carries for each
    rank: a survivor can write rank 0's row of it (``train.jit``)."""

    index: int  # the row's place among the rows logged (``RunLog.rows``)
    tick: int  # the loop's tick it was logged at
    step: int
    epoch: int
    phase: str


class RunLog:
    """The Trainer's values: each to the CSV log, TensorBoard (if any; its writer computes a
    pure-Python CRC per value without TensorFlow: row ``tensorboard_value`` of the unit costs)
    and ``latest``. ``write=False`` (ranks other
    than 0 of a data-parallel job) keeps ``latest`` only: one rank writes the run's files."""

    def __init__(
        self,
        run: RunDirectory,
        tensorboard: bool | None,
        latest: dict[str, float],
        write: bool = True,
    ) -> None:
        self.csv = None
        if write:
            run.download(METRICS)  # a URL's: the log so far, cut back when the state loads
            publish = (lambda size: run.upload(METRICS, size)) if run.remote else None
            name = run.remote_name(METRICS) if run.remote else None
            self.csv = CSVLog(run.local / METRICS, publish, name)
        self.run, self.directory, self.tensorboard = run, run.local, tensorboard
        self.write = write
        self.board: Any = None
        self.latest = latest
        self.rows = 0  # values logged, on every rank (rank 0 writes them): ``train.jit`` counts
        self.loss_row: LossRow | None = None  # the last batch loss the loop logged

    def open_board(self, purge_from: int) -> None:
        if self.write:
            self.board = open_tensorboard(
                self.tensorboard, self.directory / TENSORBOARD, purge_from
            )

    def restart(self) -> None:
        """A fresh run: empty the CSV log (``CSVLog.restart``)."""
        if self.csv is not None:
            self.csv.restart()

    def log(
        self,
        values: Mapping[str, Any],
        phase: str,
        step: int,
        epoch: int,
        tick: int,
        carried: bool = False,
    ) -> None:
        """Write ``values`` (floats, or one-element tensors: read here) at ``step`` of ``phase``;
        TensorBoard steps them by ``tick``, the loop's count of all batches. ``carried``: the
        loop's own values of a batch, whose ``"loss"`` the ranks' agreement carried."""
        for name, value in values.items():
            number = float(value)  # the one host read of a logged tensor
            if self.csv is not None:
                self.csv.log(step, epoch, phase, name, number)
            if carried and name == "loss":
                self.loss_row = LossRow(self.rows, tick, step, epoch, phase)
            self.latest[f"{phase}/{name}"] = number
            self.rows += 1
            if self.board is not None:
                self.board.add_scalar(f"{phase}/{name}", number, global_step=tick)
        if self.csv is not None:
            # In the file as soon as logged, before the callbacks run: should rank 0 die in
            # one, a survivor saving for it finds the rows there (``train.jit``).
            self.csv.flush_buffer()

    def flush_board(self) -> None:
        if self.board is not None:
            self.board.flush()  # what a checkpoint says was logged must be on disk
            self.run.upload_tree(TENSORBOARD)  # and in the store, for a URL

    def close(self) -> None:
        if self.csv is not None:
            self.csv.close()
        if self.board is not None:
            self.board.close()
            self.run.upload_tree(TENSORBOARD)
