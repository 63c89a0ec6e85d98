"""Data-parallel training on CPU (gloo, 2 ranks under torchrun): loader cost, preemption
agreement cost, resume latency.

How it measures, and what the numbers mean: ``docs/benchmarks/ddp-loader.md``.

    .venv/bin/python benchmarks/ddp_loader.py            # full run, ~2 minutes on 2 cores
    .venv/bin/python benchmarks/ddp_loader.py --quick    # smoke run, ~20 seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    ForeignLoad,
    Results,
    add_round_options,
    command_line,
    environment,
    jsonable,
    load_line,
    stats,
    table,
)
from harness import parser as harness_parser
from harness.jobs import hand_back, launcher_pid, rank0_decides, slowest, torchrun_script
from harness.stats import median_ci as median_ci_bounds
from harness.stats import probe_note, rotated

import unbroken

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

BATCH = 64
FEATURES = 64
NPROC = 2


# --------------------------------------------------------------------------- datasets, model


class Rows(torch.utils.data.Dataset):
    """``n`` random rows of 64 floats with a label in [0, 10); the same on every rank."""

    def __init__(self, n: int, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if self.augment:  # per-sample randomness from the global torch RNG
            x = x + 0.1 * torch.randn(FEATURES)
        return x, self.y[i]


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )


def step(model, opt, batch) -> None:
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


# --------------------------------------------------------------------------- helpers


def say(*lines: str) -> None:
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def note(text: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{text}]", file=sys.stderr, flush=True)


def median_ci(xs: list[float]) -> str:
    low, high = median_ci_bounds(xs)
    return f"{low:.3f}-{high:.3f}"


def probed_rounds(names, run_one, want: int, most: int, max_foreign: float, monitor):
    """The harness's probed rounds, probed on rank 0 and agreed by every rank."""
    probe = monitor if dist.get_rank() == 0 else None
    return stats.probed_rounds(names, run_one, want, most, max_foreign, probe, more=rank0_decides)


# --------------------------------------------------------------------------- part 1: epochs

LOADERS = ["torch", "unbroken", "unbroken torch-only"]
LABELS = {
    "torch": "torch DataLoader + DistributedSampler",
    "unbroken": "unbroken (global_rngs default)",
    "unbroken torch-only": 'unbroken global_rngs=("torch",)',
}


def make_loader(name: str, dataset, workers: int):
    common = dict(batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0)
    if name == "torch":
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        return torch.utils.data.DataLoader(dataset, sampler=sampler, **common), sampler
    if name == "unbroken torch-only":
        common["global_rngs"] = ("torch",)
    return unbroken.DataLoader(dataset, shuffle=True, seed=0, **common), None


def step_context(base, steps: int = 300, reps: int = 3) -> tuple[float, float]:
    """Microseconds per training step on batches already in memory (no loader), both ranks at
    once: the model alone, and in DDP (plus its gradient all-reduce). Medians of ``reps``."""
    data = Rows(steps * BATCH)
    batches = [(data.x[i : i + BATCH], data.y[i : i + BATCH]) for i in range(0, len(data), BATCH)]
    out = []
    for wrap in (lambda m: m, DDP):
        model = wrap(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        times = []
        for _ in range(reps):
            dist.barrier()
            begin = time.perf_counter()
            for batch in batches:
                step(model, opt, batch)
            times.append(slowest(time.perf_counter() - begin) / steps * 1e6)
        out.append(statistics.median(times))
    return out[0], out[1]


def data_only(datasets, args) -> dict:
    """num_workers=0, no training: us per sample of a rank to iterate one epoch, both ranks at
    once, ``args.rounds`` rounds, order rotated. Returns {key: (median, median diff to torch)}."""
    runs = {}
    for ds_name, dataset in datasets.items():
        for name in LOADERS:
            runs[(ds_name, name)] = [*make_loader(name, dataset, 0), 0]
    per_rank = -(-len(next(iter(datasets.values()))) // NPROC)

    def run_one(key):
        loader, sampler, epoch = runs[key]
        if sampler is not None:
            sampler.set_epoch(epoch)
        runs[key][2] += 1
        dist.barrier()
        begin = time.perf_counter()
        for _ in loader:
            pass
        return slowest(time.perf_counter() - begin) / per_rank * 1e6

    for key in runs:
        run_one(key)
    rounds = [{key: run_one(key) for key in rotated(list(runs), i)} for i in range(args.rounds)]
    return {
        (d, n): (
            statistics.median(r[(d, n)] for r in rounds),
            statistics.median(r[(d, n)] - r[(d, "torch")] for r in rounds),
        )
        for d, n in runs
    }


def epoch_part(args, monitor):
    datasets = {"plain": Rows(args.samples), "augment": Rows(args.samples, augment=True)}
    torch.manual_seed(0)
    base = mlp()
    local_us, ddp_us = step_context(base)
    rows, entries = [], []
    notes = [
        f"context, batches already in memory (no loader), both ranks at once: the model's step "
        f"alone {local_us:.0f} us, in DDP {ddp_us:.0f} us (the rest is gloo's gradient "
        "all-reduce and the ranks waiting for each other)"
    ]
    start = time.perf_counter()
    before = monitor.snapshot() if dist.get_rank() == 0 else None
    data = data_only(datasets, args)
    foreign = ForeignLoad.cores(before, monitor.snapshot()) if dist.get_rank() == 0 else 0.0
    text = (
        f"data-only (num_workers=0): {args.rounds} rounds; other processes used "
        f"{foreign:.2f} cores on average meanwhile"
    )
    notes.append(text)
    note(f"{text}; {time.perf_counter() - start:.0f} s")
    for workers in (0, 2):
        start = time.perf_counter()
        runs = {}
        for ds_name, dataset in datasets.items():
            for name in LOADERS:
                loader, sampler = make_loader(name, dataset, workers)
                model = DDP(copy.deepcopy(base))
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                runs[(ds_name, name)] = {"loader": loader, "sampler": sampler, "model": model,
                                         "opt": opt, "epoch": 0, "steps": 0}  # fmt: skip

        def run_one(key, runs=runs):
            run = runs[key]
            if run["sampler"] is not None:
                run["sampler"].set_epoch(run["epoch"])
            run["epoch"] += 1
            dist.barrier()
            begin = time.perf_counter()
            steps = 0
            for batch in run["loader"]:
                step(run["model"], run["opt"], batch)
                steps += 1
            wall = time.perf_counter() - begin
            run["steps"] = steps
            return slowest(wall)

        for key in runs:  # warm-up: starts the persistent workers, fills caches
            run_one(key)
        used, foreign, n_clean = probed_rounds(
            list(runs), run_one, args.rounds, args.max_rounds, args.max_foreign, monitor
        )
        del runs, run_one  # shuts the persistent workers down
        for ds_name in datasets:
            torch_s = [r[(ds_name, "torch")] for r in used]
            for name in LOADERS:
                key = (ds_name, name)
                wall = [r[key] for r in used]
                ratio = [r[key] / r[(ds_name, "torch")] for r in used]
                is_torch = name == "torch"
                steps = -(-len(datasets[ds_name]) // (BATCH * NPROC))
                rows.append(
                    [
                        ds_name,
                        str(workers),
                        LABELS[name],
                        f"{statistics.median(wall):.3f}",
                        f"{statistics.median(wall) / steps * 1e3:.2f}",
                        "1" if is_torch else f"{statistics.median(ratio):.3f}",
                        "-" if is_torch else median_ci(ratio),
                        "-" if is_torch else f"{min(ratio):.3f}-{max(ratio):.3f}",
                        "-"
                        if is_torch
                        else f"{(statistics.median(w - t for w, t in zip(wall, torch_s))) / steps / BATCH * 1e6:+.1f}",
                        f"{data[key][0]:.1f}" if workers == 0 else "-",
                        "-" if is_torch or workers else f"{data[key][1]:+.1f}",
                    ]
                )
                entries.append(
                    {
                        "dataset": ds_name,
                        "workers": workers,
                        "loader": name,
                        "label": LABELS[name],
                        "s_per_epoch": statistics.median(wall),
                        "ratio": 1.0 if is_torch else statistics.median(ratio),
                        "ratio_ci95": None if is_torch else list(median_ci_bounds(ratio)),
                        "ratio_min_max": None if is_torch else [min(ratio), max(ratio)],
                        "data_only_us_per_sample": data[key][0] if workers == 0 else None,
                    }
                )
        text = probe_note(f"epochs, num_workers={workers}", foreign, n_clean, args.rounds)
        notes.append(text)
        note(f"{text}; {time.perf_counter() - start:.0f} s")
    return rows, notes, {"step_us": {"model": local_us, "ddp": ddp_us}, "rows": entries}


# --------------------------------------------------------------------------- part 2: agreement


def allreduce_alone(n: int, reps: int, async_op: bool = False) -> float:
    """Microseconds per 1-element int all-reduce (MAX), median over ``reps`` tight loops."""
    times = []
    for _ in range(reps):
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(n):
            flag = torch.tensor([0], dtype=torch.int32)
            if async_op:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True).wait()
            else:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
        times.append(slowest(time.perf_counter() - begin) / n * 1e6)
    return statistics.median(times)


AGREEMENT = {
    "never": "no agreement",
    "every 10": "all_reduce every 10 steps",
    "every step": "all_reduce every step",
    "every step async": "all_reduce every step, async_op=True, waited one step later",
}


def agreement_part(args, monitor):
    alone = allreduce_alone(args.allreduce_n, args.allreduce_reps)
    alone_async = allreduce_alone(args.allreduce_n, args.allreduce_reps, async_op=True)
    dataset = Rows(args.samples)
    torch.manual_seed(0)
    base = mlp()
    runs = {}
    for name in AGREEMENT:  # each loop: its own loader (same order), model and position
        model = DDP(copy.deepcopy(base))
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
        runs[name] = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01),
                      "sampler": sampler, "loader": loader, "epoch": 0, "it": None}  # fmt: skip
    chunk = args.agree_chunk
    requested = False  # what a signal handler would set; never set here

    def next_batch(run):
        while True:
            if run["it"] is None:
                run["sampler"].set_epoch(run["epoch"])
                run["epoch"] += 1
                run["it"] = iter(run["loader"])
            try:
                return next(run["it"])
            except StopIteration:  # the epoch ends: the next one starts inside the timing
                run["it"] = None

    def run_one(name):
        run = runs[name]
        every = {"never": 0, "every 10": 10}.get(name, 1)
        pending = None
        dist.barrier()
        begin = time.perf_counter()
        for k in range(1, chunk + 1):
            step(run["model"], run["opt"], next_batch(run))
            if not every or k % every:
                continue
            if pending is not None:  # async: the previous step's agreement
                pending[0].wait()
                if pending[1].item():
                    break
            flag = torch.tensor([int(requested)], dtype=torch.int32)
            if name == "every step async":
                pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
                continue
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
        if pending is not None:
            pending[0].wait()
        return slowest(time.perf_counter() - begin)

    for name in runs:  # warm-up
        run_one(name)
    used, foreign, n_clean = probed_rounds(
        list(runs), run_one, args.agree_rounds, 2 * args.agree_rounds, args.max_foreign, monitor
    )
    reduces = {"never": 0, "every 10": chunk // 10}
    never = [r["never"] for r in used]
    rows, entries = [], []
    for name, label in AGREEMENT.items():
        wall = [r[name] for r in used]
        ratio = [r[name] / r["never"] for r in used]
        n = reduces.get(name, chunk)
        extra = statistics.median(w - v for w, v in zip(wall, never))
        rows.append(
            [
                label,
                str(n),
                f"{statistics.median(wall) / chunk * 1e6:.0f}",
                "1" if name == "never" else f"{statistics.median(ratio):.3f}",
                "-" if name == "never" else median_ci(ratio),
                "-" if name == "never" else f"{min(ratio):.3f}-{max(ratio):.3f}",
                "-" if name == "never" else f"{extra / n * 1e6:+.0f}",
            ]
        )
        entries.append(
            {
                "agreement": name,
                "label": label,
                "all_reduces_per_round": n,
                "us_per_step": statistics.median(wall) / chunk * 1e6,
                "ratio": 1.0 if name == "never" else statistics.median(ratio),
                "ratio_ci95": None if name == "never" else list(median_ci_bounds(ratio)),
                "extra_us_per_all_reduce": None if name == "never" else extra / n * 1e6,
            }
        )
    text = probe_note("agreement", foreign, n_clean, args.agree_rounds)
    data = {"all_reduce_alone_us": alone, "all_reduce_alone_async_us": alone_async}
    return (alone, alone_async), rows, text, len(used), {**data, "rows": entries}


# --------------------------------------------------------------------------- part 3: resume


class SkipIndices(torch.utils.data.Sampler):
    """The rank's ``DistributedSampler`` order without its first ``skip`` indices."""

    def __init__(self, sampler: DistributedSampler, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self):
        return iter(list(self.sampler)[self.skip :])

    def __len__(self) -> int:
        return len(self.sampler) - self.skip


def torch_resume(dataset, k: int, mode: str):
    """torch's DataLoader + DistributedSampler at epoch 0, resumed after k batches."""
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    sampler.set_epoch(0)
    if mode == "skip indices":
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=BATCH, sampler=SkipIndices(sampler, k * BATCH)
        )
        return next(iter(loader))
    it = iter(torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler))
    for _ in range(k):
        next(it)
    return next(it)


def unbroken_resume(dataset, state):
    loader = unbroken.DataLoader(dataset, batch_size=BATCH, shuffle=True, seed=0)
    loader.load_state_dict(state)
    return next(iter(loader))


def resume_part(args, monitor):
    dataset = Rows(args.resume_samples)
    steps = -(-len(dataset) // (BATCH * NPROC))
    points = {p: max(1, round(p * steps)) for p in (0.01, 0.99)}

    # capture: one uninterrupted unbroken pass and one torch pass, to the last point
    begin = time.perf_counter()
    captured = {}
    loader = unbroken.DataLoader(dataset, batch_size=BATCH, shuffle=True, seed=0)
    it = iter(loader)
    for k in range(1, max(points.values()) + 2):
        batch = next(it)
        for p, at in points.items():
            if k == at:
                captured[p] = {"state": json.loads(json.dumps(loader.state_dict()))}
            elif k == at + 1:
                captured[p]["next"] = batch
    del it
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    sampler.set_epoch(0)
    torch_batches = list(torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler))
    capture_s = slowest(time.perf_counter() - begin)

    modes = ["unbroken", "torch skip batches", "torch skip indices"]
    times = {(p, m): [] for p in points for m in modes}
    ok = True
    before = monitor.snapshot() if dist.get_rank() == 0 else None
    trials = [(p, m) for p in points for m in modes]
    for rep in range(-1, args.resume_reps):  # round -1: an untimed warm-up
        for p, mode in rotated(trials, max(rep, 0)):
            k = points[p]
            dist.barrier()
            begin = time.perf_counter()
            if mode == "unbroken":
                batch = unbroken_resume(dataset, captured[p]["state"])
            else:
                batch = torch_resume(dataset, k, mode.removeprefix("torch "))
            wall = time.perf_counter() - begin
            wall = slowest(wall)
            if rep >= 0:
                times[(p, mode)].append(wall)
            expected = captured[p]["next"] if mode == "unbroken" else torch_batches[k]
            ok &= all(torch.equal(a, b) for a, b in zip(batch, expected))
    foreign = ForeignLoad.cores(before, monitor.snapshot()) if dist.get_rank() == 0 else 0.0
    ok_all = torch.tensor([int(ok)])
    dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)

    rows, entries = [], []
    med = {key: statistics.median(v) for key, v in times.items()}
    for p, k in points.items():
        for mode in modes:
            rows.append(
                [
                    f"{p:.0%}",
                    f"{k} of {steps}",
                    mode,
                    f"{med[(p, mode)] * 1e3:.2f}",
                    f"{min(times[(p, mode)]) * 1e3:.2f}-{max(times[(p, mode)]) * 1e3:.2f}",
                    "1" if mode == "unbroken" else f"{med[(p, mode)] / med[(p, 'unbroken')]:.1f}",
                ]
            )
            entries.append(
                {
                    "position": p,
                    "global_batches_done": k,
                    "steps_per_epoch": steps,
                    "method": mode,
                    "median_ms": med[(p, mode)] * 1e3,
                    "min_ms": min(times[(p, mode)]) * 1e3,
                    "max_ms": max(times[(p, mode)]) * 1e3,
                }
            )
    flat = [[mode, f"{med[(0.99, mode)] / med[(0.01, mode)]:.3f}"] for mode in modes]  # 99% / 1%
    state_bytes = len(json.dumps(captured[0.99]["state"]))
    text = (
        f"resume: {args.resume_reps} timed resumes per point and method; other processes "
        f"used {foreign:.2f} cores on average meanwhile; capture passes {capture_s:.1f} s; "
        f"unbroken state {state_bytes} bytes of JSON; every resumed first batch equal to the "
        f"uninterrupted pass's: {'yes' if ok_all.item() else 'NO'}"
    )
    data = {"samples": args.resume_samples, "exact": bool(ok_all.item()), "rows": entries}
    return rows, flat, text, data


# --------------------------------------------------------------------------- main


QUICK = "small data, few rounds (numbers are noise)"


def parse() -> argparse.Namespace:
    parser = harness_parser(__doc__, "ddp_loader", QUICK)
    parser.add_argument("--samples", type=int, default=20_000, help="parts 1-2: dataset rows")
    parser.add_argument("--rounds", type=int, default=6, help="parts 1-2: clean timed rounds")
    add_round_options(parser, 8)
    parser.add_argument("--allreduce-n", type=int, default=2000, help="all-reduces per tight loop")
    parser.add_argument("--allreduce-reps", type=int, default=5, help="tight loops (median)")
    parser.add_argument(
        "--agree-chunk", type=int, default=40, help="part 2: training steps per loop per round"
    )
    parser.add_argument("--agree-rounds", type=int, default=30, help="part 2: clean rounds")
    parser.add_argument("--resume-samples", type=int, default=200_000)
    parser.add_argument("--resume-reps", type=int, default=5)
    parser.add_argument("--parts", default="epochs,agreement,resume")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.rounds, args.max_rounds = 2048, 2, 2
        args.allreduce_n, args.allreduce_reps, args.agree_rounds = 200, 2, 3
        args.resume_samples, args.resume_reps = 20_000, 2
        args.max_foreign = float("inf")
    return args


def launch() -> int:
    """Plain run: describe the machine, then run this script on 2 ranks under torchrun."""
    start = time.perf_counter()
    args = parse()
    results = Results("ddp_loader", args.json, args)
    print("# Data-parallel training (2 ranks, gloo, CPU)\n")
    print(f"Command: `{command_line()}`\n")
    print("\n".join(environment()))
    print(
        f"- {NPROC} ranks: `torchrun --standalone --nproc-per-node={NPROC}`, "
        '`init_process_group("gloo")`, `torch.set_num_threads(1)` per rank (DataLoader '
        "workers use 1 thread each); the ranks and their workers share the cores above",
        flush=True,
    )
    # Rank 0 hands its tables and numbers back; the launcher adds the environment and wall
    # time and writes the --json results (the ranks do not know the launcher's start or command).
    rc, ranks = torchrun_script(__file__, NPROC, sys.argv[1:])
    print(load_line())
    print(f"- wall time of the whole run: {time.perf_counter() - start:.0f} s")
    if ranks is not None:  # a failed run writes no results: report.py says so
        results.tables, results.notes, results.data = ranks["tables"], ranks["notes"], ranks["data"]
        results.write()
    return rc


def rank_main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    assert dist.get_world_size() == NPROC, "run plainly, or under torchrun with 2 processes"
    monitor = ForeignLoad(launcher_pid())
    parts = args.parts.split(",")
    # For the JSON results (rank 0 writes them to PARTS_ENV's file at the end).
    kept: dict = {"tables": [], "notes": [], "data": {}}

    def keep(title: str, markdown: str) -> str:
        kept["tables"].append({"title": title, "markdown": markdown})
        return markdown

    say(
        f"- parts 1-2: {args.samples} rows of {FEATURES} floats, batch {BATCH} per rank "
        f"({BATCH * NPROC} global), {-(-args.samples // (BATCH * NPROC))} steps per epoch; "
        f"MLP {FEATURES}->256->10 in DDP, SGD(lr=0.01); a round is clean if other processes "
        f"used <= {args.max_foreign} cores during it; part 1: {args.rounds} clean rounds (at "
        f"most {args.max_rounds}), part 2: {args.agree_rounds} (at most "
        f"{2 * args.agree_rounds}); order rotated each round"
    )

    if "epochs" in parts:
        rows, notes, kept["data"]["epochs"] = epoch_part(args, monitor)
        kept["notes"] += notes
        say(
            "\n## 1. Time per epoch, DDP training\n",
            "s/epoch: the slower rank's wall time for one epoch (barrier to last step), median "
            "over rounds; ms/step: the same per step. ratio: the loader's epoch / torch's (same "
            "dataset, workers and round), median over rounds, with a bootstrap 95% interval of "
            "that median and the rounds' min-max. +us/sample: the "
            "median difference to torch per sample of a rank. data-only (num_workers=0): the "
            "same loaders iterated for an epoch without training, both ranks at once, in "
            "separate rounds before the training ones: us per sample of a rank (median), and "
            "the difference to torch's in the same round (median).\n",
            keep(
                "1. Time per epoch, DDP training (2 ranks)",
                table(
                    [
                        "dataset",
                        "workers",
                        "loader",
                        "s/epoch",
                        "ms/step",
                        "ratio vs torch",
                        "95% CI",
                        "ratio min-max",
                        "+us/sample",
                        "data-only us/sample",
                        "data-only +us/sample",
                    ],
                    rows,
                    left=3,
                ),
            ),
            "",
            *(f"- {n}" for n in notes),
        )

    if "agreement" in parts:
        alone, rows, text, n_rounds, kept["data"]["agreement"] = agreement_part(args, monitor)
        kept["notes"].append(text)
        say(
            "\n## 2. Preemption agreement: one 1-element all-reduce\n",
            f"Alone, tight loop of {args.allreduce_n} `dist.all_reduce` of a 1-element int32 "
            f"tensor (MAX), median of {args.allreduce_reps}: **{alone[0]:.1f} us** per "
            f"all-reduce blocking, {alone[1]:.1f} us with `async_op=True` + `wait()`.\n",
            "In the training loop of part 1 (plain dataset, torch DataLoader + "
            "DistributedSampler, num_workers 0), finely interleaved: each loop (own loader, own "
            f"DDP model) runs {args.agree_chunk} training steps per round, {n_rounds} rounds "
            "used, order rotated. us/step: median over rounds; ratio: the loop's time / the "
            "loop without agreement in the same round, median over rounds, bootstrap 95% "
            "interval of that median, min-max; +us/all-reduce: the "
            "median extra time over the loop without agreement / the all-reduces per round.\n",
            keep(
                "2. Preemption agreement in the training loop",
                table(
                    [
                        "agreement",
                        "all-reduces per round",
                        "us/step",
                        "ratio vs none",
                        "95% CI",
                        "min-max",
                        "+us/all-reduce",
                    ],
                    rows,
                ),
            ),
            "",
            f"- {text}",
        )

    if "resume" in parts:
        rows, flat, text, kept["data"]["resume"] = resume_part(args, monitor)
        kept["notes"].append(text)
        say(
            "\n## 3. Resume latency under DDP\n",
            f"{args.resume_samples} rows, batch {BATCH} per rank, num_workers 0, epoch 0. ms: "
            "construct + resume + first batch, the slower rank, median and min-max. "
            "x unbroken: the median over unbroken's at the same point.\n",
            keep(
                "3. Resume latency under DDP",
                table(
                    ["position", "global batches done", "method", "ms", "min-max", "x unbroken"],
                    rows,
                    left=3,
                ),
            ),
            "",
            keep(
                "3. Resume latency under DDP: flatness",
                table(["method", "99% / 1% (medians)"], flat),
            ),
            "",
            f"- {text}",
        )
    hand_back(jsonable(kept))
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        rank_main()
    else:
        sys.exit(launch())
