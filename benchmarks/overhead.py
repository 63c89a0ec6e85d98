"""Training-loop overhead of unbroken.DataLoader against torch's DataLoader, side by side.

How it measures, and what the numbers mean: ``docs/benchmarks/overhead.md``.

    .venv/bin/python benchmarks/overhead.py            # full run, ~3 minutes on 2 idle cores
    .venv/bin/python benchmarks/overhead.py --quick    # smoke run, ~15 seconds
"""

from __future__ import annotations

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ForeignLoad, Results, add_options, add_round_options, environment
from harness import parser as harness_parser
from harness.stats import median_ci, probed_rounds, quartiles, rotated
from harness.workloads import (
    ImageDataset,
    RowDataset,
    cnn_loss,
    cnn_model,
    tiny_loss,
    tiny_model,
    train_step,
)

import unbroken

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # the comparison is optional; the rest still runs
    StatefulDataLoader = None


def tiny_step(model, opt, batch) -> None:
    train_step(model, opt, batch, tiny_loss)


def cnn_step(model, opt, batch) -> None:
    train_step(model, opt, batch, cnn_loss)


# --------------------------------------------------------------------------- loaders

LOADERS = ["torch", "unbroken", "unbroken torch-only", "unbroken none", "torchdata"]
GLOBAL_RNGS = {
    "unbroken": ("torch", "numpy", "random"),
    "unbroken torch-only": ("torch",),
    "unbroken none": (),
}
LABELS = {
    "torch": "torch DataLoader",
    "unbroken": "unbroken (global_rngs default)",
    "unbroken torch-only": 'unbroken global_rngs=("torch",)',
    "unbroken none": "unbroken global_rngs=()",
    "torchdata": "torchdata StatefulDataLoader",
    "control": "control: torch DataLoader + unbroken's seeding calls",
}


class SeedingControl(torch.utils.data.Dataset):
    """The control loader's dataset: the user's, seeded per batch exactly as unbroken's default
    seeds it (the same calls: the three global generators seeded once, torch's generator put
    back after the batch in the training process), but behind torch's DataLoader, without
    unbroken's loader machinery. Separates what the seeding itself costs inside a training loop
    from the rest."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self._seed = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]

    def __getitems__(self, indices):
        if self._seed is None:  # built lazily: workers rebuild it in their own process
            from unbroken.data.rng import make_seeder

            self._seed = make_seeder(GLOBAL_RNGS["unbroken"])
        in_main = torch.utils.data.get_worker_info() is None
        saved = torch.default_generator.get_state() if in_main else None
        self._seed(0x1234, indices[0])
        batch = [self.dataset[i] for i in indices]
        if saved is not None:
            torch.default_generator.set_state(saved)
        return batch


def make_loader(name: str, dataset, batch_size: int, workers: int):
    common = dict(
        batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )
    if name == "torch":
        return torch.utils.data.DataLoader(dataset, **common)
    if name == "control":
        return torch.utils.data.DataLoader(SeedingControl(dataset), **common)
    if name == "torchdata":
        return StatefulDataLoader(dataset, **common)
    return unbroken.DataLoader(dataset, seed=0, global_rngs=GLOBAL_RNGS[name], **common)


def run_epochs(loader, model, opt, step, epochs: int) -> tuple[float, int]:
    """(wall seconds, steps) for ``epochs`` whole epochs of training."""
    steps = 0
    start = time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            step(model, opt, batch)
            steps += 1
    return time.perf_counter() - start, steps


# --------------------------------------------------------------------------- measurements


def seeding_costs(repeat: int = 5) -> dict[str, float]:
    """Microseconds per call of each global seeding, and of unbroken's whole per-batch seeding
    (the seeder alone; putting torch's generator back in the training process is ~1.3 us more:
    the get_state/set_state rows)."""
    from unbroken.data.rng import make_seeder  # private: only to explain the numbers

    value = 0x9E3779B9  # a 32-bit seed, as unbroken passes
    generator = torch.default_generator
    state = generator.get_state()
    stmts = {
        "torch.default_generator.manual_seed(s)": lambda: generator.manual_seed(value),
        "torch.manual_seed(s)": lambda: torch.manual_seed(value),
        "np.random.seed(s)": lambda: np.random.seed(value),
        "random.seed(s)": lambda: random.seed(value),
        "torch.default_generator.get_state()": generator.get_state,
        "torch.default_generator.set_state(state)": lambda: generator.set_state(state),
    }
    for name, rngs in GLOBAL_RNGS.items():
        seeder = make_seeder(rngs)
        stmts[f"unbroken per-batch seeding, {LABELS[name].removeprefix('unbroken ')}"] = (
            lambda seeder=seeder: seeder(0x9E3779B97F4A7C15, 12345)
        )
    costs = {}
    for name, fn in stmts.items():
        timer = timeit.Timer(fn)
        number, _ = timer.autorange()
        costs[name] = min(timer.repeat(repeat, number)) / number * 1e6
    return costs


def chunk_rounds(runs, names, step, chunk: int, rounds: int) -> list[dict]:
    """num_workers=0: ``rounds`` rounds of ``chunk`` training steps + ``chunk`` data-only batches
    per loader, finely interleaved. Returns per round {name: (us/step, us/batch data-only)}."""
    iterators = {name: iter(runs[name][0]) for name in names}

    def batches(name):
        for _ in range(chunk):
            try:
                yield next(iterators[name])
            except StopIteration:  # the epoch ended: the next one starts inside the timing
                iterators[name] = iter(runs[name][0])
                yield next(iterators[name])

    out = []
    for index in range(rounds):
        this_round = {}
        for name in rotated(names, index):
            _, model, opt = runs[name]
            start = time.perf_counter()
            for batch in batches(name):
                step(model, opt, batch)
            middle = time.perf_counter()
            for _ in batches(name):
                pass
            end = time.perf_counter()
            this_round[name] = ((middle - start) / chunk * 1e6, (end - middle) / chunk * 1e6)
        out.append(this_round)
    return out


def epoch_rounds(runs, names, step, args) -> tuple[list[dict], list[float], int]:
    """num_workers>0: rounds of one training epoch per loader, until ``args.worker_reps`` rounds
    were clean of other processes' load or ``args.max_rounds`` ran. Returns the rounds to use,
    every round's peak foreign load (cores) and how many rounds were clean."""

    def one_epoch(name: str) -> tuple[float, None]:
        loader, model, opt = runs[name]
        wall, steps = run_epochs(loader, model, opt, step, 1)
        return (wall / steps * 1e6, None)

    return probed_rounds(
        names, one_epoch, args.worker_reps, args.max_rounds, args.max_foreign, ForeignLoad(),
        peak=True,
    )  # fmt: skip


def bench_loop(loop: str, workers: int, args, seed_cost: dict[str, float]):
    """Rows of the result table for one (loop, num_workers), a line on how it went, and the
    same numbers per loader for the JSON results (shares as fractions, not percent)."""
    if loop == "tiny":
        dataset, batch_size, chunk = RowDataset(args.tiny_rows), args.tiny_batch, args.tiny_chunk
        make_model, step, lr = tiny_model, tiny_step, 0.1
    elif loop == "realistic":
        dataset, batch_size = ImageDataset(args.images), args.image_batch
        chunk = args.realistic_chunk
        make_model, step, lr = cnn_model, cnn_step, 0.01
    else:
        raise SystemExit(f"unknown loop {loop!r}: expected tiny or realistic")
    names = [n for n in LOADERS if n != "torchdata" or StatefulDataLoader is not None]
    if args.control:
        names.append("control")
    torch.manual_seed(0)
    base = make_model()
    runs = {}
    for name in names:
        model = copy.deepcopy(base)  # same start for every loader, trained independently
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        runs[name] = (make_loader(name, dataset, batch_size, workers), model, opt)

    for name in names:  # warm-up: starts persistent workers, fills caches and allocators
        loader, model, opt = runs[name]
        run_epochs(loader, model, opt, step, 1)

    disturbed = False
    if workers == 0:
        steps_per_epoch = len(runs["torch"][0])
        n_rounds = max(3, -(-args.reps * steps_per_epoch // chunk))
        monitor = ForeignLoad()
        before = monitor.snapshot()
        used = chunk_rounds(runs, names, step, chunk, n_rounds)
        foreign = ForeignLoad.cores(before, monitor.snapshot())
        note = (
            f"{loop}, num_workers=0: {n_rounds} interleaved rounds of {chunk} steps per "
            f"loader; other processes used {foreign:.2f} cores on average meanwhile"
        )
    else:
        used, foreign, n_clean = epoch_rounds(runs, names, step, args)
        disturbed = n_clean < min(3, args.worker_reps)
        counted = "clean" if args.max_foreign != float("inf") else "unfiltered (--quick)"
        note = (
            f"{loop}, num_workers={workers}: {n_clean} {counted} of {len(foreign)} epoch "
            f"rounds (other processes' load during an epoch: max {max(foreign):.2f} cores, "
            f"median {statistics.median(foreign):.2f})"
            + ("; TOO FEW CLEAN ROUNDS, all rounds used: disturbed" if disturbed else "")
        )
    del runs  # shuts persistent workers down before the next configuration

    torch_us = statistics.median(r["torch"][0] for r in used)
    rows, entries = [], []
    for name in names:
        wall = [r[name][0] for r in used]
        ratio = [r[name][0] / r["torch"][0] for r in used]
        data = [r[name][1] for r in used] if workers == 0 else None
        lo, hi = quartiles(ratio)
        ci_lo, ci_hi = median_ci(ratio)
        estimate, seeding_share = "-", None
        if workers == 0 and name in GLOBAL_RNGS:
            key = f"unbroken per-batch seeding, {LABELS[name].removeprefix('unbroken ')}"
            seeding_share = seed_cost[key] / torch_us
            estimate = f"+{seeding_share * 100:.1f}%"
        is_torch = name == "torch"
        data_share = (
            None
            if is_torch or data is None
            else statistics.median(r[name][1] - r["torch"][1] for r in used) / torch_us
        )
        rows.append(
            [
                loop + (" (disturbed)" if disturbed else ""),
                str(workers),
                LABELS[name],
                f"{statistics.median(wall):.1f}",
                "1" if is_torch else f"{statistics.median(ratio):.3f}",
                "-" if is_torch else f"{ci_lo:.3f}-{ci_hi:.3f}",
                "-" if is_torch else f"{lo:.3f}-{hi:.3f}",
                "-" if data is None else f"{statistics.median(data):.1f}",
                "-" if data_share is None else f"{data_share * 100:+.1f}%",
                estimate,
            ]
        )
        entries.append(
            {
                "loop": loop,
                "workers": workers,
                "loader": name,
                "label": LABELS[name],
                "disturbed": disturbed,
                "rounds": len(used),
                "us_per_step": statistics.median(wall),
                "ratio": 1.0 if is_torch else statistics.median(ratio),
                "ratio_ci95": None if is_torch else [ci_lo, ci_hi],
                "ratio_iqr": None if is_torch else [lo, hi],
                "data_only_us_per_batch": None if data is None else statistics.median(data),
                "data_only_share": data_share,
                "seeding_share": seeding_share,
            }
        )
    return rows, note, entries


QUICK = "small datasets, little timed work (numbers are noise)"


def main() -> None:
    parser = harness_parser(__doc__, "overhead", QUICK)
    add_options(parser, {
        "loops": ("tiny,realistic", "comma-separated: tiny,realistic"),
        "workers": ("0,2", "comma-separated num_workers values"),
        "reps": (7, "timed work per loader and configuration, in epochs"),
        "worker_reps": (5, "num_workers>0: clean epoch rounds per configuration"),
        "tiny_chunk": (64, "num_workers=0: training steps per loader per round, tiny loop"),
        "realistic_chunk": (4, "num_workers=0: training steps per loader per round, realistic loop"),
        "tiny_rows": (4096, None), "tiny_batch": (2, None),
        "images": (2048, None), "image_batch": (32, None),
    })  # fmt: skip
    add_round_options(parser, 10)
    parser.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="leave out the control loader (torch's DataLoader with a dataset "
        "that makes unbroken's per-batch seeding calls)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in main")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.worker_reps, args.max_rounds = 2, 2, 2
        args.tiny_rows, args.images = 256, 128
        args.max_foreign = float("inf")  # epochs this short are below the load probe's resolution
    torch.set_num_threads(args.threads)
    results = Results("overhead", args.json, args)

    print("# unbroken.DataLoader training-loop overhead\n")
    print("\n".join(environment()))
    print(
        f"- torch.set_num_threads({args.threads}) in the main process (DataLoader workers use 1 "
        "thread each); persistent_workers=True for every loader when num_workers > 0"
    )
    print(
        f"- tiny: Linear(32, 2), {args.tiny_rows} rows, batch {args.tiny_batch}; realistic: "
        f"2-conv CNN, {args.images} images 3x32x32 with crop+flip, batch {args.image_batch}"
    )
    print(
        "- after 1 untimed warm-up epoch per loader: num_workers=0: "
        f"{args.reps} epochs' worth of training steps per loader, in rounds of "
        f"{args.tiny_chunk} (tiny) / {args.realistic_chunk} (realistic) training steps + as "
        "many data-only batches per loader, interleaved, order rotated each round. "
        f"num_workers>0: {args.worker_reps} rounds of 1 training epoch per loader, order "
        f"rotated; rounds where other processes used > {args.max_foreign} cores are set aside "
        f"and rerun (at most {args.max_rounds} rounds)"
    )
    if StatefulDataLoader is None:
        print("- torchdata is not installed: its rows are left out")
    sys.stdout.flush()

    costs = seeding_costs(1 if args.quick else 5)
    print(f"\n## Per-batch seeding cost (timeit, best of {1 if args.quick else 5})\n")
    results.show("Per-batch seeding cost, us per call (timeit)", [
        "call", "us per call",
    ], [[f"`{k}`", f"{v:.2f}"] for k, v in costs.items()])  # fmt: skip
    sys.stdout.flush()

    rows, notes, entries = [], [], []
    for loop in args.loops.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            start = time.perf_counter()
            loop_rows, note, loop_entries = bench_loop(loop.strip(), workers, args, costs)
            rows += loop_rows
            notes.append(note)
            entries += loop_entries
            print(f"[{note}; {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)

    print("\n## Time per training step\n")
    print(
        "us/step: wall time per training step, median over rounds. ratio: the loader's time "
        "/ torch DataLoader's in the same round, median over rounds, with a bootstrap 95% "
        "confidence interval of that median and the interquartile range of the rounds. "
        "data-only us/batch (num_workers=0): the same loader iterated without training, right "
        "after its training steps in each round (median). data-only est.: the "
        "loader's data-only time minus torch's in the same round (median), as a share of "
        "torch's training step: the overhead the loader adds if nothing else changes "
        "(num_workers=0; steadier than the ratio, since the noisy training compute is left "
        "out, but blind to cache interplay with training). seeding est.: unbroken's "
        "per-batch seeding cost (table above) / torch's step time, the overhead "
        "that seeding alone would explain if it cost inside the loop what it costs alone.\n"
    )
    results.show("Time per training step", [
        "loop", "workers", "loader", "us/step", "ratio vs torch", "95% CI", "ratio IQR",
        "data-only us/batch", "data-only est.", "seeding est.",
    ], rows, left=3)  # fmt: skip
    results.finish(
        notes,
        {
            "seeding_us_per_call": costs,
            "setup": {
                "tiny_rows": args.tiny_rows,
                "tiny_batch": args.tiny_batch,
                "images": args.images,
                "image_batch": args.image_batch,
                "threads": args.threads,
            },
            "rows": entries,
        },
    )


if __name__ == "__main__":
    main()
