"""The dataset the inner torch DataLoader sees: the user's, with each sample's RNGs seeded.

torch's fetcher hands a whole batch of keys to ``__getitems__``. For each sample we seed the
chosen global generators from (epoch key, position) and call the user's ``__getitem__``, so
the sample's random transforms do not depend on which worker runs it. A user dataset with its
own ``__getitems__`` (batched reads) keeps it: it is called once per batch, seeded from the
batch's first position, which is as deterministic but ties the randomness to batch boundaries.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from .rng import clear_sample, keep_main_torch_rng, make_seeder, sample_seed_at


class Keys(list):
    """A batch of dataset indices; ``epoch_key`` and ``start`` let a worker seed each sample."""

    def __init__(self, indices: Any, epoch_key: int, start: int) -> None:
        super().__init__(indices)
        self.epoch_key = epoch_key
        self.start = start

    def __reduce__(self) -> Any:  # workers receive batches pickled; keep it small and explicit
        return (Keys, (list(self), self.epoch_key, self.start))


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
        seed, dataset, epoch_key, start = self._seed, self.dataset, keys.epoch_key, keys.start
        saved = keep_main_torch_rng(self.global_rngs)
        try:
            if self._user_getitems is not None:
                seed(sample_seed_at(epoch_key, start))
                return self._user_getitems(list(keys))
            out = []
            for offset, index in enumerate(keys):
                seed(sample_seed_at(epoch_key, start + offset))
                out.append(dataset[index])
            return out
        finally:
            clear_sample(saved)

    def __getitem__(self, keys: Keys) -> Any:
        # Without automatic batching (batch_size=None) every Keys holds one index.
        saved = keep_main_torch_rng(self.global_rngs)
        try:
            self._seed(sample_seed_at(keys.epoch_key, keys.start))
            return self.dataset[keys[0]]
        finally:
            clear_sample(saved)
