"""A tiny but complete training job for the Trainer tests, in-process or as a subprocess.

Everything that can go wrong on resume is in it: a shuffled loader with torch/numpy/random
augmentation, dropout, SGD with momentum, an LR schedule, gradient accumulation, clipping, a
GradScaler, torchmetrics metrics, validation, and a stateful callback.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import unbroken


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int = 48, features: int = 8) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=generator)
        self.y = torch.randint(0, 3, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index] + 0.1 * torch.randn(self.x.shape[1])
        x = x * random.uniform(0.9, 1.1) + float(np.random.normal(0, 0.01))
        return x, self.y[index]


class Counter:
    """A callback with state: counts batches; its count is logged and must survive resumes."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, logs) -> None:
        self.batches += 1

    def on_epoch_end(self, trainer, logs) -> None:
        trainer.log({"callback_batches": self.batches})

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]


class SignalAt:
    """Sends `signum` to this process after the given batch of the given phase (test hook).

    `progress` is the loop's counters when the signal was sent: the preemption checkpoint
    must hold exactly these (not an earlier periodic checkpoint's).
    """

    def __init__(self, phase: str, batch: int, signum: int = signal.SIGTERM) -> None:
        self.phase, self.batch, self.signum = phase, batch, signum
        self.progress: dict | None = None

    def _send(self, trainer) -> None:
        self.progress = trainer.progress.state_dict()
        os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, logs) -> None:
        if self.phase == "train" and trainer.progress.batches == self.batch:
            self._send(trainer)

    def on_validation_batch_end(self, trainer, logs) -> None:
        if self.phase == "val" and trainer.progress.ticks == self.batch:
            self._send(trainer)


def kill_seed() -> int:
    """The seed of a test's random kill moments: $UNBROKEN_KILL_SEED, else a fresh one.

    Printed (pytest shows it with a failure) so that a failing run can be replayed with
    ``UNBROKEN_KILL_SEED=<seed> pytest ...``.
    """
    chosen = os.environ.get("UNBROKEN_KILL_SEED")
    seed = int(chosen) if chosen else random.SystemRandom().randrange(2**32)
    print(f"UNBROKEN_KILL_SEED={seed} (set it to replay these kill moments)")
    return seed


class Crash(Exception):
    """What CrashAt raises: a process that dies without saving (a bad batch, an OOM)."""


class CrashAt:
    """Raises Crash after the given training batch."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer, logs) -> None:
        if trainer.progress.batches == self.batch:
            raise Crash(f"crash at batch {self.batch}")


class Pace:
    """Slows each batch down and reports how many this process ran (for the SIGKILL test)."""

    def __init__(self, directory: Path, seconds: float) -> None:
        self.path, self.seconds, self.ran = Path(directory) / "status", seconds, 0

    def _tick(self, trainer, logs) -> None:
        self.ran += 1
        self.path.write_text(str(self.ran))
        time.sleep(self.seconds)

    on_train_batch_end = on_validation_batch_end = _tick


class NoisyStream(torch.utils.data.IterableDataset):
    """An iterable twin of Noisy with torch's Stateful protocol, sharded over workers."""

    def __init__(self, n: int = 30) -> None:
        self.data, self.position = Noisy(n), 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        shard = range(info.id, len(self.data), info.num_workers) if info else range(len(self.data))
        while self.position < len(shard):
            self.position += 1
            yield self.data[shard[self.position - 1]]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _combined_step(step):
    def fn(model, batch):  # both loaders' batches in one step: one loss over their union
        x = torch.cat([batch["map"][0], batch["stream"][0]])
        y = torch.cat([batch["map"][1], batch["stream"][1]])
        return step(model, (x, y))

    return fn


def run(
    directory,
    *,
    epochs=3,
    pace=None,
    combined=False,
    stream=False,
    workers=0,
    accumulate=2,
    checkpoint_every_steps=2,
    scaler=True,
    scheduler_interval="step",
    seed=0,
    dataset_length=48,
    hidden=16,
    callbacks=(),
    max_steps=None,
    context=None,
    clip_grad_norm=0.5,
    loader_seed=None,
    log_every=1,  # every batch's values: the tests read each row
    status=None,  # where Pace reports (default: the run directory)
    **trainer_options,
) -> nn.Module:
    from torchmetrics.classification import MulticlassAccuracy

    loader_seed = (
        seed if loader_seed is None else loader_seed
    )  # given: only the Trainer gets `seed`
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    train_loader = unbroken.DataLoader(
        Noisy(dataset_length),
        batch_size=5,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        seed=loader_seed,
        multiprocessing_context=context,
    )
    val_loader = unbroken.DataLoader(Noisy(20), batch_size=4, seed=loader_seed)
    if stream:  # an iterable dataset with its own state, sharded over the workers
        train_loader = unbroken.DataLoader(
            NoisyStream(60), batch_size=3, num_workers=workers, seed=loader_seed
        )
    if combined:  # a map-style and an iterable loader, Lightning's max_size_cycle
        stream = unbroken.DataLoader(
            NoisyStream(), batch_size=3, num_workers=workers, seed=loader_seed
        )
        train_loader = unbroken.CombinedLoader({"map": train_loader, "stream": stream})
    train_acc, val_acc = MulticlassAccuracy(3), MulticlassAccuracy(3)

    def step(metric):
        def fn(model, batch):
            x, y = batch
            logits = model(x)
            metric.update(logits, y)
            return {"loss": nn.functional.cross_entropy(logits, y), "mean_logit": logits.mean()}

        return fn

    trainer = unbroken.Trainer(
        directory,
        max_epochs=epochs,
        max_steps=max_steps,
        seed=seed,
        checkpoint_every_steps=checkpoint_every_steps,
        accumulate=accumulate,
        clip_grad_norm=clip_grad_norm,
        scheduler_interval=scheduler_interval,
        callbacks=[Counter(), *callbacks, *([Pace(status or directory, pace)] if pace else [])],
        log_every=log_every,
        **{"progress_bar": False, **trainer_options},
    )
    trainer.fit(
        model,
        optimizer,
        train_loader,
        val_loader,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler("cpu") if scaler else None,
        training_step=_combined_step(step(train_acc)) if combined else step(train_acc),
        validation_step=step(val_acc),
        train_metrics={"accuracy": train_acc},
        val_metrics={"accuracy": val_acc},
    )
    return model


if __name__ == "__main__":  # python trainer_job.py DIR '{"workers": 2, ...}'
    torch.set_num_threads(1)
    config = json.loads(sys.argv[2])
    if "url" in config:  # the run directory is in object storage; DIR is this "machine"'s disk
        model = run(config.pop("url"), status=Path(sys.argv[1]), **config)
    else:
        model = run(Path(sys.argv[1]), **config)
    torch.save(model.state_dict(), Path(sys.argv[1]) / "final.pt")
