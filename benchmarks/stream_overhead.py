"""Per-batch overhead of shipping iterable-dataset state with each batch, side by side.

How it measures, and what the numbers mean: ``docs/benchmarks/stream-overhead.md``.

    .venv/bin/python benchmarks/stream_overhead.py            # full run, ~1-3 minutes
    .venv/bin/python benchmarks/stream_overhead.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import IterableDataset, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, command_line, environment
from harness import parser as harness_parser
from harness.stats import interleaved
from harness.workloads import flat_weights, train_step

import unbroken

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # the comparison is optional; the rest still runs
    StatefulDataLoader = None

BATCH = 2
TARGET = 0.03  # from the issue: unbroken within 3% of torch's DataLoader


class ShardedRows(IterableDataset):
    """Precomputed random rows; worker w of n yields rows w, w + n, ...; a state of three ints."""

    def __init__(self, rows: int, size: int = 32) -> None:
        self.data = torch.randn(rows, size, generator=torch.Generator().manual_seed(1))
        self.worker, self.workers, self.position = 0, 1, 0  # position: rows of the shard yielded
        self._resume = 0

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self):
        info = get_worker_info()
        self.worker, self.workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self.position, self._resume = self._resume, 0  # a loaded state, else the start
        data, step = self.data, self.workers
        for i in range(self.worker + self.position * step, len(data), step):
            self.position += 1
            yield data[i]

    def state_dict(self) -> dict:
        return {"worker": self.worker, "workers": self.workers, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self._resume = int(state["position"])


LOADERS = ["torch", "unbroken", "unbroken rngs=()", "torchdata"]
LABELS = {
    "torch": "torch DataLoader",
    "unbroken": "unbroken (global_rngs default)",
    "unbroken rngs=()": "unbroken global_rngs=() (state shipping only)",
    "torchdata": "torchdata StatefulDataLoader",
}


def make_loader(name: str, rows: int, workers: int):
    dataset = ShardedRows(rows)  # its own copy: with num_workers=0 the loader mutates it
    common = dict(batch_size=BATCH, num_workers=workers, persistent_workers=False)
    if name == "torch":
        return torch.utils.data.DataLoader(dataset, **common)
    if name == "torchdata":
        return StatefulDataLoader(dataset, **common)
    rngs = () if name == "unbroken rngs=()" else ("torch", "numpy", "random")
    return unbroken.DataLoader(dataset, seed=0, global_rngs=rngs, **common)


def run_epochs(loader, model, optimizer, epochs: int) -> tuple[float, float, int]:
    """(wall seconds, seconds to the first batch summed over epochs, steps)."""
    steps, first = 0, 0.0
    start = time.perf_counter()
    for _ in range(epochs):
        epoch_start = time.perf_counter()
        fresh = True
        for batch in loader:
            if fresh:
                first += time.perf_counter() - epoch_start
                fresh = False
            train_step(model, optimizer, batch)
            steps += 1
    return time.perf_counter() - start, first, steps


def bench(workers: int, args) -> tuple[list[list[str]], list[str], list[dict]]:
    """Rows of the result table for one num_workers, notes on how it went, and the same
    numbers per loader for the JSON results."""
    names = [n for n in LOADERS if n != "torchdata" or StatefulDataLoader is not None]
    torch.manual_seed(0)
    base = torch.nn.Linear(32, 2)
    runs = {}
    for name in names:
        model = copy.deepcopy(base)
        runs[name] = (
            make_loader(name, args.rows, workers),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
        )
    for name in names:  # warm-up epoch, untimed
        run_epochs(*runs[name], 1)

    rounds, foreign = interleaved(
        names, lambda name: run_epochs(*runs[name], args.epochs), args.reps
    )

    reference = flat_weights(runs["torch"][1])
    differ = [n for n in names if not torch.equal(flat_weights(runs[n][1]), reference)]
    steps = {n: {rd[n][2] for rd in rounds} for n in names}
    runs.clear()  # shuts persistent workers down before the next configuration

    rows, entries = [], []
    for name in names:
        per_step = [rd[name][0] / rd[name][2] * 1e6 for rd in rounds]
        ratio = [rd[name][0] / rd["torch"][0] for rd in rounds]
        first_ms = [rd[name][1] / args.epochs * 1e3 for rd in rounds]
        steady = [_steady(rd[name], args.epochs) for rd in rounds]
        steady_ratio = [
            _steady(rd[name], args.epochs) / _steady(rd["torch"], args.epochs) for rd in rounds
        ]
        is_torch = name == "torch"
        rows.append(
            [
                str(workers),
                LABELS[name],
                f"{statistics.median(per_step):.1f}",
                "1" if is_torch else f"{statistics.median(ratio):.3f}",
                "-" if is_torch else f"{min(ratio):.3f}-{max(ratio):.3f}",
                f"{statistics.median(first_ms):.1f}",
                f"{statistics.median(steady):.1f}",
                "1" if is_torch else f"{statistics.median(steady_ratio):.3f}",
            ]
        )
        entries.append(
            {
                "workers": workers,
                "loader": name,
                "label": LABELS[name],
                "us_per_step": statistics.median(per_step),
                "ratio": 1.0 if is_torch else statistics.median(ratio),
                "ratio_min_max": None if is_torch else [min(ratio), max(ratio)],
                "first_batch_ms": statistics.median(first_ms),
                "steady_us_per_step": statistics.median(steady),
                "steady_ratio": 1.0 if is_torch else statistics.median(steady_ratio),
            }
        )
    (count,) = steps["torch"]
    notes = [
        f"num_workers={workers}: {count // args.epochs} steps per epoch, {args.epochs} "
        f"epoch(s) per loader per round"
    ]
    if foreign:
        notes.append(
            f"num_workers={workers}: other processes' CPU use during a round: median "
            f"{statistics.median(foreign):.2f} cores, max {max(foreign):.2f}"
        )
    if any(s != steps["torch"] for s in steps.values()):
        notes.append(f"num_workers={workers}: LOADERS YIELDED DIFFERENT STEP COUNTS: {steps}")
    for name in ("unbroken", "unbroken rngs=()"):
        ratio = statistics.median(rd[name][0] / rd["torch"][0] for rd in rounds)
        verdict = "within" if ratio <= 1 + TARGET else "NOT within"
        notes.append(
            f"num_workers={workers}: {LABELS[name]} is {verdict} the {TARGET:.0%} target "
            f"(median ratio {ratio:.3f})"
        )
    if differ:
        notes.append(
            f"num_workers={workers}: NOT THE SAME BATCHES: final weights differ from "
            f"torch's for {', '.join(LABELS[n] for n in differ)}"
        )
    else:
        notes.append(
            f"num_workers={workers}: every loader's model ends with torch's weights "
            "(torch.equal): same batches, same order"
        )
    return rows, notes, entries


def _steady(result: tuple[float, float, int], epochs: int) -> float:
    """Microseconds per step after each epoch's first batch."""
    wall, first, steps = result
    return (wall - first) / max(1, steps - epochs) * 1e6


QUICK = "256 rows, 2 rounds of 1 epoch (numbers mean nothing)"


def main() -> None:
    parser = harness_parser(__doc__, "stream_overhead", QUICK)
    parser.add_argument("--workers", default="2,0", help="comma-separated num_workers values")
    parser.add_argument("--rows", type=int, default=4096, help="rows in the dataset")
    parser.add_argument("--reps", type=int, default=10, help="timed rounds per num_workers")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per loader per round")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in main")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.reps, args.epochs = 256, 2, 1
    torch.set_num_threads(args.threads)
    results = Results("stream_overhead", args.json, args)

    print("# Iterable datasets: per-batch overhead of shipping worker state\n")
    print(f"Command: `{command_line()}`\n")
    print("\n".join(environment()))
    print(
        f"- torch.set_num_threads({args.threads}) in the main process (workers use 1 thread "
        "each); batch_size 2; Linear(32, 2) + SGD step per batch"
    )
    print(
        f"- dataset: IterableDataset of {args.rows} rows x 32 floats, sharded by worker, "
        "state_dict/load_state_dict of three ints"
    )
    print(
        "- persistent_workers=False for every loader: unbroken.DataLoader restarts the workers "
        "of an iterable dataset each epoch (every epoch starts each worker from another "
        "state), so the others are run the same way; every timed epoch includes starting and "
        "stopping its workers"
    )
    print(
        f"- 1 warm-up epoch per loader, then {args.reps} rounds x {args.epochs} epoch(s) per "
        "loader, loader order rotated each round"
    )
    if StatefulDataLoader is None:
        print("- torchdata is not installed: its rows are left out")
    if args.quick:
        print("- --quick: a smoke run; its numbers mean nothing")
    sys.stdout.flush()

    rows, notes, entries = [], [], []
    for workers in (int(w) for w in args.workers.split(",")):
        start = time.perf_counter()
        w_rows, w_notes, w_entries = bench(workers, args)
        rows += w_rows
        notes += w_notes
        entries += w_entries
        print(
            f"[num_workers={workers}: {time.perf_counter() - start:.0f} s]",
            file=sys.stderr,
            flush=True,
        )

    print("\n## Time per step\n")
    print(
        "us/step: epoch wall time / steps, including worker start-up, median over rounds. "
        "ratio: the loader's time / torch DataLoader's in the same round, median and min-max. "
        "first batch ms: from iter() to the first batch, per epoch (median). steady us/step: "
        "time per step after each epoch's first batch (median), and its ratio to torch's "
        f"(median of per-round ratios). Target: unbroken within {TARGET:.0%} of torch's "
        "DataLoader (ratio <= "
        f"{1 + TARGET:.2f}).\n"
    )
    print(f"Command: `{command_line()}`\n")
    results.show("Time per step", [
        "workers", "loader", "us/step", "ratio vs torch", "ratio min-max", "first batch ms",
        "steady us/step", "steady ratio",
    ], rows, left=2)  # fmt: skip
    results.finish(
        notes, {"rows_in_dataset": args.rows, "target_ratio": 1 + TARGET, "rows": entries}
    )


if __name__ == "__main__":
    main()
