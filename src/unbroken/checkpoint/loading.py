"""Reading the newest whole checkpoint, every rank together (``Checkpointer.load_latest``).

Rank 0 lists the candidates (``layout.candidates``); every rank tries them newest first: it reads
the manifest and its share of the entries (``entries``: one class per kind), checking each
file's sha256, and the ranks agree on a verdict, so that a checkpoint any rank finds corrupt is
skipped by all, with a warning saying why (``Writing.damaged``: the next save moves it aside,
``verdict.move_aside``). The first that every rank read whole is restored in place (below), DCP's
entries last and collectively. Costs: each file read twice (the hash, then ``torch.load`` from
the page cache or, from a store, the one download).

**Restoring** the entries in place (``restore``), with errors that say what differs. Modules
and optimizers are compared with the checkpoint *before* anything is restored, so a model whose
shapes changed gives "parameter 'fc.weight' has shape (10, 64) in the checkpoint and (10, 32)
now" rather than a stack trace from inside torch; any other ``load_state_dict`` that
fails becomes an error naming its entry (and the entries already restored). A checkpoint that
does not fit the objects (a missing entry, other shapes, other parameter groups) is a
``StateMismatch``; an entry that ``load_state_dict`` rejects keeps the kind of its refusal where
unbroken defines one (``StateMismatch``, ``CorruptState``) and is a ``ValueError`` otherwise.
What was restored, from where, is described by a ``Restored``.
"""

from __future__ import annotations

import itertools
import reprlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._state import has_state
from ..distributed.reduction import is_exact, warn_inexact
from ..errors import CorruptCheckpoint, CorruptState, StateMismatch
from . import layout
from .entries import ABSENT, SKIP, Reading, check_loadable, kind_in, unwrap
from .group import CheckpointGroup, attempt
from .layout import EntrySpec, Manifest, ParamShapes, read_manifest
from .sharded import Sharded
from .storage import CopiedDirectory, Storage
from .writing import Writing


class Loading:
    """The read path of a ``Checkpointer`` (``manager``) over its storage and ranks;
    ``check_directory`` raises if the directory is a file."""

    def __init__(
        self,
        storage: Storage,
        root: str,
        group: CheckpointGroup,
        writing: Writing,
        check_directory: Callable[[], None],
    ) -> None:
        self.storage, self.root, self.group, self.writing = storage, root, group, writing
        self.check_directory = check_directory

    def latest(self, state: dict[str, Any]) -> Restored | None:
        """``Checkpointer.load_latest`` (see there), every rank together."""
        ranks = self.group
        started = time.perf_counter()
        listed = attempt(self._candidates if ranks.world.first else self.check_directory)
        found: list[tuple[int, str]] = ranks.settle(listed, "listing the checkpoints")[0]
        self.writing.seen([step for step, _ in found])
        scanned = time.perf_counter()
        for step, where in reversed(found):
            path = where
            read = attempt(self._read, where, step, state)
            # Only the verdict travels (None: fine), never the state read.
            verdict = read if isinstance(read, BaseException) else None
            verdicts = ranks.settle(verdict, f"reading checkpoint {path}", CorruptCheckpoint)
            corrupt = [(r, v) for r, v in enumerate(verdicts) if isinstance(v, CorruptCheckpoint)]
            if corrupt:
                why = "; ".join(
                    f"rank {r}: {v}" if ranks.world.size > 1 else str(v) for r, v in corrupt
                )
                warnings.warn(
                    f"unbroken.Checkpointer: skipping checkpoint {path}: {why}", stacklevel=3
                )
                # Read, and proven damaged: the next save moves it aside, never deletes it.
                self.writing.damaged[path] = [
                    f"rank {r}: {v}" if ranks.world.size > 1 else str(v) for r, v in corrupt
                ]
                if not isinstance(read, BaseException):  # this rank's downloads of it go
                    for value in read[1].values():
                        if isinstance(value, CopiedDirectory):
                            value.remove()
                continue
            assert not isinstance(read, BaseException)
            manifest, saved, skipped = read
            was_read = time.perf_counter()
            # DCP's entries last, and only once all the others are in: it loads collectively.
            sharded = {n: o for n, o in state.items() if isinstance(o, Sharded) and n in saved}
            objects = {
                name: unwrap(obj)
                for name, obj in state.items()
                if name not in skipped and name not in sharded
            }
            restored = attempt(restore, objects, saved, manifest["entries"], path)
            ranks.settle(restored, f"restoring checkpoint {path}")
            for name, obj in sharded.items():
                loaded = attempt(obj.load, saved[name], ranks.process_group)
                if isinstance(saved[name], CopiedDirectory):  # downloaded from object storage
                    saved[name].remove()
                ranks.settle(loaded, f"loading state[{name!r}] of checkpoint {path} with DCP")
            for obj in objects.values():  # a DDP model on 3+ ranks: exact only with a fix
                if not is_exact(obj):
                    warn_inexact("unbroken.Checkpointer", obj)
            return Restored(
                step=step,
                path=path,
                values={name: saved[name] for name, obj in objects.items() if not has_state(obj)},
                unrequested={name: value for name, value in saved.items() if name not in state},
                world_size=manifest["world_size"],
                seconds={
                    "scan": scanned - started,
                    "read": was_read - scanned,
                    "restore": time.perf_counter() - was_read,
                },
            )
        return None

    def _candidates(self) -> list[tuple[int, str]]:
        self.check_directory()
        return layout.candidates(self.storage, self.root)

    def _read(
        self, where: str, step: int, state: dict[str, Any]
    ) -> tuple[Manifest, dict[str, Any], list[str]]:
        """Checkpoint ``where``'s manifest, entries, and the ``PerRank`` names left as they are."""
        ranks = self.group
        manifest = read_manifest(self.storage, where, step)
        at = Reading(self.storage, where, manifest, ranks.world.rank, ranks.world.size)
        saved: dict[str, Any] = {}
        skipped: list[str] = []
        for index, (name, spec) in enumerate(manifest["entries"].items()):
            wanted = state.get(name, ABSENT)
            check_loadable(where, name, spec, wanted)
            value = kind_in(spec).read(at, index, name, spec, wanted)
            if value is SKIP:
                skipped.append(name)
            elif value is not ABSENT:
                saved[name] = value
        return manifest, saved, skipped


@dataclass(frozen=True, eq=False, repr=False)
class Restored:
    """What ``load_latest`` restored, and from which checkpoint.

    Returned only when a checkpoint was restored (``load_latest`` returns ``None`` when there is
    none), so it is always true: ``if restored:`` reads as "resumed", even when every entry went
    into an object and ``values`` and ``unrequested`` are empty. ``load_latest`` builds it; each
    field's own docstring below says more.

    Args:
        step: the step given to ``save``.
        path: the checkpoint's directory.
        values: the saved plain values of ``state``'s names without ``load_state_dict``.
        unrequested: the checkpoint's entries that ``state`` did not name.
        world_size: the number of ranks that saved it.
        seconds: where the load's time went on this rank (scan, read, restore).
    """

    step: int
    """The step given to ``save``."""
    path: str
    """The checkpoint's directory."""
    values: dict[str, Any]
    """The saved values of the names of ``state`` that have no ``load_state_dict`` (plain
    values such as an epoch counter). They are not written into the caller's dict."""
    unrequested: dict[str, Any]
    """The checkpoint's entries that ``state`` did not name, as saved (of a ``PerRank`` one,
    this rank's part, when the checkpoint was saved by as many ranks as there are now)."""
    world_size: int = 1
    """The number of ranks that saved it."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the load's time went on this rank: ``"scan"`` (listing the checkpoints), ``"read"``
    (reading and verifying the files, the skipped checkpoints' included) and ``"restore"``
    (``load_state_dict`` of every object, DCP's load)."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return (
            f"Restored(step={self.step}, path={str(self.path)!r}, "
            f"values={_SHORT.repr(self.values)}, "
            f"unrequested={_SHORT.repr(self.unrequested)}, world_size={self.world_size})"
        )


class _Short(reprlib.Repr):
    """A repr to read, not to eval: an optimizer's state would otherwise print every tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 3, 8, 8, 8
        self.maxstring = self.maxother = 80

    def repr_dict(self, x: dict, level: int) -> str:  # in the saved order; reprlib sorts
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [
            f"{self.repr1(key, level - 1)}: {self.repr1(value, level - 1)}"
            for key, value in itertools.islice(x.items(), self.maxdict)
        ]
        return "{" + ", ".join(items + ["..."] * (len(x) > self.maxdict)) + "}"


_SHORT = _Short()


def restore(
    state: dict[str, Any], saved: dict[str, Any], entries: dict[str, EntrySpec], path: str
) -> None:
    """Give each object of ``state`` with ``load_state_dict`` its entry of ``saved``."""
    missing = [name for name in state if name not in saved]
    if missing:
        raise StateMismatch(
            f"checkpoint {path}",
            "entries",
            sorted(saved),
            list(state),
            message=(
                f"checkpoint {path} has no entry {', '.join(map(repr, missing))} (it holds "
                f"{sorted(saved)}); ask for the names that were saved, or leave these out of the "
                "state given to load_latest"
            ),
        )
    # Everything that can be checked is checked first: a mismatch changes nothing.
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            _check_module(name, obj, saved[name])
        elif isinstance(obj, torch.optim.Optimizer):
            _check_optimizer(name, obj, saved[name], entries[name].get("param_shapes"))
    done: list[str] = []
    for name, obj in [(n, o) for n, o in state.items() if has_state(o)]:
        try:
            obj.load_state_dict(saved[name])
        except Exception as error:
            partly = (
                f" {done} were restored already, so the state is now partly restored: "
                "do not train on with it."
                if done
                else ""
            )
            raise _rejected(
                error,
                f"state[{name!r}]",
                f"state[{name!r}]: {type(obj).__qualname__}."
                f"load_state_dict rejected the entry saved in {path}: "
                f"{str(error).rstrip('.')}.{partly}",
            ) from error
        done.append(name)


def _rejected(error: Exception, what: str, message: str) -> ValueError:
    """The error for an entry that ``load_state_dict`` refused: of the kind of ``error`` where
    unbroken defines it (so ``except StateMismatch`` sees a loader's refusal through
    ``load_latest``), else a plain ``ValueError``."""
    if isinstance(error, StateMismatch):
        return StateMismatch(what, error.field, error.saved, error.current, message=message)
    if isinstance(error, CorruptState):
        return CorruptState(message, field=error.field)
    return ValueError(message)


def _shape(tensor: torch.Tensor) -> str:
    return str(tuple(tensor.shape))


def _check_module(name: str, module: torch.nn.Module, saved: Any) -> None:
    what = f"state[{name!r}]"
    if not isinstance(saved, dict):
        raise StateMismatch(
            what,
            "type",
            type(saved).__name__,
            type(module).__qualname__,
            message=(
                f"{what}: the checkpoint holds a {type(saved).__name__}, not the state_dict "
                f"of a {type(module).__qualname__}"
            ),
        )
    current = module.state_dict()
    params = {key for key, _ in module.named_parameters(remove_duplicate=False)}
    differ = [
        key
        for key, now in current.items()
        if key in saved
        and isinstance(now, torch.Tensor)
        and isinstance(saved[key], torch.Tensor)
        and saved[key].shape != now.shape
    ]
    problems = [
        f"{'parameter' if key in params else 'buffer'} {key!r} has shape {_shape(saved[key])} "
        f"in the checkpoint and {_shape(current[key])} now"
        for key in differ
    ]
    if len(problems) > 5:  # a changed width touches every layer: the first few say enough
        problems[5:] = [f"{len(problems) - 5} more tensors differ in shape"]
    absent = [key for key in current if key not in saved]
    extra = [key for key in saved if key not in current]
    if absent:
        problems.append(f"keys of the module missing from the checkpoint: {absent}")
    if extra:
        problems.append(f"keys in the checkpoint that the module lacks: {extra}")
    if problems:
        # saved and current: the shape of each key that differs (None where it is absent).
        keys = [*differ, *absent, *extra]
        raise StateMismatch(
            what,
            "state_dict",
            {key: _shape_of(saved, key) for key in keys},
            {key: _shape_of(current, key) for key in keys},
            message=(
                f"{what}: the checkpoint does not fit this {type(module).__qualname__}: "
                + "; ".join(problems)
                + ". Build the model as the run that saved it did."
            ),
        )


def _shape_of(state_dict: dict, key: str) -> tuple[int, ...] | None:
    value = state_dict.get(key)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _check_optimizer(
    name: str, optimizer: torch.optim.Optimizer, saved: Any, shapes: ParamShapes | None
) -> None:
    what = f"state[{name!r}]"
    now = [len(group["params"]) for group in optimizer.param_groups]
    try:
        sizes = [len(group["params"]) for group in saved["param_groups"]]
    except (KeyError, TypeError):
        raise StateMismatch(
            what,
            "param_groups",
            None,
            now,
            message=(
                f"{what}: the checkpoint does not hold an optimizer's state_dict (no "
                "'param_groups' with 'params')"
            ),
        ) from None
    if sizes != now:
        raise StateMismatch(
            what,
            "param_groups",
            sizes,
            now,
            message=(
                f"{what}: the checkpoint has {len(sizes)} parameter groups of sizes {sizes}, this "
                f"optimizer has {len(now)} of sizes {now}; build it over the same parameters"
            ),
        )
    for g, group in enumerate(optimizer.param_groups if shapes else ()):
        for i, param in enumerate(group["params"]):
            if shapes is not None and list(param.shape) != shapes[g][i]:
                raise StateMismatch(
                    what,
                    f"param_groups[{g}]['params'][{i}].shape",
                    tuple(shapes[g][i]),
                    tuple(param.shape),
                    message=(
                        f"{what}: parameter {i} of group {g} has shape {tuple(shapes[g][i])} in "
                        f"the checkpoint and {_shape(param)} now; build the model as the run "
                        "that saved it did"
                    ),
                )
