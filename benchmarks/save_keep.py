"""A save's time and S3 requests against the number of checkpoints kept (``keep``), in S3.

How it measures, and what the numbers mean: ``docs/benchmarks/save-keep.md``.

    .venv/bin/python benchmarks/save_keep.py            # keep 5, 25, 100; 10 saves each: ~1 min
    .venv/bin/python benchmarks/save_keep.py --quick    # keep 5, 25; 3 saves each: seconds
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, add_options, environment, load_line
from harness import parser as harness_parser
from harness.s3 import RequestCounter

from unbroken.checkpoint import Checkpointer

QUICK = "keep 5 and 25, 3 timed saves each"


def measure(url: str, options: dict, keep: int, saves: int, counter: RequestCounter) -> dict:
    """Fill ``url`` with ``keep`` checkpoints, then time a new Checkpointer's first save (each
    kept checkpoint judged once) and ``saves`` saves after it (the steady state)."""
    state = {"value": list(range(256))}  # small: the cost measured is per checkpoint kept
    filler = Checkpointer(url, keep=keep, storage_options=options)
    for step in range(keep):
        filler.save(step, state)
    checkpointer = Checkpointer(url, keep=keep, storage_options=options)  # a new process's
    counter.take()
    start = time.perf_counter()
    checkpointer.save(keep, state)
    first = time.perf_counter() - start
    first_operations = counter.take()
    times, requests, operations = [], [], {}
    for step in range(keep + 1, keep + 1 + saves):
        start = time.perf_counter()
        checkpointer.save(step, state)
        times.append(time.perf_counter() - start)
        operations = counter.take()
        requests.append(sum(operations.values()))
    return {"first_s": first, "first_requests": sum(first_operations.values()),
            "first_operations": first_operations, "times_s": times, "requests": requests,
            "operations": operations}  # fmt: skip


def main() -> None:
    parser = harness_parser(__doc__, "save_keep", QUICK)
    add_options(parser, {
        "keeps": ("5,25,100", "the numbers of checkpoints kept, comma-separated"),
        "saves": (10, "timed saves for each keep, after the first"),
    })  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.keeps, args.saves = "5,25", 3
    keeps = [int(k) for k in args.keeps.split(",")]
    results = Results("save_keep", args.json, args)

    from unbroken.testing import S3Server

    measured: dict[int, dict] = {}
    counter = RequestCounter()
    try:
        with S3Server() as s3:
            bucket = s3.make_bucket("bench")
            for keep in keeps:
                measured[keep] = measure(
                    f"{bucket}/keep-{keep}", s3.storage_options, keep, args.saves, counter
                )
                print(f"[keep={keep} done]", file=sys.stderr, flush=True)
    finally:
        counter.close()

    print("# Checkpointer.save in S3 against the checkpoints kept\n")
    print("\n".join(environment()))
    print(
        f"- S3 protocol server: moto on 127.0.0.1; a 1 KB state; {args.saves} saves per keep "
        "after a new Checkpointer's first; medians (min-max)\n"
    )
    rows = []
    for keep, m in measured.items():
        times = m["times_s"]
        rows.append([
            str(keep),
            f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})",
            f"{statistics.median(m['requests']):.0f}",
            f"{m['first_s']:.3f}",
            str(m["first_requests"]),
        ])  # fmt: skip
    results.show("A save's seconds and S3 requests against keep", [
        "keep", "save, s (median, min-max)", "requests a save", "first save, s",
        "first save's requests",
    ], rows)  # fmt: skip
    last = measured[keeps[-1]]
    notes = [
        f"A save's requests by operation, keep={keeps[-1]}: {last['operations']}.",
        f"A new Checkpointer's first save, keep={keeps[-1]}: {last['first_operations']}. It "
        "reads each kept manifest once (HeadObject + GetObject), to know which local copies "
        "to keep; later saves read only the new checkpoint's.",
    ]
    print("\n" + "\n".join(f"- {note}" for note in notes) + "\n")
    print(load_line())
    results.notes = notes
    results.data = {"keeps": keeps, "saves": args.saves, "measured": measured}
    results.write()


if __name__ == "__main__":
    main()
