"""Kill a data pipeline mid-epoch with SIGKILL, resume it in a fresh process, compare the streams.

A shuffled unbroken.DataLoader with random augmentations (torch, numpy and `random` draws in
__getitem__) and 2 workers runs 2 epochs in a child process that saves the loader's state after
every batch. The parent SIGKILLs it at a random moment in the first epoch. A fresh process loads
the last saved state (with a different num_workers, which is allowed) and finishes the run. A
third process runs uninterrupted. The demo prints whether interrupted + resumed equals the
uninterrupted stream, batch for batch and bit for bit.

Run: `make demo` (or `python demo/resume_demo.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import unbroken

EPOCHS, SEED = 2, 2026


class NoisyCrops(torch.utils.data.Dataset):
    """Synthetic 3x16x16 images with random crop, flip and noise, like a real augmentation."""

    def __init__(self, n: int = 240) -> None:
        self.images = torch.randint(
            0, 256, (n, 3, 20, 20), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        top, left = torch.randint(0, 5, (2,)).tolist()  # torch's global RNG
        image = self.images[index, :, top : top + 16, left : left + 16].float() / 255
        if random.random() < 0.5:  # Python's random
            image = image.flip(-1)
        image = image + torch.from_numpy(np.random.normal(0, 0.05, image.shape)).float()  # numpy's
        return image, index


def make_loader(num_workers: int) -> unbroken.DataLoader:
    return unbroken.DataLoader(
        NoisyCrops(), batch_size=8, shuffle=True, num_workers=num_workers, seed=SEED
    )


def digest(batch) -> str:
    images, indices = batch
    return hashlib.sha256(images.numpy().tobytes() + indices.numpy().tobytes()).hexdigest()[:16]


def child(mode: str, workdir: Path) -> None:
    """Run the pipeline; log a digest per batch; save the state after each batch (atomically)."""
    loader = make_loader(num_workers=1 if mode == "resumed" else 2)
    log = (workdir / f"{mode}.log").open("a")
    state_file = workdir / "state.json"
    if mode == "resumed":
        saved = json.loads(state_file.read_text())
        loader.load_state_dict(saved["loader"])
        print(
            f"  resumed process: loaded the state after batch {saved['received']} "
            f"(epoch {loader.epoch}), continuing with num_workers=1",
            flush=True,
        )
    received = 0 if mode != "resumed" else saved["received"]
    for _ in range(loader.epoch, EPOCHS):
        for batch in loader:
            received += 1
            log.write(digest(batch) + "\n")
            log.flush()
            if mode == "interrupted":
                tmp = state_file.with_suffix(".tmp")
                tmp.write_text(json.dumps({"received": received, "loader": loader.state_dict()}))
                os.replace(tmp, state_file)  # the state on disk is always a whole one
                time.sleep(0.02)  # a training step would take this long


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="unbroken-demo-") as tmp:
        workdir = Path(tmp)
        run = [sys.executable, __file__, "--child"]
        total = EPOCHS * len(make_loader(0))
        kill_at = random.Random().randint(3, total // 2 - 3)
        print(
            f"unbroken demo: {EPOCHS} epochs x {len(make_loader(0))} batches, shuffled, "
            "random crop/flip/noise, 2 workers"
        )
        proc = subprocess.Popen(run + ["interrupted", tmp])
        log = workdir / "interrupted.log"
        while not log.exists() or len(log.read_text().splitlines()) < kill_at:
            if proc.poll() is not None:
                print("the child finished before it could be killed")
                return 1
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        saved = json.loads((workdir / "state.json").read_text())
        print(
            f"  SIGKILLed the training process after {len(log.read_text().splitlines())} "
            f"batches; its last saved state is after batch {saved['received']}"
        )
        subprocess.run(run + ["resumed", tmp], check=True)
        subprocess.run(run + ["uninterrupted", tmp], check=True)

        lines = lambda name: (workdir / f"{name}.log").read_text().split()
        interrupted = lines("interrupted")[: saved["received"]]
        stitched, reference = interrupted + lines("resumed"), lines("uninterrupted")
        if stitched == reference:
            print(
                f"EQUAL: all {len(reference)} batches of the interrupted+resumed run are bit for "
                f"bit those of the uninterrupted run ({len(reference) - len(interrupted)} "
                "after the resume, no batch replayed or skipped)"
            )
            return 0
        first = next(
            (i for i, (a, b) in enumerate(zip(stitched, reference)) if a != b),
            min(len(stitched), len(reference)),
        )
        print(
            f"DIFFERENT: first difference at batch {first} "
            f"({len(stitched)} batches vs {len(reference)})"
        )
        return 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]))
    else:
        sys.exit(main())
