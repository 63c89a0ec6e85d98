"""The dataset the inner torch DataLoader sees: the user's, with each batch's RNGs seeded.

torch's fetcher hands a whole batch of keys to ``__getitems__``. We seed the chosen global
generators once, from (epoch key, the batch's first position), then call the user's
``__getitem__`` for each sample, telling ``sample_seed()``/``sample_rng()`` which position is
being fetched, so the batch's random transforms do not depend on which worker runs it. A user
dataset with its own ``__getitems__`` (batched reads) keeps it: it is called once per batch,
with ``sample_seed()`` the batch's first position's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

from .rng import CURRENT, clear_sample, keep_main_torch_rng, make_seeder

# A batch as the inner torch loader's batch sampler yields it and a worker receives it: the
# dataset indices, the epoch's key and the position of its first sample in the epoch's global
# order. A plain tuple: one is built per batch, and a class of our own costs ~0.5 us more.
Keys = tuple[Sequence[int], int, int]


class SeededDataset(Dataset):
    def __init__(self, dataset: Any, global_rngs: tuple[str, ...]) -> None:
        self.dataset = dataset
        self.global_rngs = global_rngs
        self._seed = make_seeder(global_rngs)
        batched = getattr(dataset, "__getitems__", None)
        self._user_getitems = batched if callable(batched) else None

    def __getstate__(self) -> dict:  # the seeder is a closure: rebuild it in each worker
        return {"dataset": self.dataset, "global_rngs": self.global_rngs}

    def __setstate__(self, state: dict) -> None:
        SeededDataset.__init__(self, state["dataset"], state["global_rngs"])

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: Keys) -> list:
        indices, key, start = keys
        current = CURRENT
        saved = keep_main_torch_rng(self.global_rngs)  # put back below, in the training process
        try:
            self._seed(key, start)
            if self._user_getitems is not None:
                return self._user_getitems(list(indices))
            dataset, out = self.dataset, []
            for position, index in enumerate(indices, start):
                current.position = position
                out.append(dataset[index])
            return out
        finally:
            clear_sample(saved)

    def __getitem__(self, keys: Keys) -> Any:
        # Without automatic batching (batch_size=None) every batch holds one index, fetched
        # with the dataset's __getitem__, as torch does.
        (index,), key, start = keys
        saved = keep_main_torch_rng(self.global_rngs)
        try:
            self._seed(key, start)
            return self.dataset[index]
        finally:
            clear_sample(saved)
