"""One rank of ``benchmarks/goodput_ranks.py``'s 3-rank job, started by torchrun (gloo, CPU).

    torchrun --standalone --nproc-per-node=3 --max-restarts=K \\
        benchmarks/goodput_ranks_job.py RUN_DIR '{"policy": "jit", "steps": 600, ...}'

The same command starts the job and resumes it: torchrun restarts the whole group after a rank
fails, and ``unbroken.Trainer`` loads RUN_DIR's newest checkpoint. Options (JSON): ``policy``
(``none``: no periodic save and no just-in-time save, the reference; ``periodic``: a save every
``interval`` seconds; ``jit``: the same periodic saves and ``just_in_time=True``), ``steps``
(optimizer steps), ``interval`` (seconds), ``pg_timeout`` (the process group's timeout in
seconds: a rank that stops answering turns into a failure of the others' collective after it).

The job: 9,600 synthetic samples of 512 floats with a 10-class label, made from a fixed seed;
``__getitem__`` augments each read with draws from torch's generator (which the loader seeds
per batch): a random sign flip, a random mask of 10% of the features, and noise. An
``unbroken.DataLoader`` (map-style, shuffled, ``drop_last``: one global position, which a
survivor can save for every rank) of 32 samples a rank, so 100 optimizer steps an epoch; a DDP
MLP ``512 -> 1024 -> 1024 -> 10`` with dropout (1.6M parameters; with Adam's two moments a
checkpoint holds 19 MB of tensors) built after ``torch.manual_seed(0)`` on every rank; one
thread a rank. No torchmetrics: a survivor cannot know another rank's metric state, so they
would turn just-in-time saves off.

Each rank appends what it does to ``RUN_DIR/events.rank<r>.log``, one ``os.write`` a line (a
SIGKILL loses no line written), each ``KIND ATTEMPT ... TIME`` with ``time.time()``:
``pid A PID T`` first (the supervisor signals that pid), ``resume A STEP TICKS T`` once fit has
restored (or not) its checkpoint, ``b A STEP T`` as a step's batch enters ``training_step``
(STEP counts from 1, over the whole run), ``d A STEP T`` when its optimizer step is done,
``s A STEP T`` when a save starts after it, ``x A STEP T`` when ``fit`` raised (a peer
failed; a just-in-time save is done by then), and ``done A T`` after rank 0 wrote the final
weights to ``RUN_DIR/final.pt`` (the model's ``state_dict``).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
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

    def __init__(self, events: Events) -> None:
        self.events = events

    def on_fit_start(self, trainer) -> None:
        self.events.write("resume", trainer.progress.steps, trainer.progress.ticks)

    def on_optimizer_step(self, trainer) -> None:
        self.events.write("d", trainer.progress.steps)

    def on_save_start(self, trainer) -> None:
        self.events.write("s", trainer.progress.steps)


def main(run: Path, options: dict) -> None:
    torch.set_num_threads(1)
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
        progress_bar=False,
        tensorboard=False,
        log_every=50,
        callbacks=[Recorder(events)],
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
