"""The Trainer's small per-step calls, timed alone and right after a backward, in one process.

The Trainer's work between a backward and the next forward is a few dozen small calls: tensor
operations on a few elements, a loader's ``state_dict()``, seeding the generators. Alone, in a
tight loop, each takes a microsecond or a few. This times each of them both ways: alone (the
call repeated, its code and data hot), and once per training step of the 4-layer MLP of
``trainer_ddp.py``, right after its backward, as in the Trainer's loop. The ratio says how much
a machine's caches, emptied by the backward, inflate the loop's bookkeeping.

    .venv/bin/python benchmarks/cold_calls.py            # about 30 seconds
    .venv/bin/python benchmarks/cold_calls.py --quick    # smoke run: seconds of noise

Each call is timed with ``time.thread_time_ns`` (this thread's CPU time; the clock's own cost,
measured, is subtracted). Results: ``docs/benchmarks/trainer-ddp.md``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, environment
from harness import parser as harness_parser

import unbroken
from unbroken.data.keys import derive_key, extend_key
from unbroken.train.globalrng import TRAIN, seed_step

WIDTH, LAYERS, BATCH = 512, 4, 16
QUICK = "20 steps and 200 calls alone"


def calls() -> dict[str, Callable[[], object]]:
    """The calls timed, each a closure over its own small state."""
    row = torch.zeros(48)
    small = torch.zeros(48)
    dataset = torch.utils.data.TensorDataset(torch.zeros(1024, 4))
    loader = unbroken.DataLoader(dataset, batch_size=4, shuffle=True, seed=0)
    iterator = iter(loader)
    next(iterator)
    steps = iter(range(1 << 62))
    prefix = derive_key(0, TRAIN, 0)  # an epoch's: the same for each of its steps
    return {
        "clamp and convert 48 floats (torch)": lambda: row.clamp(max=255).to(torch.uint8),
        "add 1 to 48 floats in place (torch)": lambda: small.add_(1),
        "unbroken.DataLoader.state_dict()": loader.state_dict,
        "seed_step (torch, numpy, random)": lambda: seed_step(0, TRAIN, 0, next(steps), 0),
        # seed_step's key, both ways: all five parts each step, or the epoch's prefix kept
        # (seed_step keeps it in an lru_cache, whose lookup this row leaves out).
        "step key: derive_key of 5 parts": lambda: derive_key(0, TRAIN, 0, next(steps), 0),
        "step key: extend_key of the prefix": lambda: extend_key(prefix, next(steps), 0),
    }


def clock_cost() -> int:
    """Nanoseconds of a ``thread_time_ns`` pair around nothing: subtracted from every call."""
    samples = []
    for _ in range(1000):
        start = time.thread_time_ns()
        samples.append(time.thread_time_ns() - start)
    return int(statistics.median(samples))


def alone(call: Callable[[], object], repeats: int, overhead: int) -> float:
    """Microseconds of one call, repeated in a tight loop (hot)."""
    for _ in range(repeats // 10):
        call()
    start = time.thread_time_ns()
    for _ in range(repeats):
        call()
    return max(0.0, (time.thread_time_ns() - start) / repeats - overhead / 2) / 1e3


def after_backward(
    named: dict[str, Callable[[], object]], steps: int, overhead: int
) -> dict[str, float]:
    """Median microseconds of each call made once per training step, right after its
    backward, the calls in a rotated order so that none is always the first."""
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    names = list(named)
    spent: dict[str, list[float]] = {name: [] for name in names}
    for step in range(steps + 5):
        torch.nn.functional.mse_loss(model(x), y).backward()
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.thread_time_ns()
            named[name]()
            took = time.thread_time_ns() - start - overhead
            if step >= 5:  # the first steps warm the loop up
                spent[name].append(max(0, took) / 1e3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: statistics.median(values) for name, values in spent.items()}


def main() -> None:
    parser = harness_parser(__doc__, "cold_calls", QUICK)
    parser.add_argument("--steps", type=int, default=400, help="training steps timed")
    parser.add_argument("--repeats", type=int, default=20000, help="calls timed alone")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 20, 200
    torch.set_num_threads(1)
    results = Results("cold_calls", args.json, args)
    print("\n".join(environment()), flush=True)
    overhead = clock_cost()
    named = calls()
    hot = {name: alone(call, args.repeats, overhead) for name, call in named.items()}
    cold = after_backward(named, args.steps, overhead)
    rows, entries = [], {}
    for name in named:
        ratio = cold[name] / hot[name] if hot[name] > 0 else float("nan")
        rows.append([name, f"{hot[name]:.2f}", f"{cold[name]:.2f}", f"{ratio:.1f}"])
        entries[name] = {"alone_us": hot[name], "after_backward_us": cold[name]}
    results.show(
        f"One call alone and right after a backward of {LAYERS} x Linear({WIDTH}, {WIDTH}), "
        "one thread: CPU microseconds",
        ["call", "alone (us)", "after a backward (us, median)", "ratio"],
        rows,
        left=1,
    )
    notes = [
        f"alone: the mean of {args.repeats} calls in a row; after a backward: the median over "
        f"{args.steps} training steps of one call each, the calls' order rotated every step",
        f"the clock's own cost, {overhead} ns a pair, is subtracted",
    ]
    results.finish(notes, {"calls": entries})


if __name__ == "__main__":
    main()
