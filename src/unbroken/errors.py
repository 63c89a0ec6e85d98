"""What unbroken raises when a state or a checkpoint cannot be used, as types a caller can catch.

All three subclass ``ValueError`` (what unbroken raised before they existed), so an existing
``except ValueError`` still catches them:

- ``StateMismatch``: a state saved under another configuration than the object loading it
  (seed, batch size, dataset length, mode, ...), by another kind of object (``format``) or by
  another version of unbroken (``version``). ``field``, ``saved`` and ``current`` name the
  difference; resume with the saved setting or start a new run.
- ``CorruptState``: a state that no run of this object could have produced: a field missing,
  of the wrong type or out of range, counters that contradict each other. ``field`` names it
  when one field is to blame.
- ``CorruptCheckpoint``: a checkpoint directory whose manifest or files fail verification.
  ``Checkpointer.load_latest`` skips such a checkpoint with a warning; loading a named one
  raises this.

Three kinds of ``RuntimeError`` say that processes, not states, are at odds:

- ``DirectoryInUse``: another process trains in the run directory.
- ``RankFailure``: under ``torch.distributed``, another rank failed a collective checkpoint
  step (its error is in the message), died, or did not arrive within the timeout.
- ``DirectoryNotShared``: the ranks of one job do not see the same checkpoint directory.

Two say that a sharded dataset (``unbroken.streaming``) cannot be read:

- ``CorruptShard`` (a ``ValueError``): a shard whose size, checksum or rows differ from its
  index, downloaded twice; or an index that does not describe its shards.
- ``RemoteUnavailable`` (a ``ConnectionError``): the storage did not answer after the retries.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CorruptCheckpoint",
    "CorruptShard",
    "CorruptState",
    "DirectoryInUse",
    "DirectoryNotShared",
    "RankFailure",
    "RemoteUnavailable",
    "StateMismatch",
]


class StateMismatch(ValueError):
    """A saved state was taken with another configuration than the object loading it has.

    ``field``, ``saved`` and ``current`` are kept as attributes, also across processes.

    Args:
        what: The object that refuses the state, e.g. ``"unbroken.DataLoader"``. Alone, it is
            the whole message (how torch re-raises a worker's error).
        field: The state's field that differs.
        saved: The field's value in the state.
        current: The field's value in the object loading it.
        hint: What to do, in place of "Resume with the same setting, or start a new run."
        holder: What the object is called in the message (``"loader"``).
        message: The whole message, in place of the one made from the fields.
    """

    def __init__(
        self,
        what: str,
        field: str | None = None,
        saved: Any = None,
        current: Any = None,
        hint: str = "",
        holder: str = "loader",
        message: str | None = None,
    ) -> None:
        self.what, self.field, self.saved, self.current = what, field, saved, current
        if field is None:  # StateMismatch(message): how torch re-raises a worker's error
            message = what
        super().__init__(
            message
            or (
                f"{what}: the state was saved with {field}={saved!r} but this {holder} has "
                f"{field}={current!r}. {hint or 'Resume with the same setting, or start a new run.'}"
            )
        )

    def __reduce__(self) -> Any:  # keeps field, saved and current across processes
        return (
            type(self),
            (self.what, self.field, self.saved, self.current, "", "loader", str(self)),
        )


class CorruptState(ValueError):
    """A state that is malformed or inconsistent: no run of this object saved it as it is.

    Args:
        message: What is wrong, naming the field, and what to do.
        field: The field to blame, when one is; kept as an attribute.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


class CorruptCheckpoint(ValueError):
    """A checkpoint whose manifest or files fail verification."""


class DirectoryInUse(RuntimeError):
    """Another live process holds the run directory; two writers would corrupt each other."""


class RankFailure(RuntimeError):
    """Another rank failed, died or timed out in a step that every rank takes together."""


class DirectoryNotShared(RuntimeError):
    """The ranks of one job see different checkpoint directories (each node its own disk)."""


class CorruptShard(ValueError):
    """A shard of a sharded dataset does not match its index (size, checksum, rows)."""


class RemoteUnavailable(ConnectionError):
    """The storage behind a URL did not answer after the retries."""


def prefixed(error: ValueError, prefix: str) -> ValueError:
    """The same kind of error with ``prefix`` in front of its message: a wrapper (a combined
    loader, a shuffle buffer) says which of its parts refused a state."""
    message = f"{prefix}{error}"
    if isinstance(error, StateMismatch):
        return StateMismatch(error.what, error.field, error.saved, error.current, message=message)
    if isinstance(error, CorruptState):
        return CorruptState(message, error.field)
    return ValueError(message)
