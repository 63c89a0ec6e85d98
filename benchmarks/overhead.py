"""Training-loop overhead of unbroken.DataLoader against torch's DataLoader, side by side.

Two loops, each with num_workers 0 and 2:

- tiny (Lightning's BoringModel style): Linear(32, 2) on random 32-float rows, batch 2,
  SGD(lr=0.1), MSE loss. The step is so cheap that the loader's per-batch cost shows.
- realistic: a small CNN (2 conv + linear, 10 classes) on random uint8 3x32x32 images with
  random crop (pad 4) and horizontal flip drawn from the global torch RNG, batch 32, SGD,
  cross-entropy.

Loaders: torch.utils.data.DataLoader(shuffle=True); unbroken.DataLoader(shuffle=True, seed=0)
with global_rngs default (torch, numpy, random), ("torch",) and (); torchdata's
StatefulDataLoader(shuffle=True) with its defaults. With workers, every loader gets
persistent_workers=True so worker start-up is not timed.

Method: each loader has its own copy of the same model. One untimed warm-up epoch per loader,
then ``--reps`` rounds; in each round every loader runs ``--epochs`` whole epochs (forward,
backward, step per batch), in an order rotated every round so drift hits all alike. Reported:
median time per step, and the ratio to torch's DataLoader computed per round (paired) and
summarized by its median and min-max over rounds.

    .venv/bin/python benchmarks/overhead.py            # full run, a few minutes
    .venv/bin/python benchmarks/overhead.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
import timeit
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import unbroken  # noqa: E402
from _common import environment, load_line, table  # noqa: E402

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # the comparison is optional; the rest still runs
    StatefulDataLoader = None


# --------------------------------------------------------------------------- datasets, models


class RowDataset(torch.utils.data.Dataset):
    """BoringModel's RandomDataset: a precomputed tensor of random rows."""

    def __init__(self, rows: int, size: int = 32) -> None:
        self.data = torch.randn(rows, size, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class ImageDataset(torch.utils.data.Dataset):
    """Random uint8 CIFAR-sized images; random crop (pad 4) and flip from the global torch RNG."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(2)
        self.images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        img = F.pad(self.images[i], (4, 4, 4, 4))
        top, left = torch.randint(0, 9, (2,)).tolist()
        img = img[:, top : top + 32, left : left + 32]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        return img.float().div_(255.0), self.labels[i]


def tiny_model() -> torch.nn.Module:
    return torch.nn.Linear(32, 2)


def tiny_step(model, opt, batch) -> None:
    out = model(batch)
    loss = F.mse_loss(out, torch.ones_like(out))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def cnn_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10),
    )


def cnn_step(model, opt, batch) -> None:
    images, labels = batch
    loss = F.cross_entropy(model(images), labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


# --------------------------------------------------------------------------- loaders

LOADERS = ["torch", "unbroken", "unbroken torch-only", "unbroken none", "torchdata"]
GLOBAL_RNGS = {"unbroken": ("torch", "numpy", "random"), "unbroken torch-only": ("torch",),
               "unbroken none": ()}
LABELS = {
    "torch": "torch DataLoader",
    "unbroken": "unbroken (global_rngs default)",
    "unbroken torch-only": 'unbroken global_rngs=("torch",)',
    "unbroken none": "unbroken global_rngs=()",
    "torchdata": "torchdata StatefulDataLoader",
}


def make_loader(name: str, dataset, batch_size: int, workers: int):
    common = dict(batch_size=batch_size, shuffle=True, num_workers=workers,
                  persistent_workers=workers > 0)
    if name == "torch":
        return torch.utils.data.DataLoader(dataset, **common)
    if name == "torchdata":
        return StatefulDataLoader(dataset, **common)
    return unbroken.DataLoader(dataset, seed=0, global_rngs=GLOBAL_RNGS[name], **common)


def run_epochs(loader, model, opt, step, epochs: int) -> tuple[float, int]:
    steps = 0
    start = time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            step(model, opt, batch)
            steps += 1
    return time.perf_counter() - start, steps


# --------------------------------------------------------------------------- measurements


def seeding_costs(repeat: int = 5) -> dict[str, float]:
    """Microseconds per call of each global seeding, and of unbroken's whole per-sample seeding."""
    from unbroken._rng import make_seeder, sample_seed_at  # private: only to explain the numbers

    value = 0x9E3779B97F4A7C15  # a full 64-bit seed, as unbroken passes
    stmts = {
        "torch.default_generator.manual_seed(s)": lambda: torch.default_generator.manual_seed(value),
        "torch.manual_seed(s)": lambda: torch.manual_seed(value),
        "np.random.seed(s & 0xFFFFFFFF)": lambda: np.random.seed(value & 0xFFFFFFFF),
        "random.seed(s)": lambda: random.seed(value),
    }
    for name, rngs in GLOBAL_RNGS.items():
        seeder = make_seeder(rngs)
        stmts[f"unbroken per-sample seeding, {LABELS[name].removeprefix('unbroken ')}"] = (
            lambda seeder=seeder: seeder(sample_seed_at(value, 12345)))
    costs = {}
    for name, fn in stmts.items():
        timer = timeit.Timer(fn)
        number, _ = timer.autorange()
        costs[name] = min(timer.repeat(repeat, number)) / number * 1e6
    return costs


def bench_loop(loop: str, workers: int, args, seed_cost: dict[str, float]) -> list[list[str]]:
    if loop == "tiny":
        dataset, batch_size = RowDataset(args.tiny_rows), args.tiny_batch
        make_model, step, lr = tiny_model, tiny_step, 0.1
    else:
        dataset, batch_size = ImageDataset(args.images), args.image_batch
        make_model, step, lr = cnn_model, cnn_step, 0.01
    names = [n for n in LOADERS if n != "torchdata" or StatefulDataLoader is not None]
    torch.manual_seed(0)
    base = make_model()
    runs = {}
    for name in names:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        runs[name] = (make_loader(name, dataset, batch_size, workers), model, opt)

    for name in names:  # warm-up: starts persistent workers, fills caches, allocators
        loader, model, opt = runs[name]
        run_epochs(loader, model, opt, step, 1)

    per_step = {name: [] for name in names}
    ratios = {name: [] for name in names}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        this_round = {}
        for name in order:
            loader, model, opt = runs[name]
            seconds, steps = run_epochs(loader, model, opt, step, args.epochs)
            this_round[name] = seconds / steps * 1e6
        for name in names:
            per_step[name].append(this_round[name])
            ratios[name].append(this_round[name] / this_round["torch"])

    torch_us = statistics.median(per_step["torch"])
    rows = []
    for name in names:
        med = statistics.median(ratios[name])
        lo, hi = min(ratios[name]), max(ratios[name])
        estimate = "-"
        if workers == 0 and name in GLOBAL_RNGS:
            key = f"unbroken per-sample seeding, {LABELS[name].removeprefix('unbroken ')}"
            estimate = f"+{seed_cost[key] * batch_size / torch_us * 100:.1f}%"
        rows.append([loop, str(workers), LABELS[name], f"{statistics.median(per_step[name]):.1f}",
                     f"{med:.3f}" if name != "torch" else "1",
                     f"{lo:.3f}-{hi:.3f}" if name != "torch" else "-", estimate])
    del runs  # shuts persistent workers down before the next configuration
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", default="tiny,realistic", help="comma-separated: tiny,realistic")
    parser.add_argument("--workers", default="0,2", help="comma-separated num_workers values")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds per configuration")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per loader per round")
    parser.add_argument("--tiny-rows", type=int, default=4096)
    parser.add_argument("--tiny-batch", type=int, default=2)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--image-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in main")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small datasets, 2 rounds (numbers are not meaningful)")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.tiny_rows, args.images = 2, 256, 128
    torch.set_num_threads(args.threads)

    print("# unbroken.DataLoader training-loop overhead\n")
    print("\n".join(environment()))
    print(f"- torch.set_num_threads({args.threads}) in the main process (DataLoader workers use 1 "
          "thread each); persistent_workers=True for every loader when num_workers > 0")
    print(f"- tiny: Linear(32, 2), {args.tiny_rows} rows, batch {args.tiny_batch}; realistic: "
          f"2-conv CNN, {args.images} images 3x32x32 with crop+flip, batch {args.image_batch}")
    print(f"- {args.reps} rounds x {args.epochs} epoch(s) per loader after 1 warm-up epoch, "
          "loader order rotated each round")
    if StatefulDataLoader is None:
        print("- torchdata is not installed: its rows are left out")
    sys.stdout.flush()

    costs = seeding_costs(1 if args.quick else 5)
    print(f"\n## Per-sample seeding cost (timeit, best of {1 if args.quick else 5})\n")
    print(table(["call", "us per call"], [[f"`{k}`", f"{v:.2f}"] for k, v in costs.items()]))
    sys.stdout.flush()

    rows = []
    for loop in args.loops.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            start = time.perf_counter()
            rows += bench_loop(loop.strip(), workers, args, costs)
            print(f"[{loop} num_workers={workers} done in {time.perf_counter() - start:.0f} s]",
                  file=sys.stderr, flush=True)

    print("\n## Time per training step\n")
    print("ratio = loader's epoch time / torch DataLoader's in the same round (median, and "
          "min-max over rounds). seeding est. = unbroken's per-sample seeding cost x batch size / "
          "torch's step time, the overhead seeding alone explains (num_workers=0 only).\n")
    print(table(["loop", "workers", "loader", "us/step (median)", "ratio vs torch",
                 "ratio min-max", "seeding est."], rows, left=3))
    print()
    print(load_line())


if __name__ == "__main__":
    main()
