"""``unbroken.DataLoader``: torch's DataLoader, resumable exactly; O(1) for map-style datasets.

It wraps a real ``torch.utils.data.DataLoader`` (workers, pinning, prefetching are torch's;
``inner``) around a *source* of batches (``sources``: one class per kind of dataset and
sampler), chosen once by ``make_source``; the epoch protocol is ``EpochIterable``'s
(``epochs``), torch's arguments and attributes are ``torch_api``'s. For each iteration
(``iterator``) the inner loader seeds its workers' seeds, lets the source plan the epoch from the
cursor (``begin``) and starts; the cursor moves as each batch is *received*: batches prefetched
by workers are never counted, so ``state_dict()`` describes exactly what the user received.
Here: the loader's attributes, its state and the checks of a loaded one.

State: ``LoaderState`` (``states``), a few integers plus the source's part (a user sampler's
or the dataset's own state, if it has one).
Per-batch cost: see benchmarks/RESULTS.md (the batch sampler's generator, the fetch wrapper,
the cursor), plus the per-batch seeding described in docs/guides/randomness.md (``global_rngs``
chooses it; as much again before a ``collate_fn`` of the user's, ``rng``) and, with
``num_workers=0``, putting the training process's torch generator back (docs/benchmarks/unit-costs.md, rows
``batch_seeding_all`` and ``torch_rng_back``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import torch

from .._checks import SEED_LIMIT
from .._state import StateReader, same
from ..errors import CorruptState, StateMismatch
from .inner import InnerLoader
from .iterator import Loader, LoaderIterator
from .rng import GLOBAL_RNGS, check_global_rngs
from .sources import make_source
from .sources.base import Cursor
from .sources.rank_checks import RANK_FIELDS, check_ranks, rank_fields
from .sources.sharding import world_of
from .states import LOADER, LoaderState, refuse_seeded_per_sample
from .torch_api import (
    OrderView,
    adopt,
    choose_seed,
    collate_of,
    refuse_what_torch_refuses,
    samplers,
)

T_co = TypeVar("T_co", covariant=True)
# torch's DataLoader refuses to change these once built; so does this one.
_FIXED = frozenset(
    ("dataset", "batch_size", "batch_sampler", "sampler", "drop_last", "persistent_workers")
)


class DataLoader(Loader, torch.utils.data.DataLoader[T_co]):
    """A drop-in for ``torch.utils.data.DataLoader`` whose position survives a restart.

    A subclass of torch's DataLoader (``isinstance`` holds) with its attributes (``sampler``,
    ``batch_sampler``, ``collate_fn``, ``generator``, ``prefetch_factor``, ...; ``torch_api``), built
    on a torch DataLoader of its own rather than on torch's ``__init__``. Takes torch's
    arguments plus keyword-only ``seed``, ``global_rngs``, ``rank`` and ``world_size``.

    ``iter(loader)`` continues the epoch a ``load_state_dict`` restored, and otherwise starts
    the next epoch (the first is epoch 0).

    Args:
        seed: The run's data seed (an int in [0, 2**64)). The shuffle order and every sample's
            randomness derive from it. ``None`` takes ``generator.initial_seed()`` if a
            ``generator`` is given, else the draw torch's ``RandomSampler`` would make from torch's
            global generator, made on a copy of it (so ``torch.manual_seed(0)`` reproduces the
            order, and building a loader changes no later draw; two loaders built with no draw in
            between get the same seed). On several ranks, rank 0's, broadcast once.
            ``load_state_dict`` then adopts the saved seed, so a restarted run continues the same
            order.
        global_rngs: Which process-global generators are seeded before each batch, and again
            before its ``collate_fn`` (unless that is torch's default): any of
            ``("torch", "numpy", "random")`` (the default, all three). Leaving one out saves its
            seeding call per batch, twice with a ``collate_fn`` (``random``'s costs most: rows
            ``batch_seeding_torch``, ``batch_seeding_numpy`` and ``batch_seeding_random`` of the
            unit costs; docs/guides/randomness.md) but makes draws from
            it inside ``__getitem__`` or ``collate_fn`` depend on the worker, so they no longer
            repeat after a resume; ``unbroken.sample_rng()`` and ``unbroken.sample_seed()`` stay
            exact either way.
        rank: This process's rank, for data parallelism (``unbroken.data.sources.sharding``);
            from the initialized ``torch.distributed`` process group when left out. A map-style
            dataset in unbroken's order gives each rank its share of every global batch; the
            state is the global cursor and resumes on any number of ranks. Other iterable
            datasets and user samplers are iterated by each rank on its own: their state
            resumes only on the rank and world size that saved it.
        world_size: The number of ranks, likewise.
        dataset: As torch's: a map-style or iterable dataset.
        batch_size: As torch's.
        shuffle: As torch's.
        sampler: As torch's.
        batch_sampler: As torch's.
        num_workers: As torch's; a resume may use another number.
        collate_fn: As torch's.
        pin_memory: As torch's.
        drop_last: As torch's.
        timeout: As torch's.
        worker_init_fn: As torch's.
        multiprocessing_context: As torch's.
        generator: As torch's; its ``initial_seed()`` is the seed when ``seed`` is ``None``.
        prefetch_factor: As torch's.
        persistent_workers: As torch's.
        pin_memory_device: As torch's.
        in_order: As torch's.

    Raises:
        ValueError: an argument is invalid or contradicts another, as torch's would say.
    """

    _independent = True  # two iterations at once each have their own position (``epochs``)

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
        # torch's arguments that are not about batching: the inner torch loader takes them as is.
        running = dict(
            num_workers=num_workers,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )
        refuse_what_torch_refuses(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            generator=generator,
            **running,
        )
        if not in_order:
            raise ValueError(
                "unbroken.DataLoader needs in_order=True: batches delivered out of order would make "
                "the received position ambiguous, so a resume could repeat or skip batches"
            )
        # A sampler that describes unbroken's own order (this class's ``sampler``, torch's
        # Sequential/Random/DistributedSampler over the dataset) becomes settings (``torch_api``).
        taken = adopt(dataset, shuffle, sampler, batch_sampler, batch_size, drop_last)
        sampler, batch_sampler = taken.sampler, taken.batch_sampler
        batch_size, drop_last, shuffle = taken.batch_size, taken.drop_last, taken.shuffle
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.global_rngs = check_global_rngs(global_rngs)
        ranks = world_of(rank, world_size) or taken.ranks
        self.seed, self._seed_given = choose_seed(seed, generator, taken, ranks)
        self.rank, self.world_size = ranks if ranks is not None else (0, 1)
        self._source = source = make_source(
            dataset, batch_size, shuffle, sampler, batch_sampler, drop_last, num_workers, ranks
        )
        self._rank_fields = rank_fields(source, ranks)  # per-rank sources on W > 1 ranks
        # It wraps the user's worker_init_fn as the workers start.
        self._inner = InnerLoader(
            source, dataset, batch_size, collate_fn, self.global_rngs, **running
        )
        inner = self._inner.torch
        self._init_epochs()
        # torch's attributes, as torch's DataLoader sets them (after torch's checks of them).
        self.sampler, self.batch_sampler = samplers(
            self, source, self._seed_given, sampler, batch_sampler
        )
        self.collate_fn = collate_of(collate_fn, batch_size, self.batch_sampler)
        self.generator = generator
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = inner.multiprocessing_context
        self.pin_memory, self.pin_memory_device = inner.pin_memory, inner.pin_memory_device
        self.timeout, self.prefetch_factor = inner.timeout, inner.prefetch_factor
        self.persistent_workers, self.in_order = inner.persistent_workers, in_order
        self._built = True

    def __setattr__(self, name: str, value: Any) -> None:
        # As torch's DataLoader: the loader is built from these, so a later change would be
        # silently ignored.
        if name in _FIXED and self.__dict__.get("_built"):
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized: "
                "build a new loader (and load the old one's state_dict() into it)"
            )
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        # A copy has no iteration open: it goes on from the position, as a loaded state would.
        state = self.__dict__.copy()
        state.update(_owner=None, _live=[], _open=False, _restored=True, _pos=self._pos.copy())
        return state

    def _current_changed(self) -> None:
        view = self.__dict__.get("sampler")
        if type(view) is OrderView:
            view.follow(self.seed, self._epoch)

    def __iter__(self) -> LoaderIterator:  # type: ignore[override]
        """An iterator object, as torch's (``next``, ``len``, ``close``; ``iterator``)."""
        return LoaderIterator(self, self._inner)

    def __len__(self) -> int:
        """Batches in a whole epoch (like torch's DataLoader), not in what remains of it."""
        self._inner.length_asked()  # torch warns if a stream then yields more
        if not self._open and self._pos.batches == 0:  # the epoch to come: the length now
            self._inner.follow_length()
        return len(self._source)

    def _start_position(self, ended: Cursor | None) -> Cursor:
        return Cursor(source=self._source.fresh())

    def state_dict(self) -> LoaderState:
        """What the user has received so far.

        Returns:
            The state, JSON-serializable (``json.dumps`` works).

        Raises:
            ValueError: a sampler's or dataset's own state cannot be saved as JSON (named by
                its key; iterating never fails for it).
        """
        cursor = self._pos
        return self._state(cursor.samples, cursor.batches, cursor.source)

    def _state_before_last_batch(self) -> LoaderState | None:
        """The state as it was before the last batch was received, if that batch is of the
        current epoch (else None): for a consumer that fetches a batch ahead of its user
        (Lightning's prefetch of a loader without ``len()``; ``unbroken.lightning``)."""
        before = self._pos.before_last
        return None if before is None else self._state(*before)

    def _state(self, samples: int, batches: int, source: Any) -> LoaderState:
        self._source.check_saveable(source)
        return {
            "format": LOADER.name,
            "version": LOADER.version,
            "seed": self.seed,
            "epoch": self._epoch,
            "samples": samples,
            "batches": batches,
            "source": source,
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` continue right after the last batch the saved loader yielded.

        Nothing changes unless the whole state is valid.

        Args:
            state: What ``state_dict()`` returned, maybe through JSON.

        Raises:
            CorruptState: the state is malformed (a field of the wrong type or out of range,
                counters that describe no position of an epoch, a source of another shape).
            StateMismatch: the state is from another version, or was saved with a different
                dataset length, seed, batch size, drop_last, shuffle, sampler or (per-worker
                iterable dataset) ``num_workers``, or (a dataset iterated per rank) on another
                ``rank`` or ``world_size``. It names the field, the saved and current value.
        """
        what = "unbroken.DataLoader"
        reader = StateReader(state, what, LOADER)
        refuse_seeded_per_sample(reader.version, what)
        saved_seed = reader.int("seed", 0, SEED_LIMIT - 1)
        if self._seed_given and saved_seed != self.seed:
            raise StateMismatch(
                what,
                "seed",
                saved_seed,
                self.seed,
                "Pass the saved seed, or seed=None to adopt it.",
            )
        saved_print = reader.dict("fingerprint")
        self._inner.follow_length()  # a state is compared with the dataset as it is now
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
        self._restore(epoch, cursor)

    def _fingerprint(self) -> dict[str, Any]:
        ordered = self._source.ordered_length()  # the length this epoch is ordered over
        return {
            "dataset_length": ordered if ordered is not None else _length(self.dataset),
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
