"""How long ``Checkpointer.save`` blocks the training loop: ``blocking=True`` against ``False``.

How it measures, and what the numbers mean: ``docs/benchmarks/checkpoint-blocking.md``.

    .venv/bin/python benchmarks/checkpoint_blocking.py            # ~1 minute
    .venv/bin/python benchmarks/checkpoint_blocking.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, Results, add_options, environment, load_line
from harness import parser as harness_parser

from unbroken.checkpoint import Checkpointer

WIDTH, BATCH = 2048, 64


def _train_step(model, optimizer, batch) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    optimizer.step()
    if batch.is_cuda:  # time the work, not its launch
        torch.cuda.synchronize()


def _megabytes(state: dict) -> float:
    total = 0
    for tensor in state["model"].state_dict().values():
        total += tensor.numel() * tensor.element_size()
    for per_param in state["optimizer"].state_dict()["state"].values():
        total += sum(
            t.numel() * t.element_size() for t in per_param.values() if isinstance(t, torch.Tensor)
        )
    return total / 1e6


QUICK = "1 layer, 2 rounds"


def main() -> None:
    parser = harness_parser(__doc__, "checkpoint_blocking", QUICK)
    add_options(parser, {
        "layers": (6, "Linear(2048, 2048) layers"), "reps": (5, "timed rounds"),
        "steps": (3, "training steps after each save"),
        "dir": (REPO / "bench_output", "where the checkpoints are written (a fresh subdirectory)"),
        "device": ("cpu", "where the model trains, e.g. cuda"),
    })  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.layers, args.reps = 1, 2
    results = Results("checkpoint_blocking", args.json, args)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(args.layers)])
    model.to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(BATCH, WIDTH, device=args.device)
    _train_step(model, optimizer, batch)  # creates Adam's state
    state = {"model": model, "optimizer": optimizer, "step": 0}

    args.dir.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="checkpoint_blocking-", dir=args.dir))
    checkpointer = Checkpointer(directory, keep=2)
    times = {key: [] for key in ("sync", "async", "async_done", "sync_steps", "async_steps")}
    step = 0

    def save(blocking: bool, train: bool) -> None:
        nonlocal step
        step += 1
        state["step"] = step
        start = time.perf_counter()
        checkpointer.save(step, state, blocking=blocking)
        returned = time.perf_counter()
        for _ in range(args.steps if train else 0):
            _train_step(model, optimizer, batch)
        checkpointer.wait()
        done = time.perf_counter()
        if train:
            times["sync_steps" if blocking else "async_steps"].append(done - start)
        elif blocking:
            times["sync"].append(returned - start)
        else:
            times["async"].append(returned - start)
            times["async_done"].append(done - start)

    try:
        save(True, False)  # warm-up: first file creation, page cache, thread start
        save(False, False)
        steps_alone = []
        for _ in range(args.steps):
            start = time.perf_counter()
            _train_step(model, optimizer, batch)
            steps_alone.append(time.perf_counter() - start)
        for rep in range(args.reps):
            for blocking in (True, False) if rep % 2 == 0 else (False, True):
                save(blocking, False)
                save(blocking, True)
            print(f"[round {rep + 1}/{args.reps} done]", file=sys.stderr, flush=True)
    finally:
        checkpointer.close()
        shutil.rmtree(directory, ignore_errors=True)

    med = {key: statistics.median(values) for key, values in times.items()}
    step_s = statistics.median(steps_alone)
    print("# Checkpointer.save: time the training loop is blocked\n")
    print("\n".join(environment()))
    print(
        f"- state on {args.device}: {args.layers} x Linear({WIDTH}, {WIDTH}) + Adam after one "
        f"step, {_megabytes(state):.0f} MB of tensors per checkpoint; keep=2; directory "
        f"{args.dir}"
    )
    print(
        f"- {args.reps} rounds, medians; a training step alone (batch {BATCH}) takes "
        f"{step_s * 1e3:.0f} ms\n"
    )
    rows = [
        [
            "save returns (loop blocked)",
            f"{med['sync']:.3f}",
            f"{med['async']:.3f}",
            f"{med['async'] / med['sync']:.3f}",
        ],
        [
            "checkpoint committed",
            f"{med['sync']:.3f}",
            f"{med['async_done']:.3f}",
            f"{med['async_done'] / med['sync']:.2f}",
        ],
        [
            f"save + {args.steps} training steps, committed",
            f"{med['sync_steps']:.3f}",
            f"{med['async_steps']:.3f}",
            f"{med['async_steps'] / med['sync_steps']:.2f}",
        ],
    ]
    results.show("Time the training loop waits, seconds", [
        "seconds (median)", "blocking=True", "blocking=False", "async/sync",
    ], rows)  # fmt: skip
    serial = (
        f"save + {args.steps} steps without any overlap would take "
        f"{med['sync'] + args.steps * step_s:.3f} s (sync save + steps alone)."
    )
    print("\n" + serial)
    print()
    print(load_line())
    results.notes = [serial]
    results.data = {
        "device": args.device,
        "layers": args.layers,
        "megabytes": _megabytes(state),
        "reps": args.reps,
        "steps": args.steps,
        "step_alone_s": step_s,
        # medians, seconds: sync = save(blocking=True) returns (committed); async = save(
        # blocking=False) returns; async_done = then committed; *_steps = save + steps, committed
        "median_s": med,
        "times_s": times,
    }
    results.write()


if __name__ == "__main__":
    main()
