"""Exact resume inside PyTorch Lightning 2.x: ``unbroken.lightning.ExactResume``.

Use::

    trainer = L.Trainer(
        callbacks=[ExactResume(), ModelCheckpoint(dirpath="ckpt", every_n_train_steps=50, save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")  # the same command starts and resumes the run

with ``unbroken.DataLoader`` for every loader of the fit. Give the ``ModelCheckpoint`` a fixed
``dirpath``: Lightning's default directory has a new ``version_N`` for every run, where
``ckpt_path="last"`` would find nothing.

- ``callback``: ``ExactResume``, what Lightning does not save or put back, preemption.
- ``advice``: its warnings where exactness is out of its hands, and what to do instead.
- ``loops``: what it reads of Lightning's loops (where a checkpoint would resume exactly), and
  what it changes in them after a resume.
- ``stops``: where a run stops: a preempted run that ends anyway finishes (exit 0).
- ``draws``: steps drawing from numpy or ``random`` after a resume with other worker counts.
- ``saved``: what it keeps in Lightning's checkpoint.
- ``io``: ``AtomicCheckpointIO``, checkpoint files written whole or not at all.
"""

from .callback import ExactResume
from .io import AtomicCheckpointIO
from .loops import LightningInternalsChanged

__all__ = ["AtomicCheckpointIO", "ExactResume", "LightningInternalsChanged"]
