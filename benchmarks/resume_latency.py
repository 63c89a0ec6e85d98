"""Resume latency: load_state_dict on a fresh loader -> first batch, early vs late in an epoch.

How it measures, and what the numbers mean: ``docs/benchmarks/resume-latency.md``.

    .venv/bin/python benchmarks/resume_latency.py           # 10M samples, ~3.5 minutes
    .venv/bin/python benchmarks/resume_latency.py --quick   # smoke run, ~10 seconds
"""

from __future__ import annotations

import gc
import json
import pickle
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ForeignLoad, Results, add_round_options, environment, load_line
from harness import parser as harness_parser
from harness.results import add_options
from harness.stats import probed_rounds

import unbroken

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:
    StatefulDataLoader = None

BATCH = 64
POINTS = (0.01, 0.50, 0.99)


class IndexDataset(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


def keep_list(batch):
    return batch


def as_ints(batch) -> list[int]:
    return [int(x) for x in batch]


class Library:
    def __init__(self, name: str, make, dumps, loads) -> None:
        self.name, self.make, self.dumps, self.loads = name, make, dumps, loads


def libraries(dataset, global_rngs) -> list[Library]:
    libs = [
        Library(
            "unbroken",
            lambda: unbroken.DataLoader(
                dataset,
                batch_size=BATCH,
                shuffle=True,
                seed=0,
                collate_fn=keep_list,
                global_rngs=global_rngs,
            ),
            lambda s: json.dumps(s).encode(),
            json.loads,
        )
    ]
    if StatefulDataLoader is not None:
        libs.append(
            Library(
                "torchdata",
                lambda: StatefulDataLoader(
                    dataset, batch_size=BATCH, shuffle=True, collate_fn=keep_list
                ),
                pickle.dumps,
                pickle.loads,
            )
        )
    return libs


def capture(lib: Library, stops: list[int]) -> tuple[dict, float]:
    """One pass: {batches received: (serialized state, the batch that came next)}."""
    loader = lib.make()
    wanted, got, pending = set(stops), {}, None
    start = time.perf_counter()
    for received, batch in enumerate(loader, start=1):
        if pending is not None:
            got[pending] = (got[pending], as_ints(batch))
            pending = None
            if len(got) == len(wanted):
                break
        if received in wanted:
            got[received] = lib.dumps(loader.state_dict())
            pending = received
    seconds = time.perf_counter() - start
    del loader
    gc.collect()
    return got, seconds


def time_resume(lib: Library, blob: bytes | None) -> tuple[float, list[int]]:
    loader = lib.make()
    state = lib.loads(blob) if blob is not None else None
    gc.collect()
    start = time.perf_counter()
    if state is not None:
        loader.load_state_dict(state)
    first = next(iter(loader))
    seconds = time.perf_counter() - start
    del loader
    return seconds, as_ints(first)


QUICK = "200k samples, 2 reps"


def main() -> None:
    parser = harness_parser(__doc__, "resume_latency", QUICK)
    add_options(parser, {
        "samples": (10_000_000, "epoch length"),
        "reps": (5, "clean rounds; each times every point once per library"),
        "fast_reps": (9, "timed resumes of unbroken per point and round (it takes ~1 ms, so "
                      "more samples cost nothing and steady its median)"),
        "global_rngs": ("torch,numpy,random", "unbroken's global_rngs, comma-separated ('' for "
                        "none); seeding makes the capture pass slower, not the resume"),
    })  # fmt: skip
    add_round_options(parser, 10)
    args = parser.parse_args()
    if args.quick:
        # Rounds this short are below the load probe's resolution: none is set aside.
        args.samples, args.reps, args.max_foreign = 200_000, 2, float("inf")
    global_rngs = tuple(x for x in args.global_rngs.split(",") if x)
    torch.set_num_threads(1)
    results = Results("resume_latency", args.json, args)

    n_batches = -(-args.samples // BATCH)
    stops = [max(1, round(p * n_batches)) for p in POINTS]
    dataset = IndexDataset(args.samples)
    libs = libraries(dataset, global_rngs)

    print("# Resume latency: load_state_dict -> first batch\n")
    print("\n".join(environment()))
    print(
        f"- epoch: {args.samples:,} samples, shuffle=True, batch_size {BATCH} ({n_batches:,} "
        "batches), num_workers 0, __getitem__ returns torch.tensor(i), collate_fn keeps the list"
    )
    print(
        f"- unbroken.DataLoader(seed=0, global_rngs={global_rngs!r}); torchdata "
        "StatefulDataLoader(shuffle=True) with its defaults"
    )
    print(
        f"- timed resumes per point: {args.reps * args.fast_reps} for unbroken, {args.reps} "
        "for torchdata, interleaved over rounds (a round during which other processes used "
        f"more than {args.max_foreign} cores is set aside and another run, at most "
        f"{args.max_rounds}); each on a freshly constructed loader; timed: "
        "load_state_dict + iter + next (construction and deserialization not timed)"
    )
    if StatefulDataLoader is None:
        print("- torchdata is not installed: its columns are left out")
    sys.stdout.flush()

    states, capture_s = {}, {}
    for lib in libs:
        states[lib.name], capture_s[lib.name] = capture(lib, stops)
        print(
            f"[captured {lib.name} states in {capture_s[lib.name]:.0f} s]",
            file=sys.stderr,
            flush=True,
        )

    labels = ["0% (fresh, no state)"] + [f"{p:.0%}" for p in POINTS]
    blobs = {lib.name: [None] + [states[lib.name][k][0] for k in stops] for lib in libs}
    expected = {lib.name: [None] + [states[lib.name][k][1] for k in stops] for lib in libs}
    wrong = []
    for lib in libs:  # warm-up: imports, allocator, first-call costs
        time_resume(lib, blobs[lib.name][1])

    # Rounds time every point once per library (unbroken --fast-reps times). A round during
    # which other processes used more than --max-foreign cores is set aside and another run,
    # up to --max-rounds; the medians use the clean rounds (all, flagged, if fewer than 3).
    def one_round(index: int) -> dict[str, list[list[float]]]:
        this_round: dict[str, list[list[float]]] = {lib.name: [[] for _ in labels] for lib in libs}
        for i in range(len(labels)):
            for lib in libs if (index + i) % 2 == 0 else libs[::-1]:
                for _ in range(args.fast_reps if lib.name == "unbroken" else 1):
                    seconds, first = time_resume(lib, blobs[lib.name][i])
                    this_round[lib.name][i].append(seconds)
                    if expected[lib.name][i] is not None and first != expected[lib.name][i]:
                        wrong.append(f"{lib.name} at {labels[i]}")
        print(f"[round {index + 1} done]", file=sys.stderr, flush=True)
        return this_round

    count = iter(range(10**6))
    probed, foreign, n_clean = probed_rounds(
        ["all"],
        lambda _: one_round(next(count)),
        args.reps,
        args.max_rounds,
        args.max_foreign,
        ForeignLoad(),
    )
    used = [r["all"] for r in probed]
    times = {
        lib.name: [[t for r in used for t in r[lib.name][i]] for i in range(len(labels))]
        for lib in libs
    }

    med = {name: [statistics.median(t) for t in ts] for name, ts in times.items()}
    header = ["position", "samples before"]
    for lib in libs:
        header += [f"{lib.name} median s", f"{lib.name} min-max s"]
    if len(libs) == 2:
        header.append("unbroken / torchdata")
    rows = []
    for i, label in enumerate(labels):
        row = [label, f"{0 if i == 0 else stops[i - 1] * BATCH:,}"]
        for lib in libs:
            ts = times[lib.name][i]
            row += [f"{med[lib.name][i]:.4f}", f"{min(ts):.4f}-{max(ts):.4f}"]
        if len(libs) == 2:
            row.append(f"{med['unbroken'][i] / med['torchdata'][i]:.4f}")
        rows.append(row)

    print("\n## Time from load_state_dict to the first batch\n")
    results.show("Time from load_state_dict to the first batch", header, rows)
    print("\n## Flatness and state size\n")
    results.show("Flatness and state size", [
        "library", "99% / 1% (medians)", "50% / 1% (medians)", "state bytes at 1%",
        "state bytes at 99%", "capture pass s",
    ], [
                    [
                        lib.name,
                        f"{med[lib.name][3] / med[lib.name][1]:.3f}",
                        f"{med[lib.name][2] / med[lib.name][1]:.3f}",
                        f"{len(blobs[lib.name][1]):,}",
                        f"{len(blobs[lib.name][3]):,}",
                        f"{capture_s[lib.name]:.0f}",
                    ]
                    for lib in libs
                ])  # fmt: skip
    print(
        "\nstate bytes: len(json.dumps(state)) for unbroken, len(pickle.dumps(state)) for "
        "torchdata. capture pass: iterating to 99% (+1 batch) and taking the three states."
    )
    exact = "resumed first batch == the batch the uninterrupted pass got next: " + (
        "yes, at every point" if not wrong else "NO: " + ", ".join(sorted(set(wrong)))
    )
    print("\n" + exact)
    counted = "clean" if args.max_foreign != float("inf") else "unfiltered (--quick)"
    timing = (
        f"timing rounds: {n_clean} {counted} of {len(foreign)} (other processes' CPU use per "
        "round, cores: "
        + ", ".join(f"{f:.2f}" for f in foreign)
        + ")"
        + (
            ""
            if n_clean >= min(3, args.reps)
            else "; TOO FEW CLEAN ROUNDS, all used: DISTURBED, re-run"
        )
    )
    print("\n" + timing)
    results.notes = [exact, timing]
    print()
    print(load_line())
    results.data = {
        "samples": args.samples,
        "batch_size": BATCH,
        "global_rngs": list(global_rngs),
        # 0 is the fresh start without a state; the others the share of the epoch done
        "positions": [0.0, *POINTS],
        "position_labels": labels,
        "samples_before": [0] + [stops[i] * BATCH for i in range(len(stops))],
        "libraries": {
            lib.name: {
                "median_s": med[lib.name],
                "min_s": [min(ts) for ts in times[lib.name]],
                "max_s": [max(ts) for ts in times[lib.name]],
                "resumes": [len(ts) for ts in times[lib.name]],
                "state_bytes": [None] + [len(b) for b in blobs[lib.name][1:]],
                "capture_s": capture_s[lib.name],
            }
            for lib in libs
        },
        "exact": not wrong,
        "wrong": sorted(set(wrong)),
        "rounds": {
            "used": len(used),
            "clean": n_clean,
            "total": len(foreign),
            "foreign_cores": foreign,
            "disturbed": n_clean < min(3, args.reps),
        },
    }
    results.write()


if __name__ == "__main__":
    main()
