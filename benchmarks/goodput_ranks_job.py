"""One rank of ``benchmarks/goodput_ranks.py``'s 3-rank job, started by torchrun (gloo, CPU).

How it measures, and what the numbers mean: ``docs/benchmarks/goodput-ranks.md``.

    torchrun --standalone --nproc-per-node=3 --max-restarts=K \
        benchmarks/goodput_ranks_job.py RUN_DIR '{"policy": "jit", "steps": 600, ...}'
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import unbroken
import unbroken.distributed

SAMPLES, FEATURES, HIDDEN, CLASSES, BATCH, RANKS = 9600, 512, 1024, 10, 32, 3
STEPS_PER_EPOCH = SAMPLES // (BATCH * RANKS)
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Events:
    """``RUN_DIR/events.rank<r>.log``, one ``os.write`` per line."""

    def __init__(self, run: Path, rank: int) -> None:
        run.mkdir(parents=True, exist_ok=True)
        path = run / f"events.rank{rank}.log"
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, kind: str, *fields: object) -> None:
        line = " ".join(str(f) for f in (kind, ATTEMPT, *fields, repr(time.time())))
        os.write(self.fd, (line + "\n").encode())


class Samples(torch.utils.data.Dataset):
    """Fixed features and learnable labels; each read drawn anew from torch's generator."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator)
        w = torch.randn(FEATURES, CLASSES, generator=generator)
        self.y = (self.x @ w).argmax(1)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        x = self.x[i] * (1.0 if torch.rand(()) < 0.5 else -1.0)
        x = x * (torch.rand(FEATURES) >= 0.1) + 0.05 * torch.randn(FEATURES)
        return x, self.y[i], i


class Recorder:
    """The events of the steps and saves (see the module); no ``state_dict``, so it is not
    checkpointed."""

    def __init__(self, events: Events, background: bool) -> None:
        self.events, self.background = events, background

    def on_fit_start(self, trainer) -> None:
        self.events.write("resume", trainer.progress.steps, trainer.progress.ticks)

    def on_optimizer_step(self, trainer) -> None:
        self.events.write("d", trainer.progress.steps)

    def on_save_start(self, trainer) -> None:
        self.events.write("s", trainer.progress.steps)
        if self.background:
            threading.Thread(
                target=self.watch, args=(trainer, trainer.progress.ticks), daemon=True
            ).start()

    def watch(self, trainer, ticks: int) -> None:
        """A background save's two moments, from the Checkpointer's public properties: ``sb``
        once its writer thread runs (``background_step`` is its step), ``sw`` once it is no
        longer in flight, with 1 if the checkpoint's directory is there (committed: every
        rank's writer waits for rank 0's commit before it ends) or 0 (the write failed, or a
        failure made the Checkpointer drop it: its thread may still run). Polled every 2 ms,
        for the save's length only."""
        checkpointer, steps = trainer.checkpointer, trainer.progress.steps
        final = Path(trainer.run.checkpoints) / f"step-{ticks:09d}"  # the library's layout
        deadline = time.monotonic() + 120.0
        while checkpointer.background_step != ticks:
            if time.monotonic() > deadline:
                return  # the save did not start (it raised: the job restarts)
            time.sleep(0.002)
        self.events.write("sb", steps)
        while checkpointer.in_flight:
            time.sleep(0.002)
        self.events.write("sw", steps, int(final.is_dir()))


def main(run: Path, options: dict) -> None:
    torch.set_num_threads(1)
    if options.get("hang_default", False):
        # Default settings: torch's process-group timeout, the Trainer's own hang handling.
        unbroken.distributed.init_process_group("gloo")
    else:
        timeout = datetime.timedelta(seconds=options.get("pg_timeout", 5))
        unbroken.distributed.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    events = Events(run, rank)
    events.write("pid", os.getpid())
    policy = options["policy"]
    if policy not in ("none", "periodic", "jit"):
        raise SystemExit(f"policy is {policy!r}; expected 'none', 'periodic' or 'jit'")

    torch.manual_seed(0)  # the same initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = unbroken.DataLoader(Samples(), batch_size=BATCH, shuffle=True, drop_last=True, seed=0)
    steps = options["steps"]
    trainer = unbroken.Trainer(
        run / "run",
        max_steps=steps,
        max_epochs=-(-steps // len(loader)),
        checkpoint_every_seconds=None if policy == "none" else options["interval"],
        just_in_time=policy == "jit",
        async_save=options.get("async_save", False),
        progress_bar=False,
        tensorboard=False,
        log_every=50,
        callbacks=[Recorder(events, options.get("async_save", False))],
    )

    def training_step(model, batch):
        events.write("b", trainer.progress.steps + 1)
        x, y, _ = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    try:
        trainer.fit(model, optimizer, loader, training_step=training_step)
    except BaseException:
        events.write("x", trainer.progress.steps)  # a peer failed: this rank leaves fit
        raise
    events.write("end", trainer.progress.steps)  # fit returned: this rank finished the run
    if rank == 0:
        partial = run / "final.pt.partial"
        torch.save(net.state_dict(), partial)
        os.replace(partial, run / "final.pt")
        events.write("done")
    # The DDP model goes before its process group (torn down after it at exit, DDP on gloo
    # aborts the process now and then).
    trainer = model = optimizer = None
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
