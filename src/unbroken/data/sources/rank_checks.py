"""Per-rank sources on several ranks: the rank and world size in a ``DataLoader``'s fingerprint.

unbroken splits two kinds of dataset over ranks itself (``unbroken.distributed``): a map-style
dataset in its own order and a global-cursor stream with ``len()``. Their state is the global
cursor, the same on every rank, and resumes on any number of ranks (``shared_by_ranks``). Every
other source (a user sampler or batch sampler, an iterable dataset with its own state, the
sampler pattern, a replayed stream) is iterated by each rank on its own: rank r's state says
where rank r's stream is, and means nothing on another rank or with another world size (a
``DistributedSampler`` or ``datasets.distributed.split_dataset_by_node`` gives each rank other
samples). On W > 1 ranks the loader therefore saves ``"rank"`` and ``"world_size"`` in the
state's fingerprint, and a state loads only on the rank and world size that saved it.

A state without them was saved by a single process (or with ``world_size=1``): it loads in one
process as before, and is refused on rank r of W > 1 (``world_size`` 1 against W), since that
rank iterates another stream. (States of version 1, which never recorded ranks, are refused
before this check: they were seeded per sample, ``unbroken.data.states``.)
"""

from __future__ import annotations

from ..._state import check_int
from ...errors import CorruptState, StateMismatch
from .base import BatchSource

RANK_FIELDS = ("rank", "world_size")

_HINT = (
    "This dataset is iterated per rank (unbroken splits only a map-style dataset in its own order "
    "and a global-cursor stream with len() over ranks), so its state resumes only on the rank and "
    "world size that saved it: resume with the same number of ranks, each rank loading the state "
    "it saved."
)


def rank_fields(source: BatchSource, ranks: tuple[int, int] | None) -> dict[str, int]:
    """``{"rank": r, "world_size": W}`` for a source that each of W > 1 ranks iterates on its
    own; nothing for a single process, one rank, or a global order split over the ranks."""
    if ranks is None or ranks[1] == 1 or source.shared_by_ranks:
        return {}
    return {"rank": ranks[0], "world_size": ranks[1]}


def check_ranks(saved_print: dict, current: tuple[int, int], what: str) -> None:
    """Refuse a per-rank source's state saved on another rank or world size than ``current``
    (``(0, 1)`` in a single process): ``StateMismatch`` on ``world_size``, then on ``rank``."""
    present = [field for field in RANK_FIELDS if field in saved_print]
    note = ""
    if not present:
        saved = (0, 1)
        note = "The state records no ranks: a single process saved it. "
    elif len(present) == 1:
        (missing,) = set(RANK_FIELDS) - set(present)
        raise CorruptState(
            f"{what} state field 'fingerprint': '{present[0]}' without '{missing}'; "
            "the state is corrupt",
            "fingerprint",
        )
    else:
        name = f"{what} state field 'fingerprint.%s'"
        world = check_int(saved_print["world_size"], name % "world_size", 2)
        saved = (check_int(saved_print["rank"], name % "rank", 0, world - 1), world)
    for field, was, now in (("world_size", saved[1], current[1]), ("rank", saved[0], current[0])):
        if was != now:
            raise StateMismatch(what, field, was, now, note + _HINT)


def refuse_a_global_cursor(samples: int, batches: int, step: int, n: int, what: str) -> None:
    """A single process's order reads ``step`` samples a batch, so its cursor has
    ``samples <= batches * step``. One with more, within the epoch, is the global cursor of a
    job of several ranks (each global batch is ``step`` samples on each rank): not corrupt, but
    saved by one rank of such a job. Say so, and how to continue it in one process."""
    if batches <= 0 or samples <= batches * step or samples > n:
        return
    ranks, short = -(-samples // (batches * step)), samples % (batches * step)
    if short and samples != n:
        return  # W ranks stop at a multiple of batches * step, or at the epoch's short end
    job = f"{ranks} or more ranks" if short else f"{ranks} ranks"  # the last may be short
    raise StateMismatch(
        what,
        "world_size",
        f">= {ranks}",
        1,
        message=(
            f"{what}: samples={samples} after batches={batches} of {step} is the global cursor of "
            f"a data-parallel job of {job} (a rank's state describes the whole "
            "job's position), and this loader reads the whole dataset alone. To continue that "
            "job in one process, build the loader with rank=0, world_size=1 (it reads every "
            "global batch from the saved position on); on several ranks, pass rank= and "
            "world_size= (or initialize the process group before building the loader)."
        ),
    )
