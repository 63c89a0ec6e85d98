"""``TrainLoader``: the training loader as ``transformers.Trainer`` sees it.

transformers numbers epochs itself and calls ``set_epoch(epoch)`` on the training loader before
each ``iter()``. On an ``unbroken.DataLoader`` that would start the epoch from its first batch,
dropping the position a resume restored. This wrapper passes only what transformers' loop means:

- with ``len()``: the epoch transformers resumes is the loader's restored epoch (kept), or the
  one after a restored epoch that had ended (started); any other is a ``StateMismatch``, never
  a silent restart. Outside a resume it sets the epoch as asked.
- without ``len()`` (a stream): transformers counts an "epoch" as ``max_steps`` optimizer steps,
  not a pass over the data, so its numbers are ignored: the loader counts its own passes. A
  restored pass with nothing left goes on into the next pass at once, where transformers would
  otherwise stop training on an empty epoch.

transformers skips a resumed epoch's first batches with ``skip_first_batches``, replaced for
this loader by ``skip`` (``internals``): the loader is there already, so ``skip`` checks the
position and returns it. transformers then fetches the first accumulation window and only then
puts back the saved random states. Without workers, the loader seeds numpy's and ``random``'s
generators for each batch it fetches (``global_rngs``), so the uninterrupted run trains that
window with the states of its last batch: ``skip`` has them recorded as that window is fetched,
and ``ExactResumeCallback`` puts them back at the step's start (``take_fetch_states``).

A collator that draws (MLM masking) draws from the global generators the loader seeds for each
batch's collate. One built with a ``seed`` of its own (``DataCollatorForLanguageModeling(seed=
...)``) keeps a generator per worker across batches instead, so its masks would change with
``dataloader_num_workers`` and after a resume: ``refuse_seeded_collator`` says so when the
loader is built.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..data.loader import DataLoader
from ..errors import StateMismatch


def refuse_seeded_collator(collator: Any) -> None:
    """Raise if ``collator`` (maybe inside transformers' ``RemoveColumnsCollator``) is one of
    transformers' collators given a ``seed``: it draws from a generator of its own.

    Raises:
        ValueError: it has a ``seed`` (the value is named) and makes its own generator.
    """
    inner = getattr(collator, "data_collator", collator)  # RemoveColumnsCollator's
    seed = getattr(inner, "seed", None)
    if seed is not None and callable(getattr(inner, "get_generator", None)):
        raise ValueError(
            f"unbroken.hf.Trainer: the data collator {type(inner).__name__} has seed={seed!r}, "
            "so it draws from a generator of its own, which each worker copies and a resume "
            "starts afresh: its masks would differ with dataloader_num_workers and after a "
            "resume. Build it with seed=None: the loader seeds torch's generator for each "
            "batch's collate from (seed, epoch, position)"
        )


class TrainLoader:
    """What ``get_train_dataloader`` returns: the ``unbroken.DataLoader`` as ``loader``."""

    def __init__(self, loader: DataLoader) -> None:
        refuse_seeded_collator(loader.collate_fn)
        self.loader = loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self._record = False  # record the fetch's numpy/random states (see the module)
        self._fetch_states: tuple[Any, Any] | None = None

    @staticmethod
    def skip(train_loader: TrainLoader, batches: int) -> TrainLoader:
        """transformers' skip of ``batches`` batches of the resumed epoch: none to read."""
        loader = train_loader.loader
        if train_loader._sized():  # without len(), transformers' count spans several passes
            state = loader.state_dict()
            if not loader._restored or state["batches"] != batches:
                raise StateMismatch(
                    f"transformers resumes after batch {batches} of its epoch, and the training "
                    f"loader is at batch {state['batches']} of epoch {state['epoch']}"
                    + ("" if loader._restored else " (not restored from the checkpoint)")
                    + ": the checkpoint's trainer_state.json and its unbroken state disagree, "
                    "or the dataset, batch size or gradient accumulation changed"
                )
        if loader.num_workers == 0:
            train_loader._record = bool({"numpy", "random"} & set(loader.global_rngs))
        return train_loader

    def take_fetch_states(self) -> None:
        """Put back numpy's and ``random``'s states as the last fetch left them, once."""
        states, self._fetch_states, self._record = self._fetch_states, None, False
        if states is None:
            return
        numpy_state, random_state = states
        if numpy_state is not None:
            np.random.set_state(numpy_state)
        if random_state is not None:
            random.setstate(random_state)

    def _sized(self) -> bool:
        try:
            len(self.loader)
        except TypeError:
            return False
        return True

    def __len__(self) -> int:
        return len(self.loader)  # a TypeError without len(): transformers asks for max_steps

    def set_epoch(self, epoch: int) -> None:
        loader = self.loader
        if not self._sized():
            return
        if not loader._restored:
            loader.set_epoch(epoch)
            return
        state = loader.state_dict()
        if state["epoch"] == epoch:
            return  # the resumed epoch: go on from the restored position
        if state["epoch"] == epoch - 1 and state["batches"] >= len(loader):
            loader.set_epoch(epoch)  # saved at the end of the epoch before
            return
        raise StateMismatch(
            f"transformers resumes epoch {epoch}, and the training loader's saved state is at "
            f"batch {state['batches']} of epoch {state['epoch']} ({len(loader)} batches an "
            "epoch): the checkpoint's trainer_state.json and its unbroken state disagree, or "
            "the dataset, batch size or gradient accumulation changed"
        )

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        restored = loader._restored
        delivered = False
        for batch in loader:
            delivered = True
            if self._record:
                rngs = loader.global_rngs
                self._fetch_states = (
                    np.random.get_state() if "numpy" in rngs else None,
                    random.getstate() if "random" in rngs else None,
                )
            yield batch
        if restored and not delivered and not self._sized():
            yield from loader  # the restored pass had ended: the next one

    def epoch_progress(self, args: Any) -> float:
        """The ``state.epoch`` transformers logs, computed as its uninterrupted loop does
        (epoch + batches of it / batches an epoch) but from the loader, which a resume keeps:
        transformers counts the batches of the resumed epoch from the resume."""
        state = self.loader.state_dict()
        per_epoch = (
            len(self.loader) if self._sized() else args.max_steps * args.gradient_accumulation_steps
        )
        return state["epoch"] + state["batches"] / per_epoch

    def at_epoch_end(self) -> bool:
        """Whether every batch of the current epoch was received (False without ``len()``)."""
        if not self._sized():
            return False
        return self.loader.state_dict()["batches"] >= len(self.loader)
