"""Just-in-time saves of an HSDP model: when a rank dies, one survivor holding each shard writes
it through DCP, and one of them writes the rest of the job and commits the checkpoint.

With HSDP (FSDP2 over a mesh of replicas and shards) every shard of a rank that died lives on a
surviving replica (``sharded.replica_shard``). ``save`` is what a survivor does after a failed
collective, holding the record of the last completed step (``jit``):

1. It claims its shard of that step in torchrun's store: a compare-and-set, which the first
   survivor holding the shard wins. A survivor whose shard another one claimed writes nothing
   and leaves at once: a survivor blocked in a collective with it (gloo notices a peer's end
   only when the peer's sockets close) is freed when it exits.
2. Once every shard is claimed, the claimers make a process group of their own (``new_group``
   with local synchronization: only they take part, through the store). The holder of shard 0
   stages the checkpoint's temporary directory, and DCP writes each claimer's shards into it:
   the same folder and files that a save by every rank makes, which any number of ranks loads.
3. The holder of shard 0 reads the others' file digests from the store, writes the rest of the
   job as for a DDP model (``JustInTime._save``), and seals and commits the checkpoint, whole
   and verified; on any failure it removes it.

A shard that no survivor claims within ``WAIT_SECONDS`` of the failure (all its holders died,
or the only one left is blocked in a collective with a claimer, which stays, and the process
group's timeout is longer), or a claimer's failure, leaves the previous checkpoint: the job
resumes from it. The store's keys
carry the record's step, so claimers of different steps (a collective that completed on some
ranks only) never mix, and only one step is saved (``hsdp/writer``).

Costs: nothing in a step. At a failure: a group's setup, DCP's write of one replica spread over
its claimers, one read of each file for its sha256, and a few store operations.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..checkpoint.layout import final_name
from ..checkpoint.storage import Digest
from ..checkpoint.writing import Staged
from .checkpointing import LOG, MODEL
from .progress import say

if TYPE_CHECKING:
    from .jit import JustInTime, Record


class NoSave(RuntimeError):
    """No just-in-time save of the sharded model can be made: the previous checkpoint stays."""


def save(jit: JustInTime, record: Record, deadline: float) -> str | None:
    """This survivor's part of the save of ``record`` (see the module).

    Args:
        jit: The survivor's ``JustInTime``, with its ``shard``.
        record: Its record of the last completed step, which the live objects still hold.
        deadline: ``time.perf_counter()`` value by which every shard must be claimed.

    Returns:
        The checkpoint's path on the holder of shard 0; ``None`` on the others.

    Raises:
        NoSave: a shard no survivor claimed in time, a claimer that could not write its shard,
            or a run directory in object storage.
    """
    assert jit.shard is not None
    if jit.run.remote:
        raise NoSave("a sharded model's shards are written by several survivors, into a local run")
    store, rank, ticks = jit.store, jit.agreement.world.rank, record.ticks
    shard, shards = jit.shard
    key = f"hsdp/{ticks}"
    if int(store.compare_set(f"{key}/shard-{shard}", "", str(rank))) != rank:
        return None  # another survivor holding this shard writes it
    claims = [f"{key}/shard-{index}" for index in range(shards)]
    holders = [int(value) for value in _values(store, claims, deadline, "claimed the shard")]
    group = dist.new_group(holders, timeout=_left(deadline), use_local_synchronization=True)
    tmp = ""
    if shard == 0:
        try:
            if store.compare_set("hsdp/writer", "", str(ticks)).decode() == str(ticks):
                tmp = jit.checkpointer.stage_alone(ticks)
        finally:
            store.set(f"{key}/tmp", tmp)  # "": no save, and the others stop waiting
    else:
        tmp = _values(store, [f"{key}/tmp"], deadline, "staged the checkpoint")[0]
    path = _write(jit, record, tmp, group, deadline) if tmp else None  # "": another step's
    # Only once DCP's collectives ended well: a group with a collective left unfinished may
    # block in its destruction (the process exits soon in any case).
    dist.destroy_process_group(group)
    return path


def _write(jit: JustInTime, record: Record, tmp: str, group: Any, deadline: float) -> str | None:
    """Every claimer's shards into ``tmp``; then, by the holder of shard 0, the rest and the
    commit (or, on a failure, the temporary directory removed)."""
    assert jit.shard is not None
    store, (shard, shards), checkpointer = jit.store, jit.shard, jit.checkpointer
    key = f"hsdp/{record.ticks}"
    order = {name: index for index, name in enumerate(dict.fromkeys([*jit.entries, LOG]))}
    entry = jit.entries[MODEL]
    sealing = False
    try:
        try:
            part = checkpointer.write_shards(
                tmp, order[MODEL], MODEL, entry, group, dist.get_rank(group)
            )
        except BaseException:
            if shard:
                store.set(f"{key}/part-{shard}", "")  # the holder of shard 0 stops waiting
            raise
        if shard:
            listed = [[file, digest.sha256, digest.size] for file, digest in part.files]
            store.set(f"{key}/part-{shard}", json.dumps(listed))
            say(
                f"rank {jit.agreement.world.rank} wrote shard {shard} of {shards} of "
                f"{final_name(record.ticks)} just in time",
                every_rank=True,
            )
            return None
        files = list(part.files)
        parts = [f"{key}/part-{index}" for index in range(1, shards)]
        for other, value in enumerate(_values(store, parts, deadline, "wrote the shard"), 1):
            if not value:
                raise NoSave(f"the survivor holding shard {other} of {shards} did not write it")
            files += [(file, Digest(sha256, size)) for file, sha256, size in json.loads(value)]
        sealing = True  # save_alone removes the directory if it fails
        return jit._save(record, Staged(tmp, {MODEL: part._replace(files=files)}, order))
    except BaseException:
        if not shard and not sealing:
            checkpointer.abandon(tmp)
        raise


def _values(store: Any, keys: list[str], deadline: float, what: str) -> list[str]:
    """The values of ``keys`` once all are set; ``NoSave`` at the deadline, naming the keys
    that no survivor set (``what``: what setting one means)."""
    try:
        if keys:
            store.wait(keys, _left(deadline))
    except Exception as error:
        missing = [k.rpartition("/")[2] for k in keys if not store.check([k])]
        raise NoSave(
            f"no survivor {what} in time ({', '.join(missing)}; {type(error).__name__})"
        ) from error
    return [store.get(k).decode() for k in keys]


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.perf_counter(), 0.1))
