"""Just-in-time saves: when a rank of a data-parallel job dies, a survivor saves the job.

In a DDP job every rank holds the whole replicated state: the model, the optimizer, the
scheduler, the loader's global position, the loop's counters. What differs between ranks is
derived or agreed on, so a survivor can write the checkpoint of a rank that died:

- the process RNGs are seeded before each optimizer step's first batch (and each validation
  batch) from the seed, the phase, the epoch, the step and the rank (``globalrng.seed_step``);
- each rank's running loss reaches every rank in the per-batch agreement: the preemption
  flag, the wall-clock flag, the batch's loss and the CSV log's size on rank 0 ride on the
  backward's gradient reduction (``agreement.Carrier``, ``agreed_on``), and every rank adds
  each rank's loss to its sum on the device; without a DDP model to ride on, one
  ``all_gather`` of the same four numbers a rank after each batch (``agree``);
- the loader's state is the same on every rank (``unbroken.DataLoader`` over a map-style
  dataset: a global position).

``take`` records, at every place a checkpoint can be resumed from with derived RNGs (after an
optimizer step, after each validation batch, at a phase's end), what changes between two such
places: the loop's counters, the loaders' states, the stateful callbacks' states and the log's
size. The model, optimizer, scheduler and scaler change only inside an optimizer step, which
runs no collective: so when a collective fails (a peer died: "Connection reset by peer"; or
stopped answering: the process group's timeout; or a checkpoint save lost a rank), the live
objects and the last record describe the same moment, the last completed step. A peer whose
process stops running is noticed sooner by the hang watchdog (``watchdog``): its thread calls
``on_failure`` while the loop waits in the collective (``halted`` keeps the loop from going on).

``on_failure`` then elects one survivor through torchrun's store (the agent serves it and
outlives the attempt: a compare-and-set on a key of this attempt) and that one writes the
checkpoint of the whole job from its own memory (``Checkpointer.save_alone``: no collective,
sealed and committed as every checkpoint). The others wait for its commit (at most
``WAIT_SECONDS``), and every survivor raises the error that stopped it, so torchrun restarts the
group, which resumes from the new checkpoint: the work lost is the step in flight. If the store
does not answer (the node whose agent served it died), no one is elected: each survivor says so
in one line, naming the last checkpoint, which the job, restarted on every node, resumes from.
A step counts as saved once its checkpoint is committed (``progress.saved_at``): a background save
(``async_save``) that a rank's death left unfinished is dropped, and its step saved this way.
Rank 0's log is saved as of the record too: its rows reach the file as rank 0 logs them
(``RunLog.log``), and a survivor saving for a dead rank 0 keeps the record's rows found there,
or writes the last one when rank 0 died before it and it is the batch's loss, which the
agreement carried (``logged_through``).

A model sharded by FSDP2 with replicas (HSDP: a mesh of replicas and shards) is saved by the
survivors together: one survivor holding each shard writes it through DCP, one writes the rest
from the record and commits (``jit_shards``).

Off (``off_because``) where a survivor cannot know the state of a rank that died: a model
sharded by FSDP2 with no replica of its shards, or saved through DCP, torchmetrics states (each
rank's own updates), a loader whose state is per rank, agreements less often than every batch,
no torchrun agent. A run directory in object storage is saved for only by rank 0 (the others
cannot upload its log), and not for an HSDP model.
Costs: one record per optimizer step (the loader's state and the counters, copied as plain
values: docs/benchmarks/unit-costs.md, row ``jit_record``), a few tensor ops a batch for the row
the reduction carries (no collective, no host read: ``benchmarks/trainer_ddp.py``), one
``TCPStore`` connection per rank.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.entries import PerRank, unwrap
from ..checkpoint.layout import final_name
from ..checkpoint.manager import Checkpointer
from ..checkpoint.sharded import Sharded, replica_shard
from ..checkpoint.writing import Staged
from ..data.loader import DataLoader
from ..distributed.process_group import attempt_store, under_agent
from . import jit_shards
from .agreement import Agreement, Received
from .checkpointing import CALLBACK, GRADIENTS, LOG, METRIC, MODEL, PROGRESS, RNG, is_sharded
from .csvlog import CSVLog, RunLog, line, log_state
from .globalrng import GlobalRNG
from .progress import Progress, ProgressState, say
from .rundir import METRICS, RunDirectory

WAIT_SECONDS = 25.0  # how long a survivor waits for the elected one's commit (torchrun: 30 s)


@dataclass
class Record:
    """What changes between two places a job can be resumed from with derived RNGs."""

    ticks: int
    progress: ProgressState  # its loss_sum is a placeholder: each rank's is in ``sums``
    sums: torch.Tensor  # each rank's running loss of the phase (float64, on the device)
    states: dict[str, Any]  # the loaders' and stateful callbacks' states, by entry name
    log_bytes: int | None  # rank 0's CSV log size; None until an agreement brings it
    base_bytes: int | None  # rank 0's log size at the last agreement before the record ...
    rows: int  # ... and the rows logged since then (the same on every rank) ...
    logged: int  # ... of all those logged by the record
    losses: tuple[int, torch.Tensor] | None  # the last agreement's tick and each rank's loss


class JustInTime:
    """The Trainer's just-in-time saves (see the module). ``enabled`` is False in one process
    and wherever ``off_because`` gives a reason; then every method does nothing."""

    def __init__(
        self,
        wanted: bool | None,
        agreement: Agreement,
        progress: Progress,
        entries: dict[str, Any],
        checkpointer: Checkpointer,
        run: RunDirectory,
        run_log: RunLog,
        check_every: int,
    ) -> None:
        self.agreement, self.progress, self.entries = agreement, progress, entries
        self.checkpointer, self.run, self.run_log = checkpointer, run, run_log
        self.log: CSVLog | None = run_log.csv  # rank 0's
        # At the last agreement: rank 0's log size, and the rows logged (by every rank's count).
        self.agreed: tuple[int, int] | None = None
        self.enabled = False
        self.acted = False  # a failure came and this rank saved, waited or declined
        # The thread saving for a hung peer (``watchdog``); the loop then stops (``_hold``).
        self.halted: int | None = None
        self.record: Record | None = None
        self.consistent = False  # the live objects are as the record says
        self.sums = torch.zeros(0, dtype=torch.float64)
        # The last agreement's tick and each rank's loss then (on the device, never read in a
        # step): rank 0's row of it, should rank 0 die before writing it (``_last_row``).
        self.losses: tuple[int, torch.Tensor] | None = None
        self.shard: tuple[int, int] | None = None  # HSDP: this rank's shard, and how many
        if not agreement.world.distributed or wanted is False:
            return
        reason = off_because(entries, check_every)
        if reason is not None:
            if wanted:
                raise ValueError(f"Trainer(just_in_time=True) cannot save for a rank: {reason}")
            say(f"just-in-time saves are off: {reason}; periodic checkpoints only")
            return
        self.enabled = True
        if isinstance(model := entries.get(MODEL), Sharded):
            self.shard = replica_shard(model.model)
        # This attempt's keys of torchrun's store: who saves, and the commit.
        self.store = dist.PrefixStore("jit", attempt_store(timedelta(seconds=WAIT_SECONDS + 5)))
        self.device = agreement.device
        # Each rank's running loss as restored (a collective, once): the agreements add to it.
        mine = torch.tensor([progress.loss.value()], dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(agreement.world.size)]
        dist.all_gather(gathered, mine)
        self.sums = torch.cat(gathered)

    def phase_started(self) -> None:
        """A phase's running losses start from zero, as ``Progress.start_phase`` does."""
        self.sums = torch.zeros_like(self.sums)  # never in place: a record may hold the last

    def log_bytes(self) -> int:
        """Rank 0's CSV log size now (0 on the other ranks), for the next agreement."""
        return self.log.size if self.log is not None else 0

    def agreed_on(self, losses: torch.Tensor, received: Received | None) -> None:
        """What a batch's reduction carried (``agreement.Carrier``): each rank's loss, added to
        its sum on the device; and, once the host has it, rank 0's log size as it was sent."""
        if not self.enabled:
            return
        # A new tensor, never an in-place add: the record holds the last one as it is, with
        # no copy of its own each batch (``take``).
        self.sums = self.sums + losses
        self.losses = (self.progress.ticks, losses)
        if received is None:
            return
        self.agreed = (received.log_bytes, received.rows)
        record = self.record
        if record is not None and record.log_bytes is None and record.ticks == received.ticks:
            record.log_bytes = received.log_bytes  # rank 0 logs nothing between the two

    def agree(self, preempted: bool, time_due: bool, loss: torch.Tensor) -> tuple[bool, bool]:
        """Every rank's flags, loss and (rank 0's) log size, gathered: whether any rank was
        preempted or is due a wall-clock save; each rank's loss is added to its sum."""
        size = self.log.size if self.log is not None else 0
        head = torch.tensor([preempted, time_due, size], dtype=torch.float64, device=self.device)
        mine = torch.cat([head, loss.detach().reshape(1).to(self.device, torch.float64)])
        gathered = [torch.empty_like(mine) for _ in range(self.agreement.world.size)]
        dist.all_gather(gathered, mine)
        stacked = torch.stack(gathered)
        rows = stacked.tolist()
        # Rank 0 logs nothing between a record and this: its size is the record's.
        record = self.record
        ticks = record.ticks if record is not None else self.progress.ticks
        received = Received(
            any(row[0] for row in rows),
            any(row[1] for row in rows),
            int(rows[0][2]),
            self.run_log.rows,
            ticks,
        )
        self.agreed_on(stacked[:, 3], received)
        return received.preempted, received.time_due

    def take(self) -> None:
        """Record the loop at a place it can be resumed from (see the module)."""
        if not self.enabled:
            return
        if self.halted is not None:
            _hold()  # the hang watchdog saves the last record: leave it as it is
        states = {}
        for name, entry in self.entries.items():
            obj = unwrap(entry)
            if isinstance(obj, DataLoader):
                states[name] = obj.state_dict()
            elif name.startswith(f"{CALLBACK}."):
                states[name] = copy.deepcopy(obj.state_dict())
        # Rank 0's rows are in the file already: ``RunLog.log`` hands them over as it logs.
        log_bytes = self.log.size if self.log is not None else None
        base, rows = self.agreed if self.agreed is not None else (None, 0)
        self.record = Record(
            self.progress.ticks,
            self.progress.state_with(0.0),
            self.sums,  # replaced, never changed in place (``agreed_on``): no copy needed
            states,
            log_bytes,
            base,
            self.run_log.rows - rows,
            self.run_log.rows,
            self.losses,
        )
        self.consistent = True

    def changing(self) -> None:
        """An optimizer or scheduler step begins: the live objects leave the record behind."""
        self.consistent = False  # before the look at ``halted``: see ``on_failure``
        if self.halted is not None:
            _hold()

    def on_failure(self, error: BaseException) -> None:
        """A collective failed (or anything else raised in the loop): save the job as of the
        record, if it is still what the live objects hold and newer than the last checkpoint.

        Also called by the hang watchdog's thread (``watchdog``), once it set ``halted``: the
        loop then stops before its next optimizer step, record or failure. This reads
        ``consistent`` before ``record`` (``take`` writes them in the other order), and
        ``changing`` clears ``consistent`` before it looks at ``halted``: whenever this reads
        ``consistent`` True, the record it reads next is the live objects'."""
        if self.halted not in (None, threading.get_ident()):
            _hold()  # the watchdog's thread saves and ends the process
        consistent, failed = self.consistent, time.perf_counter()
        record = self.record
        if not self.enabled or record is None:
            return
        if not consistent:
            say(
                f"no just-in-time save: {type(error).__name__} came between an optimizer step "
                "and the loop's record of it",
                every_rank=True,
            )
            return
        lost = self._background()
        if record.ticks in (0, self.progress.saved_at):
            return  # nothing trained since the last committed checkpoint
        rank = self.agreement.world.rank
        self.acted = True
        if self.run.remote and rank != 0:
            return  # only rank 0 can upload the run's log; the periodic checkpoint stays
        hsdp = self.shard is not None  # one survivor holding each shard writes it
        try:
            writer = rank if hsdp else int(self.store.compare_set("writer", "", str(rank)))
        except Exception as gone:  # the store's agent died with its node: no one can be elected
            say(self._store_gone(gone), every_rank=True)
            return
        try:
            if writer != rank:
                self._wait_for(writer)
                return
            try:
                deadline = failed + WAIT_SECONDS
                path = jit_shards.save(self, record, deadline) if hsdp else self._save(record)
                if path is None:
                    return  # another survivor holding its shard writes it, or commits
            except (LogUnknown, jit_shards.NoSave) as unknown:
                self.store.set("committed", "")
                say(f"no just-in-time save: {unknown}", every_rank=True)
                return
            self.store.set("committed", path)
        except Exception as failure:  # the previous checkpoint stays; the original error goes on
            say(
                f"just-in-time save failed on rank {rank}: {type(failure).__name__}: {failure}",
                every_rank=True,
            )
            return
        say(
            f"rank {rank} saved {self.progress_text(record)} for the job, just in time: {path}, "
            f"{time.perf_counter() - failed:.3f} s after {type(error).__name__}: "
            f"{str(error)[:200]}",
            every_rank=True,
        )
        if lost is not None:
            step, why = lost
            say(
                f"the background save of {final_name(step)} was lost ({why}); the just-in-time "
                f"save of {final_name(record.ticks)} covers it",
                every_rank=True,
            )

    def _store_gone(self, failure: BaseException) -> str:
        """The one line a survivor says when torchrun's store does not answer the election."""
        saved = self.progress.saved_at
        fallback = final_name(saved) if saved > 0 else "the run's start"
        why = (str(failure).splitlines() or [""])[0][:120]
        return (
            f"no just-in-time save: torchrun's store did not answer ({type(failure).__name__}: "
            f"{why}), so no survivor can be elected to save; the node whose agent served it "
            f"died: restart the job on every node, it resumes from its last checkpoint, {fallback}"
        )

    def _background(self) -> tuple[int, str] | None:
        """The background save, if any, settled without waiting: committed (``saved_at``), or
        lost, with why. One still in flight waits on the rank that died: dropped, and lost
        (any files it left are never committed; the next save removes them)."""
        checkpointer, step = self.checkpointer, self.checkpointer.background_step
        if step is None:
            return None
        if checkpointer.in_flight:
            checkpointer.forget_background()
            return step, "still in flight"
        try:
            checkpointer.wait()  # it has ended: this returns at once
        except Exception as failure:
            return step, f"{type(failure).__name__}: {str(failure)[:200]}"
        self.progress.saved_at = step
        return None

    def obey(self, received: signal.Signals | None) -> None:
        """After ``fit``'s handlers are gone: die of the signal that came while this survivor
        saved or waited. torchrun's agent sends SIGTERM to the survivors once a rank died; one
        busy saving only noted it, and would otherwise leave by the interpreter's teardown,
        2-3 s measured on 3 CPU ranks, which delays torchrun's restart (benchmarks:
        goodput_ranks). A survivor without a save to make dies of it at once."""
        if self.acted and received is not None:
            logging.shutdown()  # the save's lines reach the job's log first
            os.kill(os.getpid(), received)

    def _wait_for(self, writer: int) -> None:
        try:
            self.store.wait(["committed"], timedelta(seconds=WAIT_SECONDS))
            saved = self.store.get("committed").decode()
            if saved:
                say(f"rank {writer} saved the job just in time: {saved}")
        except Exception as error:
            say(f"rank {writer} was to save the job just in time and did not ({error})", True)

    def _save(self, record: Record, staged: Staged | None = None) -> str:
        """The checkpoint of the job as of ``record``, from this rank's memory; a ``Sharded``
        entry's files are ``staged`` already (``jit_shards``)."""
        replicated: dict[str, Any] = {}
        parts: dict[str, list[Any]] = {}
        world = self.agreement.world.size
        sums = record.sums.tolist()
        progress = [{**record.progress, "loss_sum": sums[rank]} for rank in range(world)]
        for name, entry in self.entries.items():
            if name == LOG or isinstance(entry, Sharded):
                continue  # the log below: the record's size; shards: ``staged``
            if name == PROGRESS:
                parts[name] = progress
            elif name == RNG:  # any: the RNGs are seeded before the next batch
                parts[name] = [GlobalRNG().state_dict()] * world
            elif name in record.states:
                value = record.states[name]
                if isinstance(entry, PerRank):
                    parts[name] = [value] * world
                else:
                    replicated[name] = value
            elif name == GRADIENTS:  # none at a step boundary
                model = unwrap(entry).model
                none = {param: None for param, _ in model.named_parameters()}
                if isinstance(entry, PerRank):  # a sharded model's: each rank's shards
                    parts[name] = [none] * world
                else:
                    replicated[name] = none
            elif isinstance(entry, PerRank):
                raise AssertionError(f"no record of the per-rank entry {name!r}")
            else:
                replicated[name] = entry  # the model, optimizer, scheduler, scaler: as they are
        # The hash of rank 0's log up to the record, read from the file (a failure's cost).
        replicated[LOG] = log_state(self.run.local / METRICS, self._log_bytes(record))
        return self.checkpointer.save_alone(record.ticks, replicated, parts, staged)

    def _log_bytes(self, record: Record) -> int:
        """Rank 0's log size at the record: its own, or what the next agreement brought; if
        rank 0 died before that, read from the file (see ``logged_through``)."""
        if record.log_bytes is not None:
            if self.log is not None and self.log.publish is not None:
                self.log.publish(record.log_bytes)  # a run directory in object storage
            return record.log_bytes
        if record.base_bytes is None:
            raise LogUnknown("no agreement since the run started brought rank 0's log size")
        path = self.run.local / METRICS
        return logged_through(path, record.base_bytes, record.rows, self._last_row(record))

    def _last_row(self, record: Record) -> bytes | None:
        """Rank 0's last row of the record as a survivor knows it, or None: only the loss of
        the record's own batch, which the agreement carried (exact: a float64 holds any
        float32 or lower), and never a zero, whose sign the agreement's sum may have lost."""
        row = self.run_log.loss_row
        if row is None or record.losses is None or row.index != record.logged - 1:
            return None
        tick, losses = record.losses
        if not row.tick == tick == record.ticks:
            return None
        value = float(losses[0])  # a failure's cost, never a step's
        if value == 0.0:
            return None
        return line(row.step, row.epoch, row.phase, "loss", value).encode()

    def progress_text(self, record: Record) -> str:
        saved = Progress(config=self.progress.config)
        saved.load_state_dict({**record.progress, "loss_sum": 0.0})
        return saved.where()


def _hold() -> None:
    """The loop's thread, once the hang watchdog saves for a hung peer: it waits for the
    watchdog to end the process (``os._exit``), changing nothing meanwhile."""
    threading.Event().wait()


class LogUnknown(RuntimeError):
    """What rank 0 logged up to the record cannot be told: no just-in-time save."""


def logged_through(path: Any, base: int, rows: int, last: bytes | None = None) -> int:
    """The size of rank 0's log at a record, read from the file after rank 0 died: ``base``
    bytes at the last agreement, then ``rows`` more rows logged before the record (every rank
    counts them). Rank 0 hands each row to the file as it logs it, so the file holds:

    - ``rows`` whole rows or more (rank 0 died after the record, having logged the next
      step's rows, or a part of one): the record's are the first ``rows``;
    - one fewer (rank 0 died between its step's agreement and its row), where ``last`` is
      that row as the survivors know it (``JustInTime._last_row``): it is written in the
      place of what rank 0 left of it.

    Raises:
        LogUnknown: fewer rows, and only rank 0 knew them.
    """
    with open(path, "rb") as file:
        file.seek(base)
        after = file.read()
    found, end = 0, 0  # the whole rows found, up to ``rows``, and where they end
    while found < rows and (cut := after.find(b"\n", end) + 1):
        found, end = found + 1, cut
    if found == rows:
        return base + end
    if found == rows - 1 and last is not None:
        with open(path, "r+b") as file:
            file.seek(base + end)
            file.truncate()  # a part of the row, if rank 0 died writing it
            file.write(last)
        return base + end + len(last)
    raise LogUnknown(
        f"{rows - found} of rank 0's {rows} log row(s) of the last step never reached the file "
        f"({found} whole row(s) found), and only rank 0 knew them: the step's log cannot be saved"
    )


def off_because(entries: dict[str, Any], check_every: int) -> str | None:
    """Why a survivor cannot save for a rank that died, or None if it can."""
    if not under_agent():
        return "the job was not started by torchrun, whose agent's store elects the saver"
    model = entries.get(MODEL)
    if isinstance(model, Sharded):  # how the Trainer holds a sharded model (``through_dcp``)
        if not is_sharded(model.model):
            return "the model is saved through DCP (the run was saved by a sharded model)"
        if replica_shard(model.model) is None:  # HSDP's replicas hold every shard: jit_shards
            return (
                "the model is sharded (FSDP2) with no replica of its shards (as HSDP has): a "
                "rank's shards die with it"
            )
    elif isinstance(model, torch.nn.Module) and is_sharded(model) or MODEL not in entries:
        return "the model is sharded (FSDP2): a rank's shards die with it"
    if any(name.startswith(f"{METRIC}.") for name in entries):
        return "torchmetrics states are per rank (each rank's own updates)"
    if check_every != 1:
        return "preemption_check_every > 1: the ranks' losses are agreed on every batch only"
    for name, entry in entries.items():
        obj = unwrap(entry)
        if isinstance(entry, PerRank) and name.endswith("loader"):
            if not isinstance(obj, DataLoader) or obj.state_dict().get("source") is not None:
                return (
                    f"{name} keeps a state of its own on each rank (a map-style dataset in an "
                    "unbroken.DataLoader has one global position)"
                )
    return None
