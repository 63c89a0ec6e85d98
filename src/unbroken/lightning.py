"""Exact resume inside PyTorch Lightning 2.x: ``unbroken.lightning.ExactResume``.

Lightning already saves its loop counters and, under ``loops.fit_loop.state_dict.combined_loader``,
the ``state_dict()`` of every training loader that has one, so an ``unbroken.DataLoader``
returned by ``train_dataloader()`` resumes at the batch after the checkpoint. Three things are
missing for a resumed run to end with the uninterrupted run's weights, and this callback adds
them:

- **The process's random generators.** Lightning saves none, so dropout after a resume draws
  other masks. The callback saves every rank's torch (CPU and CUDA), numpy and ``random``
  generators (``GlobalRNG``; each rank draws its own masks, and Lightning writes rank 0's file,
  so the ranks' states are gathered into it) and puts them back when training starts, after
  ``train_dataloader()`` and the sanity check ran, so nothing Lightning does before the first
  batch moves them.
- **Preemption.** SIGTERM and SIGUSR1 (``signals=``) only set a flag (``Preemption``); at the
  next training step's end the ranks agree on it (one all-reduce, every ``check_every`` steps),
  save ``last.ckpt`` in the ``ModelCheckpoint``'s directory (what ``ckpt_path="last"`` loads
  next) and exit with status 75 (EX_TEMPFAIL), for a scheduler to requeue the job.
- **Whole checkpoints.** Lightning writes a local checkpoint in place, so a kill during the
  write leaves a truncated ``last.ckpt`` that the next ``ckpt_path="last"`` fails to load.
  ``AtomicCheckpointIO`` writes to a temporary file, syncs it and renames it over the old one;
  the callback installs it unless the Trainer was given a checkpoint plugin of its own.

Use::

    trainer = L.Trainer(
        callbacks=[ExactResume(), ModelCheckpoint(dirpath="ckpt", every_n_train_steps=50, save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")  # the same command starts and resumes the run

Give the ``ModelCheckpoint`` a fixed ``dirpath``: Lightning's default directory has a new
``version_N`` for every run, where ``ckpt_path="last"`` would find nothing.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from .checkpoint.storage import LocalStorage
from .errors import CorruptState
from .train.globalrng import GlobalRNG
from .train.preemption import DEFAULT_SIGNALS, EXIT_CODE, Preemption
from .train.ranks import Job

__all__ = ["EXIT_CODE", "AtomicCheckpointIO", "ExactResume"]

_VERSION = 1


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose local writes are atomic: the checkpoint is
    written to a temporary file beside the target, synced, and renamed over it, so a file under
    the checkpoint's name is always a whole one. Paths with a protocol (``s3://``...) are written
    by Lightning, as before."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        target = os.fspath(path)
        if "://" in target:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                "AtomicCheckpointIO.save_checkpoint takes no storage_options (a local file)"
            )
        directory = os.path.dirname(os.path.abspath(target))
        storage = LocalStorage()  # the Checkpointer's durable directories and syncs
        storage.make_directories(directory)
        handle, temporary = tempfile.mkstemp(
            prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory
        )
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            os.unlink(temporary)
            raise
        storage.sync_directory(directory)  # the rename is durable once the directory is synced


class ExactResume(Callback):
    """Makes a Lightning run resumed from a checkpoint continue exactly (see the module).

    - ``signals``: the preemption signals (default SIGTERM and SIGUSR1); ``()`` leaves signal
      handling to Lightning.
    - ``check_every``: under ``torch.distributed``, the ranks agree on a preemption signal every
      this many training steps (one all-reduce of an int); 1 checks every step.
    """

    def __init__(self, signals: Any = DEFAULT_SIGNALS, check_every: int = 1) -> None:
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
        self.preemption = Preemption(signals)
        self.check_every = check_every
        self._restore: dict | None = None  # generator states loaded, put back at train start
        self._job: Job | None = None

    @property
    def state_key(self) -> str:
        return "unbroken.ExactResume"  # one per Trainer: not keyed by its arguments

    # Set-up and tear-down.
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._job = Job()
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's own
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.preemption.uninstall()

    # The random generators.
    def state_dict(self) -> dict[str, Any]:
        mine = GlobalRNG().state_dict()
        ranks: list = [mine]
        job = Job()
        if job.distributed:
            ranks = [None] * job.world_size
            dist.all_gather_object(ranks, mine)  # Lightning writes rank 0's checkpoint only
        return {"version": _VERSION, "rng": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (
            not isinstance(state_dict, dict)
            or state_dict.get("version") != _VERSION
            or not isinstance(state_dict.get("rng"), list)
            or not state_dict["rng"]
        ):
            raise CorruptState(
                "unbroken.lightning.ExactResume state: expected {'version': 1, 'rng': [one "
                f"generator state per rank]}}, got {str(state_dict)[:200]}"
            )
        saved = state_dict["rng"]
        job = Job()
        rank, world = job.rank, job.world_size
        if len(saved) != world:
            warnings.warn(
                f"unbroken.lightning.ExactResume: the checkpoint holds the random generators of "
                f"{len(saved)} ranks and this job has {world}; rank {rank} continues from rank "
                f"{rank % len(saved)}'s. Dropout and other draws of the training step will "
                "differ from the run that saved it (the data order does not).",
                stacklevel=2,
            )
        self._restore = saved[rank % len(saved)]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Over Lightning's own handlers, which it registers after the callbacks' setup: its
        # SIGTERM handler would stop the run before a checkpoint is saved.
        self.preemption.install()
        if self._restore is not None:
            GlobalRNG().load_state_dict(self._restore)
            self._restore = None

    # Preemption.
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._job is None or trainer.global_step % self.check_every:
            return
        (stop,) = self._job.any_of(self.preemption.requested)
        if not stop:
            return
        trainer.save_checkpoint(_last_path(trainer))  # on every rank: it gathers their states
        raise SystemExit(EXIT_CODE)


def _last_path(trainer: Trainer) -> str:
    """Where ``ckpt_path="last"`` looks first: ``last.ckpt`` in the ModelCheckpoint's dir."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
        name = callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION
        return os.path.join(callback.dirpath, name)
    return os.path.join(trainer.default_root_dir, "last.ckpt")
