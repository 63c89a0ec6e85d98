"""``Sharded``: a model and its optimizers whose state is split over the ranks (FSDP2), saved
and loaded through ``torch.distributed.checkpoint`` (DCP), also on another number of ranks.

A ``fully_shard``-ed model holds on each rank only its shard of every parameter (``DTensor``),
so no rank can write the whole state as rank 0 does for a DDP model. ``Sharded(model,
optimizer)`` is a checkpoint entry that every rank saves together: its state is DCP's
(``get_state_dict``: the model's and the optimizers' states keyed by parameter name) and DCP
writes it, each rank its own shards, into ``<index>-<name>.dcp/`` inside the checkpoint's
temporary directory (``__<rank>_0.distcp`` files and rank 0's ``.metadata``). The manifest then
lists every one of those files with its sha256 like any other file, so the checkpoint is
committed only when they are all durable, and skipped by every rank if any changed.

Loading reads the shards DCP's planner needs for this rank's part of each parameter, whatever
the number of ranks that wrote them: 2 ranks' shards load on 1 or 3 ranks, or into an
unsharded model in one process. DCP's collectives run on the Checkpointer's own gloo group
(``process_group=``), so a background save does not race the training's collectives.

A background save (``blocking=False``) clones the local shards where they are, so on a GPU it
holds a second copy of this rank's shards in GPU memory until the write ends.

Costs: DCP's, plus one read of each shard file for its sha256 after DCP wrote it (each rank its
own files), and at load the sha256 of each file by one rank (spread over the ranks).
``.metadata`` is a pickle that DCP unpickles; the sha256 catches accidents, not an attacker.

With HSDP (FSDP2 over a mesh of replicas and shards) each shard lives on several ranks:
``replica_shard`` says which of the shards of one whole replica this rank holds, so that any one
holder of each shard can write it, DCP's collectives running on a group of just those
(``Checkpointer.write_shards``; a survivor's save for a rank that died, ``train.jit_shards``).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

METADATA = ".metadata"


class Sharded:
    """One checkpoint entry for a model and its optimizers, saved through DCP by every rank.

    The model may be FSDP2-sharded or not; a state loads on any number of ranks.

    Args:
        model: The model, e.g. a ``fully_shard``-ed one.
        optimizers: Its optimizer, or several.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Sharded needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        self.optimizers = list(optimizers)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the state, as DCP's ``get_state_dict`` gives it.

        Returns:
            ``{"model": ..., "optimizers": ...}``, keyed by parameter name.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizers = get_state_dict(self.model, self.optimizers)
        return {"model": model, "optimizers": optimizers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a state back into the model and optimizers, through DCP's ``set_state_dict``.

        Args:
            state: What ``state_dict()`` returned, with this rank's shards.
        """
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizers"],
        )

    def load(self, directory: str, group: Any) -> None:
        """Load this rank's part of the state in ``directory``, in place (collective).

        Args:
            directory: The entry's DCP directory in a checkpoint.
            group: The process group DCP's collectives run on; ``None`` for one process.
        """
        import torch.distributed.checkpoint as dcp  # here: ~0.7 s to import

        state = self.state_dict()  # DCP loads into the current tensors: their shards, resharded
        with _one_process(group):
            dcp.load(
                state,
                storage_reader=dcp.FileSystemReader(directory),
                process_group=group,
                no_dist=group is None,
            )
        self.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Sharded({type(self.model).__name__}, {len(self.optimizers)} optimizers)"


def save_state(state: dict[str, Any], directory: str, group: Any) -> None:
    """This rank's part of ``state`` (a ``Sharded.state_dict()``), written by DCP into
    ``directory``, fsynced (collective over ``group``; ``None``: one process)."""
    import torch.distributed.checkpoint as dcp

    with _one_process(group):
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
            process_group=group,
            no_dist=group is None,
        )


@contextmanager
def _one_process(group: Any) -> Iterator[None]:
    """Without a group, DCP warns that it assumes one process even when told so (``no_dist``)."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def replica_shard(model: torch.nn.Module) -> tuple[int, int] | None:
    """Which part of one whole replica of an HSDP model this rank holds.

    Every parameter must be a ``DTensor`` on the one mesh of the whole job, with the same
    placements, replicated over dimensions of at least 2 ranks in all: the ranks that differ
    only along those dimensions hold the same shards.

    Args:
        model: The model, e.g. ``fully_shard``-ed over a 2-D mesh ``(replicate, shard)``.

    Returns:
        ``(shard, shards)``: this rank's shard (its coordinates along the sharded dimensions,
        row-major) among the ``shards`` that make one replica; ``None`` for any other layout.
    """
    import torch.distributed as dist

    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    params: list[Any] = list(model.parameters())  # DTensors, if anything
    if dtensor is None or not params or not all(isinstance(p, dtensor) for p in params):
        return None
    mesh, placements = params[0].device_mesh, params[0].placements
    if any(p.device_mesh != mesh or p.placements != placements for p in params[1:]):
        return None
    split = [dim for dim, placement in enumerate(placements) if not placement.is_replicate()]
    if math.prod(mesh.size(dim) for dim in range(mesh.ndim) if dim not in split) < 2:
        return None  # no replica: a rank's shards die with it
    coordinate = mesh.get_coordinate()
    if coordinate is None or mesh.size() != dist.get_world_size():
        return None  # a mesh of some ranks only: the others hold other parameters
    shard, shards = 0, 1
    for dim in split:
        shard, shards = shard * mesh.size(dim) + coordinate[dim], shards * mesh.size(dim)
    return shard, shards


def written_by(names: list[str], rank: int) -> list[str]:
    """The files of a DCP directory that ``rank`` wrote (its ``__<rank>_*.distcp``, and rank 0
    the ``.metadata``)."""
    mine = [name for name in names if name.startswith(f"__{rank}_") and name.endswith(".distcp")]
    return sorted(mine + ([METADATA] if rank == 0 and METADATA in names else []))
