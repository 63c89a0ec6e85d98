"""``unbroken.DataLoader``: torch's DataLoader, resumable exactly; O(1) for map-style datasets.

It wraps a real ``torch.utils.data.DataLoader`` (workers, pinning, prefetching are torch's)
around a *source* of batches (``sources``: one class per kind of dataset and sampler), chosen
once by ``make_source``; the epoch protocol is ``EpochIterable``'s (``epochs``). For each
iteration the loader seeds torch's worker seeds, lets the source plan the epoch from the cursor
(``begin``), starts the inner loader and moves the cursor as each batch is *received*: batches
prefetched by workers are never counted, so ``state_dict()`` describes exactly what the user
received.

State: ``LoaderState`` (``states``), a few integers plus the source's part (a user sampler's
or the dataset's own state, if it has one).
Per-batch cost: see benchmarks/RESULTS.md (the batch sampler's generator, the fetch wrapper,
the cursor), plus the per-batch seeding described in the README's "Randomness" section
(``global_rngs`` chooses it) and, with ``num_workers=0``, ~2 us to put the training process's
torch generator back.
"""

from __future__ import annotations

import secrets
from collections.abc import Generator, Iterable
from typing import Any

import torch

from .._state import StateReader, same
from ..distributed.sharding import world_of
from ..errors import CorruptState, StateMismatch
from . import keys
from .epochs import EpochIterable
from .orders import NativeOrder
from .ranks import RANK_FIELDS, check_ranks, rank_fields
from .rng import GLOBAL_RNGS, check_global_rngs
from .select import make_source
from .sources import SKIP, Cursor
from .states import LOADER, LoaderState
from .streams import StreamSource
from .workers import signals_blocked, worker_init

_SEED_LIMIT = 1 << 64


class DataLoader(EpochIterable[Cursor]):
    """A drop-in for ``torch.utils.data.DataLoader`` whose position survives a restart.

    Takes torch's arguments plus keyword-only ``seed`` and ``global_rngs``:

    - ``seed``: the run's data seed (an int in [0, 2**64)). The shuffle order and every
      sample's randomness derive from it. ``None`` picks a random one (or
      ``generator.initial_seed()`` if a ``generator`` is given); ``load_state_dict`` then
      adopts the saved seed, so a restarted run continues the same order.
    - ``global_rngs``: which process-global generators are seeded before each batch:
      any of ``("torch", "numpy", "random")`` (the default, all three). Leaving one out saves
      its seeding cost (about 1.2 us per batch for torch, 1.5 us for numpy, 4 us for
      ``random``; the README's "Randomness" section) but makes draws from it inside
      ``__getitem__`` depend on the worker, so they no longer repeat after a resume;
      ``unbroken.sample_rng()`` and ``unbroken.sample_seed()`` stay exact either way.
    - ``rank``, ``world_size``: data parallelism (``unbroken.distributed.sharding``). Taken
      from the initialized ``torch.distributed`` process group when left out. A map-style
      dataset in unbroken's own order then gives each rank its share of every global batch of
      one global order; the state is the global cursor, the same on every rank, and resumes on
      any number of ranks. ``seed`` must be given when there is more than one rank. A
      global-cursor stream with ``len()`` is split too. Other iterable datasets (with their
      own state, or a Hugging Face stream split by ``split_dataset_by_node``) and user samplers
      are iterated by each rank on its own (``unbroken.data.ranks``): on more than one rank
      their state records ``rank`` and ``world_size`` in its fingerprint and resumes only on
      the rank and world size that saved it (each rank loads its own state); another rank,
      another world size or a single process's state is refused with a ``StateMismatch``.

    ``iter(loader)`` continues the epoch a ``load_state_dict`` restored, and otherwise starts
    the next epoch (the first is epoch 0).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Iterable | None = None,
        batch_sampler: Iterable | None = None,
        num_workers: int = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        global_rngs: Iterable[str] = GLOBAL_RNGS,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not in_order:
            raise ValueError(
                "unbroken.DataLoader needs in_order=True: batches delivered out of order would make "
                "the received position ambiguous, so a resume could repeat or skip batches"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.global_rngs = check_global_rngs(global_rngs)
        self.seed = _check_seed(seed, generator)
        self._seed_given = seed is not None or generator is not None
        self.sampler, self.batch_sampler = sampler, batch_sampler
        ranks = world_of(rank, world_size)
        if ranks is not None and ranks[1] > 1 and not self._seed_given:
            raise ValueError(
                f"unbroken.DataLoader on {ranks[1]} ranks needs seed=: every rank derives the same "
                "global order from it (a random seed would differ between ranks)"
            )
        self.rank, self.world_size = ranks if ranks is not None else (0, 1)
        self._source = make_source(
            dataset, batch_size, shuffle, sampler, batch_sampler, drop_last, num_workers, ranks
        )
        self._rank_fields = rank_fields(self._source, ranks)  # per-rank sources on W > 1 ranks
        self._plans_reads = self._source if isinstance(self._source, NativeOrder) else None
        if isinstance(self._source, StreamSource):
            persistent_workers = False  # each epoch starts every worker from another state

        # The inner loader draws its workers' base seed from this private generator, never from
        # torch's global one, so iterating a loader leaves the training process's RNG untouched.
        self._worker_seeds = torch.Generator()
        self._user_worker_init = worker_init_fn
        inner_dataset, batching = self._source.torch_dataset(
            dataset, collate_fn, batch_size, self.global_rngs
        )
        self._inner = torch.utils.data.DataLoader(
            inner_dataset,
            **batching,
            num_workers=num_workers,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,  # wrapped by _run, which starts the workers
            multiprocessing_context=multiprocessing_context,
            generator=self._worker_seeds,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )
        self._init_epochs()

    def __len__(self) -> int:
        """Batches in a whole epoch (like torch's DataLoader), not in what remains of it."""
        return len(self._source)

    def _start_position(self, ended: Cursor | None) -> Cursor:
        return Cursor(source=self._source.fresh())

    def _run(self, cursor: Cursor, epoch: int) -> Generator[Any, None, Any]:
        self._worker_seeds.manual_seed(keys.torch_workers(self.seed, epoch))
        receive = self._source.begin(self.seed, epoch, cursor)
        if self.num_workers == 0:
            batches = iter(self._inner)
        else:
            # Workers ignore the preemption signals, which the training process may handle now
            # but not when the loader was built; see workers.
            self._inner.worker_init_fn = worker_init(self._user_worker_init)
            with signals_blocked():
                batches = iter(self._inner)
        # A dataset that plans its reads (a streaming dataset's prefetch) is told the exact
        # future order once the workers exist (so no thread of it is forked into them).
        plans = self._plans_reads
        plan = plans.plan_reads(self.seed, epoch, cursor) if plans is not None else None
        held: list = []  # as in EpochIterable: no frame keeps a batch the user has dropped
        try:
            for batch in batches:
                batch = receive(cursor, batch)  # the cursor moves when the user receives it
                if batch is SKIP:
                    continue
                cursor.batches += 1
                held.append(batch)
                del batch
                yield held.pop()
        finally:
            if plan is not None:
                plan.close()

    def state_dict(self) -> LoaderState:
        """What the user has received so far: JSON-serializable (``json.dumps`` works).

        Raises ``ValueError`` naming the key if a sampler's or dataset's own state cannot be
        saved as JSON (iterating never fails for it).
        """
        cursor = self._pos
        self._source.check_saveable(cursor.source)
        return {
            "format": LOADER.name,
            "version": LOADER.version,
            "seed": self.seed,
            "epoch": self._epoch,
            "samples": cursor.samples,
            "batches": cursor.batches,
            "source": cursor.source,
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` continue right after the last batch the saved loader yielded.

        Raises ``CorruptState`` naming the field if the state is malformed (a field of the wrong
        type or out of range, counters that describe no position of an epoch, a source of
        another shape than this loader's source saves); ``StateMismatch`` naming the field, the
        saved and the current value if it is from another version, or was saved with a
        different dataset length, seed, batch size, drop_last, shuffle, sampler or (for a
        per-worker iterable dataset) ``num_workers``, or, for a dataset iterated per rank, on
        another ``rank`` or ``world_size`` (``ranks``). Both are ``ValueError``s. States of
        versions 1 and 2 (seeded per sample) are refused with a ``StateMismatch`` that says
        why (``states``). Nothing changes unless the whole state is valid.
        """
        what = "unbroken.DataLoader"
        reader = StateReader(state, what, LOADER)
        if reader.version != LOADER.version:  # an older one: the Format reads no other
            raise StateMismatch(
                what,
                "version",
                reader.version,
                LOADER.version,
                message=(
                    f"{what}: the state was saved with version={reader.version}, which seeded the "
                    "global generators once per sample (and sample_rng() from other seeds); this "
                    f"version={LOADER.version} seeds them once per batch, so the rest of the epoch "
                    "would draw other random numbers than the run that saved it. Finish that run "
                    "with the unbroken release that started it (0.1.x), or start a new one."
                ),
            )
        saved_seed = reader.int("seed", 0, _SEED_LIMIT - 1)
        if self._seed_given and saved_seed != self.seed:
            raise StateMismatch(
                what,
                "seed",
                saved_seed,
                self.seed,
                "Pass the saved seed, or seed=None to adopt it.",
            )
        saved_print = reader.dict("fingerprint")
        current_print = self._fingerprint()
        for field, current in current_print.items():
            if field in RANK_FIELDS:
                continue  # checked below, after the settings
            if field not in saved_print:
                raise CorruptState(
                    f"{what} state is malformed: fingerprint lacks '{field}'", "fingerprint"
                )
            if not same(saved_print[field], current):  # strictly: True is not 1
                raise StateMismatch(what, field, saved_print[field], current)
        unexpected = set(saved_print) - set(current_print)
        if not self._source.shared_by_ranks:
            unexpected -= set(RANK_FIELDS)
        if unexpected:
            raise CorruptState(
                f"{what} state field 'fingerprint': unexpected fields {sorted(unexpected)}",
                "fingerprint",
            )
        if not self._source.shared_by_ranks:
            check_ranks(saved_print, (self.rank, self.world_size), what)
        cursor = Cursor(reader.int("samples"), reader.int("batches"), state["source"])
        self._source.check_cursor(cursor, what)
        epoch = reader.int("epoch")

        self.seed = saved_seed
        self._move(epoch, cursor)

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "dataset_length": _length(self.dataset),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "global_rngs": list(self.global_rngs),
            **self._source.fingerprint(),
            **self._rank_fields,
        }


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # a map-style dataset may lack __len__ when a sampler drives it
        return None


def _check_seed(seed: int | None, generator: torch.Generator | None) -> int:
    if seed is None:
        if generator is not None:
            return generator.initial_seed() % _SEED_LIMIT
        return secrets.randbits(63)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed
