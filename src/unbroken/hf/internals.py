"""What ``unbroken.hf.Trainer`` reads and writes of ``transformers.Trainer`` beyond its public API.

transformers has no hook for three things an exact resume needs. This module touches exactly five
private attributes of the Trainer and replaces one global of ``transformers.trainer``, in one
place, and only on the versions this was tested with (``TESTED``):

- **the logging accumulators**, read and written: ``_tr_loss`` (this rank's loss summed since
  the last log, a tensor) and ``_globalstep_last_logged``. transformers starts a resumed run
  with both at zero, so the first loss it logs after a resume averages other steps than the
  uninterrupted run's. They are saved with each checkpoint and put back at ``on_train_begin``, after transformers
  has reset them and before the first step.
- **the training collator and columns**, called or read only: ``_remove_unused_columns`` and
  ``_get_collator_with_removed_columns``, the two methods ``get_train_dataloader`` uses to drop
  the columns the model does not take, and ``_train_batch_size``, the per-device batch size
  (``auto_find_batch_size`` changes it).
- **the skip of a resumed epoch's first batches**: transformers calls
  ``accelerate.skip_first_batches(loader, n)``, which rebuilds the loader as a new torch
  ``DataLoader`` that reads and drops ``n`` batches. The name ``skip_first_batches`` in
  ``transformers.trainer`` (one name, in one module) is replaced by ``_skip``: for the training
  loader of ``unbroken.hf.Trainer``, which a resume already put at batch ``n``, it checks that
  position and returns the loader as it is; anything else goes to accelerate's function. The
  rest of transformers' resume logic (which optimizer step comes next, where the accumulation
  windows fall, when the random states are put back) runs as written.

An untested version is refused before training starts (``UntestedTransformers``), unless
``UNBROKEN_HF_UNTESTED=1`` is set: then it is warned about, and any of these names that is
gone still fails with the name.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers
import transformers.trainer

TESTED = ((5, 23), (5, 24))  # the first and last transformers minor versions tested
_NAMES = ("_remove_unused_columns", "_get_collator_with_removed_columns", "_train_batch_size")
_LOOP_NAMES = ("_tr_loss", "_globalstep_last_logged")


class UntestedTransformers(RuntimeError):
    """The installed transformers is not a version ``unbroken.hf`` was tested with."""


def version() -> tuple[int, int]:
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_version() -> None:
    """Refuse (or, with ``UNBROKEN_HF_UNTESTED=1``, warn about) an untested transformers."""
    low, high = TESTED
    if low <= version() <= high:
        return
    message = (
        f"unbroken.hf was tested with transformers {low[0]}.{low[1]} to {high[0]}.{high[1]}, "
        f"and {transformers.__version__} is installed. It reads private attributes of the Trainer "
        "and replaces one name in transformers.trainer (unbroken/hf/internals.py), which another "
        "version may have changed. Install a tested version (pip install "
        f"'transformers>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'), "
        "or set UNBROKEN_HF_UNTESTED=1 to try this one and compare a resumed run with an "
        "uninterrupted one."
    )
    if os.environ.get("UNBROKEN_HF_UNTESTED") == "1":
        warnings.warn(message, stacklevel=3)
        return
    raise UntestedTransformers(message)


def install_skip(is_ours: Callable[[Any], bool], skip: Callable[[Any, int], Any]) -> None:
    """Replace ``transformers.trainer.skip_first_batches``: ``skip(loader, n)`` for the
    loaders ``is_ours`` accepts, accelerate's function for the others. Done once a process."""
    module = transformers.trainer
    current = getattr(module, "skip_first_batches", None)
    if current is None:
        raise UntestedTransformers(
            f"transformers {transformers.__version__} has no transformers.trainer."
            "skip_first_batches, which unbroken.hf replaces (unbroken/hf/internals.py): install "
            "a tested version"
        )
    if getattr(current, "_unbroken", False):
        return
    original = current

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if is_ours(dataloader):
            return skip(dataloader, num_batches)
        return original(dataloader, num_batches)

    skip_first_batches._unbroken = True  # type: ignore[attr-defined]
    module.skip_first_batches = skip_first_batches


def _require(trainer: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if not hasattr(trainer, name):
            raise UntestedTransformers(
                f"transformers {transformers.__version__}'s Trainer has no attribute {name!r}, "
                "which unbroken.hf needs (unbroken/hf/internals.py): install a tested version"
            )


def train_batch_size(trainer: Any) -> int:
    _require(trainer, ("_train_batch_size",))
    return int(trainer._train_batch_size)


def training_data(trainer: Any, dataset: Any) -> tuple[Any, Any]:
    """The training dataset and collator as ``get_train_dataloader`` would use them: a
    ``datasets.Dataset`` without the columns the model does not take, or the collator that
    drops them."""
    _require(trainer, _NAMES)
    collator = trainer.data_collator
    try:
        import datasets
    except ImportError:  # pragma: no cover - transformers installs it in most setups
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        return trainer._remove_unused_columns(dataset, description="Training"), collator
    return dataset, trainer._get_collator_with_removed_columns(collator, description="Training")


def logging_state(trainer: Any) -> dict[str, Any]:
    """This rank's loss accumulated since the last log, exactly (a float32 is a JSON float)."""
    _require(trainer, _LOOP_NAMES)
    loss = trainer._tr_loss
    return {
        "tr_loss": loss.detach().cpu().item(),
        "tr_loss_dtype": str(loss.dtype).removeprefix("torch."),
        "globalstep_last_logged": int(trainer._globalstep_last_logged),
    }


def restore_logging_state(trainer: Any, saved: dict[str, Any]) -> None:
    _require(trainer, _LOOP_NAMES)
    device = trainer._tr_loss.device
    dtype = getattr(torch, saved["tr_loss_dtype"])
    trainer._tr_loss = torch.tensor(saved["tr_loss"], dtype=dtype, device=device)
    trainer._globalstep_last_logged = saved["globalstep_last_logged"]
