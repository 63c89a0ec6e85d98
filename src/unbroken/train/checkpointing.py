"""The Trainer's checkpoints: what they hold, when a periodic one is due, what a resume checks.

``checkpoint_entries`` names every stateful object of a run: the user's model, optimizer,
scheduler, scaler, loaders and stateful callbacks, and the Trainer's own ``Progress``, CSV log,
process RNGs (``GlobalRNG``), gradients of an unfinished accumulation window (``Gradients``) and
torchmetrics states (``MetricState``). The names are the checkpoint's format: a renamed entry is
a checkpoint that no longer resumes. Costs: a clone of every gradient and metric state at a save.

A model sharded by FSDP2 (``fully_shard``) is saved with its optimizer as one ``Sharded``
entry, through DCP, every rank its shards (``model``; no ``optimizer`` entry), and its
gradients per rank.

In a data-parallel job (DDP: the model, its gradients after each backward, the optimizer and
the rest are the same on every rank) rank 0 writes those once; what differs between ranks is
``PerRank``: the process RNGs, the metric states (each rank's own batches), the loop counters
(its running loss) and the loaders (a per-rank stream's position; unbroken's sharded loaders
are the same everywhere). On another number of ranks, the RNGs are re-seeded (``resume``),
metric states merged onto rank 0, and the counters and loaders are rank 0's (a loader whose
state belongs to one rank refuses it).

``resume`` restores them from the newest checkpoint, refuses a position this ``fit`` cannot
continue from and says where the run starts (``schedule`` says when a periodic checkpoint is
due).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypedDict, TypeGuard

import torch

from .._checks import is_int
from .._state import has_state
from ..checkpoint import Checkpointer, PerRank, Restored, Sharded
from ..checkpoint.entries import unwrap
from ..data.keys import derive_key
from ..errors import CorruptState, StateMismatch
from .csvlog import CSVLog
from .globalrng import GlobalRNG, seed_everything
from .progress import Progress, say

# Entry names, always present ...
PROGRESS, MODEL, GRADIENTS, OPTIMIZER = "progress", "model", "gradients", "optimizer"
TRAIN_LOADER, RNG, LOG = "train_loader", "rng", "log"
# ... present when given to fit ...
VAL_LOADER, SCHEDULER, SCALER = "val_loader", "scheduler", "scaler"
# ... and per metric ("metric.train.acc") and per stateful callback ("callback.0.EarlyStop").
METRIC, CALLBACK = "metric", "callback"


def checkpoint_entries(
    *,
    progress: Progress,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: Iterable,
    val_loader: Iterable | None,
    scheduler: Any,
    scaler: Any,
    log: CSVLog | None,
    metrics: dict[str, dict[str, Any]],
    callbacks: Sequence[Any],
) -> dict[str, Any]:
    """Everything a checkpoint holds, by name. ``metrics``: ``{phase: {name: metric}}``;
    ``log``: rank 0's CSV log (``None`` on the other ranks, which write no log)."""
    entries: dict[str, Any] = {
        PROGRESS: PerRank(progress, resize="rank0"),
        MODEL: model,
        GRADIENTS: Gradients(model),
        OPTIMIZER: optimizer,
        TRAIN_LOADER: PerRank(train_loader, resize="rank0"),
        RNG: PerRank(GlobalRNG(), resize="skip"),
    }
    if is_sharded(model):  # FSDP2: each rank holds its shards; DCP writes them, the optimizer's too
        through_dcp(entries, model, optimizer)
    if log is not None:
        entries[LOG] = log
    optional = {
        VAL_LOADER: val_loader and PerRank(val_loader, resize="rank0"),
        SCHEDULER: scheduler,
        SCALER: scaler,
    }
    entries.update({name: obj for name, obj in optional.items() if obj is not None})
    for phase, phase_metrics in metrics.items():
        for name, metric in phase_metrics.items():
            state = MetricState(metric)
            entries[f"{METRIC}.{phase}.{name}"] = PerRank(state, resize=state.merged)
    for i, callback in enumerate(callbacks):
        if has_state(callback):
            entries[f"{CALLBACK}.{i}.{type(callback).__name__}"] = callback
    return entries


def _dtensor() -> Any:
    """``DTensor``, if anything imported it (else no tensor is one); importing it costs ~3 s."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _is_dtensor(tensor: torch.Tensor) -> TypeGuard[Any]:  # Any: DTensor is imported lazily
    dtensor = _dtensor()
    return dtensor is not None and isinstance(tensor, dtensor)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are split over ranks (FSDP2's ``DTensor``)."""
    return any(_is_dtensor(p) for p in model.parameters())


class Gradients:
    """The ``.grad`` of every parameter: non-empty only inside an accumulation window. Of a
    sharded (FSDP2) parameter, this rank's shard."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        return {
            name: (None if p.grad is None else _local(p.grad).detach().clone())
            for name, p in self.model.named_parameters()
        }

    def load_state_dict(self, state: dict[str, torch.Tensor | None]) -> None:
        for name, p in self.model.named_parameters():
            grad = state.get(name)
            if grad is not None and _is_dtensor(p):
                local = grad.to(device=p.to_local().device, dtype=p.dtype)
                p.grad = type(p).from_local(local, p.device_mesh, p.placements, run_check=False)
            else:
                p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype)

    @staticmethod
    def refuse_unfinished(parts: list[Any], rank: int, world_size: int) -> None:
        """``PerRank`` resize of sharded gradients: none between optimizer steps, and the
        shards of an unfinished accumulation window cannot be split over other ranks."""
        if any(grad is not None for part in parts for grad in part.values()):
            raise StateMismatch(
                "unbroken.Trainer",
                "world_size",
                len(parts),
                world_size,
                holder="Trainer",
                message=(
                    f"the checkpoint was taken inside a gradient-accumulation window of a "
                    f"sharded model on {len(parts)} ranks; its gradient shards cannot be split "
                    f"over {world_size}. Resume on {len(parts)} ranks, or from a checkpoint "
                    "taken at an optimizer step (checkpoint_every_steps)"
                ),
            )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor


class MetricStateDict(TypedDict):
    """What ``MetricState.state_dict`` returns."""

    states: dict[str, Any]  # the metric's own state_dict, its states made persistent
    updates: int  # the metric's update count


class MetricState:
    """A torchmetrics metric's accumulated state, so epoch-end reductions survive a resume."""

    def __init__(self, metric: Any) -> None:
        metric.persistent(True)  # torchmetrics leaves metric states out of state_dict by default
        self.metric = metric

    def state_dict(self) -> MetricStateDict:
        return MetricStateDict(states=self.metric.state_dict(), updates=self.metric.update_count)

    def load_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("states"), dict):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CorruptState(
                f"metric state: expected {{'states': dict, 'updates': int}}, got {got}"
            )
        updates = state.get("updates")
        if not is_int(updates) or updates < 0:
            raise CorruptState(
                f"metric state: updates must be an int >= 0, got {updates!r}", field="updates"
            )
        self.metric.load_state_dict(state["states"])
        # torchmetrics has no public setter for its update count; it only gates the "compute
        # before update" warning and distributed mean reduction, and must match the saved run.
        self.metric._update_count = updates

    def merged(self, parts: list[Any], rank: int, world_size: int) -> MetricStateDict:
        """``PerRank`` resize: the states of the ranks that saved them, merged onto rank 0 with
        the metric's own reductions (torchmetrics ``merge_state``); the other ranks start
        empty. A synced ``compute()`` then reduces the same updates. Built on a copy of the
        metric: the live one changes only when the checkpoint is restored."""
        scratch = MetricState(copy.deepcopy(self.metric))
        scratch.metric.reset()
        if rank != 0:
            return scratch.state_dict()
        scratch.load_state_dict(parts[0])
        for part in parts[1:]:
            try:
                scratch.metric.merge_state(part["states"])
            except (RuntimeError, ValueError, TypeError, KeyError) as error:
                raise StateMismatch(
                    f"metric {type(self.metric).__name__}",
                    "world_size",
                    len(parts),
                    world_size,
                    message=(
                        f"the state of metric {type(self.metric).__name__} was saved by "
                        f"{len(parts)} ranks and cannot be merged onto {world_size} ({error}); "
                        f"resume on {len(parts)} ranks"
                    ),
                ) from error
        scratch.metric._update_count = sum(part["updates"] for part in parts)
        return scratch.state_dict()


def reset_metrics(metrics: dict[str, Any]) -> None:
    for metric in metrics.values():
        metric.reset()


def compute_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    return {name: float(metric.compute()) for name, metric in metrics.items()}


def through_dcp(
    entries: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """The model and its optimizer saved and loaded through DCP as one ``Sharded`` entry (each
    rank its shards), the gradients of an unfinished window per rank: how a sharded model is
    checkpointed, and how a run saved so goes on with an unsharded one."""
    entries[MODEL] = Sharded(model, optimizer)
    entries[GRADIENTS] = PerRank(Gradients(model), resize=Gradients.refuse_unfinished)
    entries.pop(OPTIMIZER, None)


def resume(
    checkpointer: Checkpointer,
    entries: dict[str, Any],
    val_loader: Iterable | None,
    seed: int,
    complete: Callable[[], bool] = lambda: False,
) -> Restored | None:
    """Restore ``entries`` from the newest valid checkpoint, if any, and say where the run starts.

    Refuses (before any training) a checkpoint taken inside the validation phase when this
    ``fit`` has no ``val_loader`` to finish it with. A checkpoint of another number of ranks
    has no RNG state for this rank: the process RNGs are seeded from ``seed``, the step and
    the rank instead. ``complete()``, asked once the checkpoint is restored, says that it left
    nothing to train: the caller then says so, and this says nothing of where it resumed.
    """
    try:
        restored = checkpointer.load_latest(entries)
    except StateMismatch as error:
        if error.field != f"entries[{MODEL!r}]" or error.saved != "a DCP directory":
            raise
        # Saved by a sharded model (FSDP2), going on with an unsharded one (in one process, or
        # wrapped otherwise): DCP loads the shards into its whole tensors, and the run keeps
        # saving through DCP, so that it can go back to FSDP2 later.
        model = entries[MODEL]
        through_dcp(entries, model, entries[OPTIMIZER])
        restored = checkpointer.load_latest(entries)
    progress = unwrap(entries[PROGRESS])
    if progress.phase == "val" and val_loader is None:
        raise StateMismatch(
            "unbroken.Trainer",
            "val_loader",
            "a loader",
            None,
            holder="Trainer",
            hint="The checkpoint was taken inside the validation phase: pass the same "
            "val_loader to fit() again to finish it.",
        )
    world, rank = checkpointer.world_size, checkpointer.rank
    ranks = f" on {world} ranks" if world > 1 else ""
    if restored is None:
        say(f"no checkpoint in {checkpointer.directory}: starting fresh{ranks}")
        return None
    saved = restored.world_size
    if saved != world:
        seed_everything(derive_key(seed % 2**64, progress.ticks, rank) % 2**63)
    if complete():
        return restored
    if saved == world:
        say(f"resumed from checkpoint {restored.path} ({progress.where()}){ranks}")
    else:
        say(
            f"resumed from checkpoint {restored.path} ({progress.where()}), saved by {saved} "
            f"rank{'s' * (saved > 1)}, on {world} rank{'s' * (world > 1)}: the same samples "
            "follow, in global batches of another size; the process RNGs are seeded anew "
            "from the seed, the step and the rank"
        )
    return restored
