"""unbroken.DataLoader against torch's DataLoader on the tiny loop, one epoch per round.

The regression check for the loader's per-batch path at num_workers=0: the step is so cheap
(``Linear(32, 2)``, batch 2) that every microsecond the loader adds per batch shows. Each round
runs, for every loader in turn (order rotated each round), the same timed work from the same
moment: ``iter(loader)``, one epoch, a forward/backward/SGD step per batch. Each loader's time
is divided by torch's in the same round; the median of those ratios is the result. Costs 1-2 s
a round at the defaults on 2 shared cores. How to read it: ``docs/benchmarks/overhead.md``.

    .venv/bin/python benchmarks/loader_tiny.py            # 60 rounds, 1-2 minutes
    .venv/bin/python benchmarks/loader_tiny.py --quick    # smoke run, a few seconds
"""

from __future__ import annotations

import atexit
import copy
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, add_options, environment, interleaved, parser
from harness.stats import median_ci, quartiles
from harness.workloads import RowDataset, tiny_model, train_step
from overhead import SeedingControl

import unbroken

LABELS = {
    "torch": "torch DataLoader",
    "unbroken": "unbroken.DataLoader (global_rngs default)",
    "unbroken none": "unbroken.DataLoader global_rngs=()",
    "control": "control: torch DataLoader + unbroken's seeding calls",
    "baseline": "baseline: unbroken.DataLoader (global_rngs default) from --baseline-src",
}
BASELINE = None  # the package imported from --baseline-src


def import_baseline(src: str) -> None:
    """Import the ``unbroken`` package under ``src`` (a checkout's ``src/``) as a package of
    another name, beside this one: the revision's loader then runs in the same rounds as the
    current one. Works because unbroken's modules import each other relatively."""
    global BASELINE
    tree = Path(tempfile.mkdtemp(prefix="loader_tiny_"))
    atexit.register(shutil.rmtree, tree, ignore_errors=True)
    shutil.copytree(Path(src) / "unbroken", tree / "unbroken_baseline")
    sys.path.insert(0, str(tree))
    BASELINE = importlib.import_module("unbroken_baseline")


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
QUICK = "a few rounds over a small dataset (numbers are noise)"


def make_loader(name: str, dataset, batch_size: int):
    if name in ("torch", "control"):
        wrapped = SeedingControl(dataset) if name == "control" else dataset
        return torch.utils.data.DataLoader(wrapped, batch_size=batch_size, shuffle=True)
    rngs = {} if name in ("unbroken", "baseline") else {"global_rngs": ()}
    package = BASELINE if name == "baseline" else unbroken
    return package.DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=0, **rngs)


def one_epoch(loader, model, opt, clock=time.perf_counter) -> tuple[float, int]:
    """(seconds on ``clock``, batches) of ``iter(loader)`` and one epoch of training steps."""
    steps = 0
    start = clock()
    for batch in loader:
        train_step(model, opt, batch)
        steps += 1
    return clock() - start, steps


def main() -> None:
    args_parser = parser(__doc__, "loader_tiny", QUICK)
    add_options(args_parser, {
        "rounds": (60, "interleaved rounds; each runs one epoch per loader"),
        "rows": (1024, "rows in the dataset (an epoch is rows / batch steps)"),
        "batch": (2, "batch size"),
        "loaders": ("torch,unbroken,unbroken none,control", "comma-separated: " + ", ".join(LABELS)),
        "baseline_src": (None, "a source tree (e.g. an old revision's src/, checked out with "
                         "git worktree) whose unbroken.DataLoader runs as the loader 'baseline'"),
        "threads": (1, "torch.set_num_threads"),
        "clock": ("wall", "wall (time.perf_counter) or cpu (time.thread_time: this thread's CPU "
                  "time, which leaves out the time other processes hold the core)"),
    })  # fmt: skip
    args = args_parser.parse_args()
    if args.quick:
        args.rounds, args.rows = 5, 256
    if args.clock not in CLOCKS:
        raise SystemExit(f"--clock must be one of {', '.join(CLOCKS)}, got {args.clock!r}")
    clock = CLOCKS[args.clock]
    names = [n.strip() for n in args.loaders.split(",")]
    if names[0] != "torch" or any(n not in LABELS for n in names):
        raise SystemExit(f"--loaders must start with torch and name only {', '.join(LABELS)}")
    if "baseline" in names:
        if not args.baseline_src:
            raise SystemExit("the loader 'baseline' needs --baseline-src DIR")
        import_baseline(args.baseline_src)
    elif args.baseline_src:
        names.append("baseline")
        import_baseline(args.baseline_src)
    torch.set_num_threads(args.threads)
    results = Results("loader_tiny", args.json, args)

    print("# unbroken.DataLoader vs torch's DataLoader, tiny loop, num_workers=0\n")
    print("\n".join(environment()))
    print(
        f"- Linear(32, 2), {args.rows} rows, batch {args.batch}, shuffle=True, SGD; {args.clock} "
        "clock; "
        f"{args.rounds} rounds of one timed epoch per loader (iter() included), order rotated; "
        "one untimed warm-up epoch each\n"
    )
    sys.stdout.flush()

    dataset = RowDataset(args.rows)
    torch.manual_seed(0)
    base = tiny_model()
    runs = {}
    for name in names:
        model = copy.deepcopy(base)
        runs[name] = (make_loader(name, dataset, args.batch), model)
        runs[name] += (torch.optim.SGD(model.parameters(), lr=0.1),)
        one_epoch(*runs[name])  # warm-up

    rounds, foreign = interleaved(names, lambda name: one_epoch(*runs[name], clock), args.rounds)
    steps = rounds[0]["torch"][1]
    rows, entries = [], []
    for name in names:
        us = [r[name][0] / r[name][1] * 1e6 for r in rounds]
        added = [(r[name][0] - r["torch"][0]) / r[name][1] * 1e6 for r in rounds]
        ratio = [r[name][0] / r["torch"][0] for r in rounds]
        is_torch = name == "torch"
        lo, hi = quartiles(ratio)
        ci = median_ci(ratio)
        rows.append([
            LABELS[name], f"{statistics.median(us):.1f}",
            "-" if is_torch else f"{statistics.median(added):+.1f}",
            "1" if is_torch else f"{statistics.median(ratio):.3f}",
            "-" if is_torch else f"{ci[0]:.3f}-{ci[1]:.3f}",
            "-" if is_torch else f"{lo:.3f}-{hi:.3f}",
        ])  # fmt: skip
        entries.append({
            "loader": name, "label": LABELS[name], "us_per_step": statistics.median(us),
            "added_us_per_step": None if is_torch else statistics.median(added),
            "ratio": 1.0 if is_torch else statistics.median(ratio),
            "ratio_ci95": None if is_torch else list(ci),
            "ratio_iqr": None if is_torch else [lo, hi],
        })  # fmt: skip
    print(
        "us/step: an epoch's wall time (iter() included) / its steps, median over rounds. "
        "+us/step: the loader's epoch time minus torch's in the same round, per step, median "
        "over rounds (steadier across machines than the ratio, whose base moves). "
        "ratio: the loader's epoch time / torch's in the same round, median over rounds, with "
        "a bootstrap 95% interval of that median and the rounds' interquartile range.\n"
    )
    results.show(
        "Time per training step",
        ["loader", "us/step", "+us/step", "ratio vs torch", "95% CI", "ratio IQR"],
        rows,
    )  # fmt: skip
    for entry in entries[1:]:
        print(
            f"ratio {entry['loader']}: {entry['ratio']:.3f} "
            f"({entry['added_us_per_step']:+.1f} us/step)"
        )
    note = (
        f"{len(rounds)} rounds of {steps} steps per loader; other processes used "
        f"{statistics.median(foreign):.2f} cores per round (median), {max(foreign):.2f} at most"
    )
    results.finish([note], {"rows": entries, "steps_per_epoch": steps})


if __name__ == "__main__":
    main()
