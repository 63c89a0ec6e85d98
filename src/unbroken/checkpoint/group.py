"""``CheckpointGroup``: the Checkpointer's ranks (a ``World``) and how they agree.

Under an initialized ``torch.distributed`` process group of more than one rank, every
Checkpointer call is collective: each rank calls ``save`` (or ``load_latest``) with the same
step, in the same order. The Checkpointer talks to the other ranks only through its ``CheckpointGroup``:

- ``settle(outcome)``: every rank hands in what its part of a phase gave, a value or the
  exception it raised; all get the list of values, or every rank raises (its own error, or a
  ``RankFailure`` carrying the first failed rank's). So no rank goes on alone past a failure.
  What rank 0 alone decides (the temporary directory, the list of checkpoints, so that every
  rank tries the same ones in the same order) reaches the others this way too.

The collectives run on a gloo group of their own, made by the Checkpointer's constructor
(itself collective), with its own ``timeout``: object collectives run on the CPU whatever the
training's backend, a background save may run them in its thread while the training's own
collectives go on in the main one, and a dead or stuck peer becomes a ``RankFailure`` naming
the phase after ``timeout`` seconds, never a hang. One process (no process group, or a group
of one) is a group of rank 0 of 1: the same code path, with nothing to exchange.

``check_shared`` refuses a checkpoint directory that the ranks do not all see (each node its
own local disk): rank 0 writes a token there, every rank reads it back.
"""

from __future__ import annotations

import pickle
import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from ..distributed.world import World
from ..errors import DirectoryNotShared, RankFailure
from .layout import SHARED
from .storage import Storage, join

T = TypeVar("T")


class CheckpointGroup:
    """The Checkpointer's ranks: ``world``, this process's rank among them; ``process_group``,
    their own gloo group (None for one process); the collectives over it (see the module)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.process_group: Any = None
        self.world = World.current()
        if self.world.distributed:
            try:
                # gloo connects the new group's ranks with a few quick retries only: a rank
                # still busy elsewhere (a slow start, a loaded machine) would fail it, so all
                # meet first on the default group, whose own timeout applies.
                dist.barrier()
                self.process_group = dist.new_group(
                    backend="gloo", timeout=timedelta(seconds=timeout)
                )
            except Exception as error:
                raise self._lost("creating the Checkpointer's process group", error) from error
        else:
            self.world = World()  # a default group of one rank: nothing to exchange

    def settle(
        self, outcome: Any, phase: str, tolerate: type[BaseException] | tuple = ()
    ) -> list[Any]:
        """Every rank's ``outcome`` (a value, or an exception that rank raised) in rank order;
        if any is an exception (other than a ``tolerate`` one, returned as a value), raise on
        every rank: this rank's own, else a ``RankFailure`` naming the first failed rank and
        its error."""
        outcomes = self._all_gather(_portable(outcome), phase)
        failed = [
            (r, o)
            for r, o in enumerate(outcomes)
            if isinstance(o, BaseException) and not isinstance(o, tolerate)
        ]
        if failed:
            if isinstance(outcome, BaseException) and not isinstance(outcome, tolerate):
                raise outcome
            rank, error = failed[0]
            raise RankFailure(
                f"unbroken.Checkpointer: {phase} failed on rank {rank}, so on every rank: "
                f"{type(error).__name__}: {error}"
            ) from error
        return outcomes

    def _all_gather(self, value: Any, phase: str) -> list[Any]:
        if self.process_group is None:
            return [value]
        out: list[Any] = [None] * self.world.size
        try:
            dist.all_gather_object(out, value, group=self.process_group)
        except Exception as error:
            raise self._lost(phase, error) from error
        return out

    def _lost(self, phase: str, error: BaseException) -> RankFailure:
        return RankFailure(
            f"unbroken.Checkpointer on rank {self.world.rank} of {self.world.size}: {phase} "
            "failed: another rank died, did not answer within the timeout of "
            f"{self.timeout:g} s, or did not call the same Checkpointer method at the same step "
            "(every rank must call save and load_latest together). "
            f"{type(error).__name__}: {error}"
        )

    def check_shared(self, storage: Storage, root: str) -> None:
        """Raise ``DirectoryNotShared`` on every rank unless all see rank 0's ``root``."""
        if self.process_group is None:
            return
        token = secrets.token_hex(8)
        folder = join(root, f"{SHARED}{token}")  # a directory: what Storage removes whole
        made: Any = token
        if self.world.first:
            try:
                storage.make_directories(root)
                storage.make_directory(folder)
                storage.write(join(folder, "token"), lambda out: out.write(token.encode()))
            except Exception as error:
                made = error
        token = self.settle(made, "checking the directory")[0]
        try:
            with storage.open_read(join(join(root, f"{SHARED}{token}"), "token")) as opened:
                seen = opened.read().decode(errors="replace") == token
        except OSError:
            seen = False
        everyone = self._all_gather(seen, "checking the directory")
        if self.world.first:
            storage.remove_tree(folder)
        blind = [rank for rank, saw in enumerate(everyone) if not saw]
        if blind:
            raise DirectoryNotShared(
                f"the checkpoint directory {root} is not shared: ranks {blind} do not see the "
                "file that rank 0 wrote into it (each node has its own disk there?). All ranks "
                "of a job must see one directory (a shared filesystem such as NFS or Lustre), "
                "or each would resume from its own checkpoints. Pass a directory on a shared "
                "filesystem."
            )


def _portable(outcome: Any) -> Any:
    """An exception that pickles (to reach the other ranks), else a ``RuntimeError`` saying it."""
    if isinstance(outcome, BaseException):
        try:
            pickle.loads(pickle.dumps(outcome))
        except Exception:
            return RuntimeError(f"{type(outcome).__name__}: {outcome}")
    return outcome


def attempt(function: Callable[..., T], *args: Any) -> T | BaseException:
    """``function(*args)``, or the exception it raised: what a rank hands to ``CheckpointGroup.settle``,
    so that a failure on one rank reaches the others instead of leaving them waiting."""
    try:
        return function(*args)
    except BaseException as error:
        return error
