"""Per-worker iterable datasets: each replica's own position travels with its batches.

The saved source is a ``WorkersPosition``: per worker ``{"state", "items", "exhausted"}`` plus
``next``, the worker whose turn is next. On resume each worker restores its own position;
workers before ``next`` in the cycle first send a placeholder that the main process drops, so
torch's round-robin continues at the right worker without renumbering workers (a dataset that
shards by ``get_worker_info()`` keeps its shard). Per-worker states cannot be redistributed, so
``num_workers`` must stay the same on resume. How a replica resumes is one class each, in
``replicas`` (``StatefulStream``, ``SamplerPatternStream``, ``ReplayStream``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ..._state import Unsaveable, check_int, schema_fields
from ...errors import CorruptState, StateMismatch
from .. import keys
from ..rng import Seeder, make_seeder
from ..states import WorkerPosition, WorkersPosition
from .base import SKIP, Cursor
from .streams import PLACEHOLDER, StreamSource, StreamWorker, Tagged, read_items

Opened = tuple[Iterator, Callable[[], Any]]
_POSITION_FIELDS = schema_fields(WorkersPosition)
_WORKER_FIELDS = schema_fields(WorkerPosition)


class ReplicaStart(NamedTuple):
    """What a worker knows when it starts its replica's epoch."""

    plan: dict  # the epoch's plan (seed, epoch, every worker's saved position, ...)
    saved: WorkerPosition  # this worker's saved position
    worker: int
    seed: Seeder  # seeds the global RNGs for the batch at an item count
    key: int  # the key of this worker's seeds
    global_rngs: tuple[str, ...]  # the worker's items, and its state after a batch


class PerWorkerStream(StreamSource):
    """The round-robin over worker replicas; subclasses say how one replica resumes."""

    def fresh(self) -> WorkersPosition:
        entry: WorkerPosition = {"state": None, "items": 0, "exhausted": False}
        return {"workers": [entry] * self.workers, "next": 0}

    # How a replica resumes: the worker side (``open``) and the check of its saved state.
    @abstractmethod
    def open(self, start: ReplicaStart) -> Opened:
        """Set the epoch and the replica's saved position on the dataset; return its items
        (continuing after the saved ones) and what gives its state after each batch."""

    @abstractmethod
    def check_state(self, state: Any, items: int, where: str) -> None:
        """Refuse a replica's saved state that this kind of stream never saves."""

    def initial_state(self) -> Any:
        return None

    def plan(self, seed: int, epoch: int, cursor: Cursor) -> dict:
        source = cursor.source
        return {
            "seed": seed,
            "epoch": epoch,
            "workers": source["workers"],
            "next": source["next"],
            "initial": self.initial_state(),
        }

    def read(self, out: StreamWorker, worker: int, workers: int) -> Iterator[Tagged]:
        plan = out._unbroken_plan
        saved = plan["workers"][worker]
        if saved["exhausted"]:
            return
        if worker < plan["next"]:
            yield Tagged(None, worker, PLACEHOLDER, None)  # its turn in this cycle already came
        seed = make_seeder(out._unbroken_rngs)
        key = keys.stream_worker(plan["seed"], plan["epoch"], worker)
        items, state = self.open(ReplicaStart(plan, saved, worker, seed, key, out._unbroken_rngs))
        count, step = saved["items"], self.batch_size or 1
        while True:
            first = count
            batch = read_items(items, step, seed, key, first, out._unbroken_rngs)
            count += len(batch)
            if not batch or (len(batch) < step and self.drop_last):
                return
            yield Tagged(out._unbroken_collate(batch, key, first), worker, count, state())

    def shorter(self, worker: int, count: int, unit: str, found: int) -> StateMismatch:
        return StateMismatch(
            "unbroken.DataLoader",
            unit,
            count,
            found,
            message=(
                f"unbroken: the state says worker {worker} of {type(self.dataset).__qualname__} had "
                f"{'drawn' if unit != 'items' else 'yielded'} {count} {unit} this epoch, but it now "
                f"yields only {found}; the dataset is not deterministic, or shorter than the one that "
                "saved the state"
            ),
        )

    # The main-process side.
    def receive(self, cursor: Cursor, tagged: Tagged) -> Any:
        if tagged.items == PLACEHOLDER:
            return SKIP
        source = cursor.source
        workers = list(source["workers"])
        count, worker = len(workers), tagged.worker
        # Round-robin: live workers whose turn came before this one's without a batch are done.
        position = source["next"]
        while position != worker:
            if not workers[position]["exhausted"]:
                workers[position] = dict(workers[position], exhausted=True)
            position = (position + 1) % count
        added = tagged.items - workers[worker]["items"]
        workers[worker] = {"state": tagged.state, "items": tagged.items, "exhausted": False}
        following = (worker + 1) % count
        while workers[following]["exhausted"] and following != worker:
            following = (following + 1) % count
        cursor.source = {"workers": workers, "next": following}
        cursor.samples += added
        return tagged.batch

    def check_saveable(self, source: Any) -> None:
        for entry in source["workers"] if isinstance(source, dict) else ():
            if isinstance(entry["state"], Unsaveable):
                raise entry["state"].error

    def check_cursor(self, cursor: Cursor, what: str) -> None:
        source, step = cursor.source, self.batch_size or 1
        field = f"{what} state field 'source"
        if (
            not isinstance(source, dict)
            or set(source) != _POSITION_FIELDS
            or not isinstance(source["workers"], list)
        ):
            raise CorruptState(
                f"{field}': expected {{'workers': [...], 'next': int}}, got {source!r:.200}",
                "source",
            )
        workers = source["workers"]
        if len(workers) != self.workers:
            saved = len(workers) if len(workers) > 1 else 0
            raise StateMismatch(
                what,
                "num_workers",
                saved,
                self.workers,
                message=(
                    f"{what}: the state was saved with num_workers={saved} ({len(workers)} dataset "
                    f"replicas) but this loader has {self.workers}. An iterable dataset's state is "
                    "per worker replica and cannot be redistributed: resume with the same "
                    "num_workers."
                ),
            )
        following = check_int(source["next"], f"{field}.next'", 0, len(workers) - 1)
        for i, entry in enumerate(workers):
            where = f"{field}.workers[{i}]"
            if not isinstance(entry, dict) or set(entry) != _WORKER_FIELDS:
                raise CorruptState(
                    f"{where}': expected {{'state', 'items', 'exhausted'}}, got {entry!r:.200}",
                    "source",
                )
            count = check_int(entry["items"], f"{where}.items'")
            if not isinstance(entry["exhausted"], bool):
                raise CorruptState(
                    f"{where}.exhausted': expected a bool, got {entry['exhausted']!r:.100}",
                    "source",
                )
            self.check_state(entry["state"], count, f"{where}.state'")
        items = [entry["items"] for entry in workers]
        # Only a worker's last batch may be partial, and drop_last drops it: its batches are
        # its items in batches of `step`, rounded up.
        counts = [-(-n // step) for n in items]
        if self.drop_last and any(n % step for n in items):
            raise CorruptState(
                f"{what} state is inconsistent: with drop_last, every worker's "
                f"items {items} are whole batches of {step}; the state is corrupt"
            )
        if cursor.samples != sum(items) or cursor.batches != sum(counts):
            raise CorruptState(
                f"{what} state is inconsistent: samples={cursor.samples} and "
                f"batches={cursor.batches}, but the workers' items {items} make {sum(items)} "
                f"samples in {sum(counts)} batches of {step}; the state is corrupt"
            )
        _check_round_robin(workers, counts, following, f"{field}'")
        if any(items):
            self.warn_resume()

    def warn_resume(self) -> None:
        """Say what a resume costs, if it is more than O(1)."""


def _check_round_robin(workers: list, counts: list, following: int, where: str) -> None:
    """Workers take turns by index, starting each cycle at worker 0, and the one at ``next`` is
    live. With k the batches of that worker: live workers before it have k + 1, live ones after
    it k; an exhausted one found empty in this cycle (before it) at most k, one found empty in
    an earlier cycle (after it) at most k - 1."""
    live = [not entry["exhausted"] for entry in workers]
    k = counts[following]
    ok = live[following] and all(
        (count == k + (i < following)) if live[i] else (count <= k - (i > following))
        for i, count in enumerate(counts)
    )
    if not ok:
        exhausted = [entry["exhausted"] for entry in workers]
        raise CorruptState(
            f"{where}: next={following}, the workers' batches {counts} and exhausted "
            f"{exhausted} are not a position of torch's round-robin over workers; the state "
            "is corrupt",
            "source",
        )
