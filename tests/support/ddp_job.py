"""A data-parallel training job for test_distributed_trainer.py, run by torchrun (gloo, CPU).

``python ddp_job.py RUN_DIR OPTIONS_JSON``: a DDP MLP with dropout trained by unbroken.Trainer
over a map-style dataset split by unbroken.DataLoader, with a torchmetrics accuracy. OPTIONS:

- ``epochs``, ``every_steps``, ``accumulate``: Trainer settings.
- ``kill``: {"rank": r, "at": [tick, ...]}: that rank SIGKILLs itself after those training
  ticks, each once over all restarts (a marker file per kill), as a crashed node would.
- ``kill_in_hook``: [{"rank": r, "hook": name, "at": tick, "ms": m}, ...]: that rank spends
  ``m`` ms in callback hook ``name`` (``on_train_batch_end`` or ``on_optimizer_step``) at that
  training tick, then SIGKILLs itself there, once (a slow callback that dies).
- ``kill_in_save``: {"rank": r, "write": n}: that rank SIGKILLs itself in its n-th file write
  of a checkpoint (counted over all restarts), so other ranks may have written theirs.
- ``async_save``: the Trainer's; with ``kill_in_save``, that rank's next step waits for its
  background save, so it dies in the save before the step's collectives, not a step later.
- ``signal``: {"rank": r, "at": tick}, or a list of them: that rank sends itself SIGTERM after
  that tick, once. ``check_every``: the Trainer's ``preemption_check_every``.
- ``slow_exit``: {"rank": r, "seconds": s}: after a preemption checkpoint, that rank takes
  that long to exit.
- ``stop``: {"rank": r, "at": tick}: that rank SIGSTOPs itself after that tick, once (a hung
  rank); ``pg_timeout``: the process group's timeout in seconds (gloo's default: 30 min);
  ``hang_timeout``: the Trainer's (left out: its default).
- ``val``: true adds a validation loader (48 samples) and step; ``kill_in_step``: see
  ``kill_in_step`` below; ``kill``'s ``rank`` may be a list (ranks dying at once).
- ``metrics``: false leaves the torchmetrics accuracy out (the state a survivor cannot know);
  ``jit``: the Trainer's ``just_in_time``; ``log_every``: the Trainer's (default 1).
- ``step_ms``: each training step sleeps that long first, so that a test's kill from outside
  lands at a moment it chose, not after the run's end.
- ``plain``: the model unwrapped (one process continuing a job of several).
- ``fsdp``: shard the model with FSDP2 (``fully_shard``) instead of wrapping it in DDP.
- ``hsdp``: the same over a 2-D mesh of ``(WORLD // 2, 2)`` ranks, dims ``("replicate",
  "shard")``: FSDP2's HSDP, each replica (a row of 2 ranks) holding every shard.
- ``count``: count, per training tick, the host reads of tensor values made by the library
  (``item``, ``tolist``, ``bool``, ``float``, ``int`` called from ``unbroken/``, outside the
  loader, whose index tensors live on the host in any run) and the collectives it issues,
  blocking or not, outside the gradient reduction's hook; written to ``counts.rank<r>.json``.
  The running loss takes its device way (``LossSum.on_device``), as on an accelerator.

Every rank appends the sample ids it trained on to ``RUN_DIR/seen.rank<r>.jsonl`` (one line per
batch: epoch, tick, ids, loss) and each epoch's logged mean loss to ``epochs.rank<r>.jsonl``;
rank 0 writes the final weights to ``RUN_DIR/final.pt``.
"""

import datetime
import faulthandler
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchmetrics

import unbroken
import unbroken.distributed

RUN, OPTIONS = Path(sys.argv[1]), json.loads(sys.argv[2])
RUN.mkdir(parents=True, exist_ok=True)
N, FEATURES, CLASSES = 240, 12, 4

torch.set_num_threads(1)
faulthandler.register(signal.SIGUSR2, all_threads=True)  # a stuck job says where
timeout = OPTIONS.get("pg_timeout")
unbroken.distributed.init_process_group(
    "gloo", timeout=datetime.timedelta(seconds=timeout) if timeout else None
)
RANK, WORLD = dist.get_rank(), dist.get_world_size()


class Samples(torch.utils.data.Dataset):
    """Fixed features and labels; each sample gets its own noise (its seed is derived)."""

    def __init__(self, n=N):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, FEATURES, generator=generator)
        self.y = torch.randint(0, CLASSES, (n,), generator=generator)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        noise = 0.1 * torch.randn(FEATURES, generator=unbroken.sample_rng())
        return self.x[index] + noise, self.y[index], index


def _ranks(option):
    rank = option["rank"]
    return rank if isinstance(rank, list) else [rank]


def kill_in_step(phase):
    """``kill_in_step``: [{"rank": r, "at": tick, "phase": "train"|"val"}, ...]: that rank
    SIGKILLs itself inside the step that makes that tick, before its forward: the other ranks
    are left waiting in a collective of that step."""
    tick = trainer.progress.ticks + 1
    for kill in OPTIONS.get("kill_in_step", []):
        if kill["phase"] == phase and kill["rank"] == RANK and kill["at"] == tick:
            if once(f"kill-in-step-{tick}"):
                os.kill(os.getpid(), signal.SIGKILL)


def kill_in_hook(hook):
    """``kill_in_hook``: this rank, in callback ``hook`` at a tick the option names, waits
    its ``ms`` then SIGKILLs itself."""
    tick = trainer.progress.ticks
    for kill in OPTIONS.get("kill_in_hook", []):
        if kill["hook"] == hook and kill["rank"] == RANK and kill["at"] == tick:
            if once(f"kill-in-{hook}-{tick}"):
                time.sleep(kill.get("ms", 0) / 1000)
                os.kill(os.getpid(), signal.SIGKILL)


class Counted:
    """The ``count`` option: wraps torch's host reads and collectives with counters."""

    READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
    COLLECTIVES = (
        "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier",
        "reduce_scatter_tensor", "gather", "scatter", "all_gather_object",
        "broadcast_object_list", "all_to_all", "reduce",
    )  # fmt: skip

    def __init__(self):
        self.now = {"reads": 0, "blocking": 0, "collectives": 0}
        self.ticks = {}
        for name in self.READS:
            setattr(torch.Tensor, name, self._read(getattr(torch.Tensor, name)))
        for name in self.COLLECTIVES:
            setattr(dist, name, self._collective(getattr(dist, name)))

    @staticmethod
    def _caller():
        frame = sys._getframe(2)
        while frame is not None and "/torch/" in frame.f_code.co_filename:
            frame = frame.f_back
        return frame.f_code.co_filename if frame is not None else ""

    def _read(self, method):
        def counted(tensor, *args, **kwargs):
            where = self._caller()
            if "/unbroken/" in where and "/unbroken/data/" not in where:
                self.now["reads"] += 1
            return method(tensor, *args, **kwargs)

        return counted

    def _collective(self, function):
        def counted(*args, **kwargs):
            where = self._caller()
            if "/unbroken/" in where and not where.endswith("reduction.py"):
                self.now["collectives"] += 1
                self.now["blocking"] += not kwargs.get("async_op", False)
            return function(*args, **kwargs)

        return counted

    def tick(self, tick):
        self.ticks[tick] = dict(self.now)
        self.now = dict.fromkeys(self.now, 0)


def once(name):
    """True the first time over all restarts of the job."""
    marker = RUN / f".done-{name}"
    if marker.exists():
        return False
    marker.touch()
    return True


class Chaos:
    """Records what this rank trained on (and its loss), and each epoch's logged mean loss;
    kills or signals it where the options say."""

    def on_fit_start(self, trainer):  # the process RNG's seed once the run is restored
        (RUN / f"fit.rank{RANK}.json").write_text(json.dumps(torch.initial_seed()))
        if COUNTED is not None:
            trainer.progress.loss.on_device = True  # as on an accelerator: no read a batch
            COUNTED.tick(0)  # from here on: what the loop itself does

    def on_epoch_end(self, trainer, logs):
        with open(RUN / f"epochs.rank{RANK}.jsonl", "a") as out:
            out.write(json.dumps([trainer.progress.epoch, logs.get("train/epoch_loss")]) + "\n")

    def __init__(self):
        self.seen = open(RUN / f"seen.rank{RANK}.jsonl", "a")

    def on_train_batch_end(self, trainer, logs):
        tick = trainer.progress.ticks
        if COUNTED is not None:
            COUNTED.tick(tick)
        line = [trainer.progress.epoch, tick, trainer.last_ids, logs.get("train/loss")]
        self.seen.write(json.dumps(line) + "\n")
        self.seen.flush()
        kill_in_hook("on_train_batch_end")
        kill = OPTIONS.get("kill")
        if kill and RANK in _ranks(kill) and tick in kill["at"] and once(f"kill-{RANK}-{tick}"):
            os.kill(os.getpid(), signal.SIGKILL)
        stop = OPTIONS.get("stop")
        if stop and stop["rank"] == RANK and tick == stop["at"] and once(f"stop-{tick}"):
            os.kill(os.getpid(), signal.SIGSTOP)
        signals = OPTIONS.get("signal", [])
        for sig in signals if isinstance(signals, list) else [signals]:
            if sig["rank"] == RANK and tick == sig["at"] and once(f"signal-{RANK}"):
                os.kill(os.getpid(), signal.SIGTERM)

    def on_optimizer_step(self, trainer):
        kill_in_hook("on_optimizer_step")

    def on_preempted(self, trainer, seconds):
        # The preemption checkpoint is committed; this rank is slow to exit (the script's own
        # clean-up as fit raises SystemExit, below): torchrun sends SIGTERM to it once another
        # rank has exited, which must not kill it.
        slow = OPTIONS.get("slow_exit", {})
        if slow.get("rank") == RANK:
            trainer.slow_exit = slow["seconds"]


if OPTIONS.get("kill_in_save", {}).get("rank") == RANK:
    from unbroken.checkpoint import FsspecStorage, LocalStorage

    # The run directory's storage: object storage for a "url" option.
    Writer = FsspecStorage if OPTIONS.get("url") else LocalStorage
    write = Writer.write

    def dying_write(self, path, fill):
        count = RUN / ".writes"
        done = int(count.read_text()) if count.exists() else 0
        count.write_text(str(done + 1))
        if done + 1 == OPTIONS["kill_in_save"]["write"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return write(self, path, fill)

    Writer.write = dying_write


COUNTED = Counted() if OPTIONS.get("count") else None

torch.manual_seed(0)  # the same initial weights on every rank
net = torch.nn.Sequential(
    torch.nn.Linear(FEATURES, 32),
    torch.nn.ReLU(),
    torch.nn.Dropout(0.2),
    torch.nn.Linear(32, CLASSES),
)
if OPTIONS.get("fsdp") or OPTIONS.get("hsdp"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if OPTIONS.get("hsdp"):
        mesh = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (WORLD,))
    for layer in (net[0], net[3]):
        fully_shard(layer, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
elif OPTIONS.get("plain"):
    model = net  # one process continuing a job: the model as it is
else:
    model = torch.nn.parallel.DistributedDataParallel(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loader = unbroken.DataLoader(Samples(), batch_size=4, shuffle=True, seed=7)
accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
trainer = unbroken.Trainer(
    OPTIONS.get("url", RUN),  # "url": the run directory in object storage; RUN keeps the markers
    storage_options=OPTIONS.get("storage_options"),
    lease_seconds=OPTIONS.get("lease_seconds", 30.0),
    max_epochs=OPTIONS.get("epochs", 2),
    checkpoint_every_steps=OPTIONS.get("every_steps", 5),
    accumulate=OPTIONS.get("accumulate", 1),
    checkpoint_every_seconds=None,
    progress_bar=False,
    tensorboard=False,
    log_every=OPTIONS.get("log_every", 1),  # Chaos records each batch's loss from `logs`
    callbacks=[Chaos()],
    preemption_check_every=OPTIONS.get("check_every", 1),
    just_in_time=OPTIONS.get("jit"),
    async_save=OPTIONS.get("async_save", False),
    **({"hang_timeout": OPTIONS["hang_timeout"]} if "hang_timeout" in OPTIONS else {}),
)
metrics = {"acc": accuracy} if OPTIONS.get("metrics", True) else None


def hold_for_background_save():
    """``async_save`` with ``kill_in_save``: the dying rank's step waits for its background save
    to end (its death, in the write that kills it), before the step's first collective."""
    if OPTIONS.get("async_save") and OPTIONS.get("kill_in_save", {}).get("rank") == RANK:
        while trainer.checkpointer.in_flight:
            time.sleep(0.01)


def training_step(model, batch):
    hold_for_background_save()
    time.sleep(OPTIONS.get("step_ms", 0) / 1000)
    kill_in_step("train")
    x, y, ids = batch
    trainer.last_ids = ids.tolist() if COUNTED is None else None  # the user's read: not ours
    logits = model(x)
    if metrics:
        accuracy.update(logits.detach(), y)
    return torch.nn.functional.cross_entropy(logits, y)


def validation_step(model, batch):
    kill_in_step("val")
    x, y, _ = batch
    return torch.nn.functional.cross_entropy(model(x), y)


val = OPTIONS.get("val") and unbroken.DataLoader(Samples(48), batch_size=4, seed=11)
try:
    logs = trainer.fit(
        model,
        optimizer,
        loader,
        val or None,
        training_step=training_step,
        validation_step=validation_step if val else None,
        train_metrics=metrics,
    )
finally:
    time.sleep(getattr(trainer, "slow_exit", 0))  # on_preempted, with slow_exit
if OPTIONS.get("fsdp") or OPTIONS.get("hsdp"):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
else:
    weights = net.state_dict()
if COUNTED is not None:
    (RUN / f"counts.rank{RANK}.json").write_text(json.dumps(COUNTED.ticks))
if RANK == 0:
    torch.save(weights, RUN / "final.pt")
    (RUN / "logs.json").write_text(json.dumps(logs))
# The DDP model goes before its process group: torn down after it at interpreter exit, torch's
# DDP on gloo aborts the process now and then (see unbroken.preemption.exit_to_be_requeued).
trainer = model = optimizer = None
gc.collect()
dist.destroy_process_group()
