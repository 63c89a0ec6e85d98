"""Subprocess jobs for the streaming tests: ``read`` reads a whole sharded dataset through the
loader and prints its ids and downloads; ``hang-in-download`` writes half of its first shard's
download and hangs there, to be SIGKILLed."""

from __future__ import annotations

import json
import sys
import time

import torch

import unbroken
from unbroken.streaming import StreamingDataset
from unbroken.streaming.remote import Remote


def main() -> None:
    mode, url, cache, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    if mode == "hang-in-download":
        real = Remote.download

        def hang(self, name, local):
            real(self, name, local)
            with open(local, "r+b") as file:
                file.truncate(file.seek(0, 2) // 2)
            print("downloading", flush=True)
            time.sleep(600)

        Remote.download = hang  # type: ignore[method-assign]
    ds = StreamingDataset(url, cache_dir=cache, storage_options=options)
    loader = unbroken.DataLoader(ds, batch_size=32, num_workers=0)
    ids = torch.cat([batch["id"] for batch in loader]).tolist()
    print(json.dumps({"ids": ids, "downloads": ds.cache.downloads}), flush=True)


if __name__ == "__main__":
    main()
