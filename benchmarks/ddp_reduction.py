"""What ``exact_reduce`` costs a DDP step on 3, 4 and 5 ranks (torchrun, gloo, CPU), against
DDP's own bucketed all-reduce of the same model in the same processes.

How it measures, and what the numbers mean: ``docs/benchmarks/ddp-reduction.md``.

    .venv/bin/python benchmarks/ddp_reduction.py              # ~5 minutes on 2 cores
    .venv/bin/python benchmarks/ddp_reduction.py --ranks 3    # one world size, ~1 minute
    .venv/bin/python benchmarks/ddp_reduction.py --quick      # smoke run: few steps (noise)
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, environment, load_line
from harness import parser as harness_parser
from harness.jobs import parse_or_work, send_back, torchrun_worker

import unbroken.distributed
from unbroken.distributed import exact_reduce
from unbroken.distributed.reduction import reduction_of

RANKS = (3, 4, 5)  # exact_reduce matters from 3 ranks on (the docs say why)
STOCK, TORCH_HOOK = "DDP (stock)", "DDP + torch's allreduce_hook"
EXACT, PREDIVIDED = "DDP + exact_reduce", "DDP + exact_reduce, predivided"
UNUSED = "DDP, find_unused_parameters=True"
# torch's own Python hook (torch.distributed.algorithms.ddp_comm_hooks) is the control: what
# any Python communication hook costs against DDP's C++ path. "predivided" is the Trainer's
# way: the loss divided by the world size, the hook only sums (ExactReduction.predivided).
# find_unused_parameters=True is the one public way to exactness without a hook: DDP then
# never rebuilds its buckets, so every step of every process sums in one layout; it pays a
# walk of the autograd graph and an all-reduce of the used parameters' map every step.
VARIANTS = (STOCK, TORCH_HOOK, EXACT, PREDIVIDED, UNUSED)
# An exact_reduce with chunk_mb cuts its own chunks; one without keeps DDP's buckets. The
# script measures either.
HAS_CHUNK_MB = "chunk_mb" in inspect.signature(exact_reduce).parameters


def build(
    layers: int, width: int, variant: str, chunk_mb: float, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    ids = [device.index] if device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*blocks).to(device),
        device_ids=ids,
        find_unused_parameters=variant == UNUSED,
    )
    if variant == TORCH_HOOK:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    elif variant in (EXACT, PREDIVIDED):
        exact_reduce(model, **({"chunk_mb": chunk_mb} if HAS_CHUNK_MB else {}))
        if variant == PREDIVIDED:
            reduction = reduction_of(model)
            assert reduction is not None and hasattr(reduction, "predivided")
            reduction.predivided = True
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    # A step's time is the device's: wait for its kernels (a no-op on CPU).
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    unbroken.distributed.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = {"small": 2, "large": args.layers}
    times: dict[str, list[float]] = {}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    x = x.to(device)
    for size, layers in sizes.items():
        built = {name: build(layers, args.width, name, args.chunk_mb, device) for name in VARIANTS}
        # The predivided variant's loss carries the 1 / world size its hook leaves out.
        divisor = {name: world if name == PREDIVIDED else 1 for name in VARIANTS}
        for name, (model, optimizer) in built.items():  # warm-up: DDP rebuilds its buckets here
            for _ in range(2):
                (model(x).square().mean() / divisor[name]).backward()
                optimizer.step()
                optimizer.zero_grad()
        for round_ in range(args.rounds):
            shift = round_ % len(VARIANTS)  # each variant first in turn
            for name in VARIANTS[shift:] + VARIANTS[:shift]:
                model, optimizer = built[name]
                dist.barrier()
                sync()
                for _ in range(args.steps):
                    start = time.perf_counter()
                    (model(x).square().mean() / divisor[name]).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    sync()
                    times.setdefault(f"{size}|{name}", []).append(time.perf_counter() - start)
        built.clear()
    send_back(args, times)


QUICK = "2 rounds of 3 steps"


def main() -> None:
    parser = harness_parser(__doc__, "ddp_reduction", QUICK)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--chunk-mb",
        type=float,
        default=25.0,
        help="exact_reduce's chunk_mb, where it has one (else DDP's buckets are its chunks)",
    )
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=list(RANKS), help="world sizes, one job each"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", default="", help="default: gloo on cpu, nccl on cuda")
    args = parse_or_work(parser, worker)
    if args is None:
        return
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.quick:
        args.steps, args.rounds = 3, 2
    results = Results("ddp_reduction", args.json, args)
    print("\n".join(environment()), flush=True)
    flags = ("layers", "width", "batch", "steps", "rounds", "chunk_mb", "device", "backend")
    measured = {ranks: torchrun_worker(__file__, ranks, args, *flags) for ranks in args.ranks}
    print(load_line())
    rows = []
    medians: dict[int, dict[str, dict[str, float]]] = {}
    for ranks, times in measured.items():
        for size, layers in (("small", 2), ("large", args.layers)):
            parameters = layers * (args.width * args.width + args.width)
            step = {name: statistics.median(times[f"{size}|{name}"]) * 1e3 for name in VARIANTS}
            medians.setdefault(ranks, {})[size] = step
            rows.append(
                [
                    str(ranks),
                    f"{layers} x Linear({args.width}, {args.width}) ({parameters * 4 / 1e6:.0f} MB)",
                    *(f"{step[name]:.1f}" for name in VARIANTS),
                    f"{step[EXACT] / step[STOCK]:.2f}x",
                    f"{step[PREDIVIDED] / step[STOCK]:.2f}x",
                    f"{step[PREDIVIDED] / step[TORCH_HOOK]:.2f}x",
                    f"{step[UNUSED] / step[STOCK]:.2f}x",
                ]
            )
    print()
    worlds = ", ".join(map(str, args.ranks))
    title = f"A DDP training step on {worlds} ranks ({args.backend}, {args.device}), ms (medians)"
    results.show(title, [
        "ranks", "model", "DDP (ms)", "torch's hook (ms)", "exact_reduce (ms)",
        "predivided (ms)", "find_unused (ms)", "exact / stock", "predivided / stock",
        "predivided / torch's hook", "find_unused / stock",
    ], rows, left=2)  # fmt: skip
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    note = (
        f"medians of {args.rounds} rounds x {args.steps} steps per variant, batch {args.batch} "
        f"per rank, 1 thread per rank on {cores} cores; "
        + (f"exact_reduce chunk_mb={args.chunk_mb}; " if HAS_CHUNK_MB else "")
        + "command: .venv/bin/python "
        f"benchmarks/ddp_reduction.py --ranks {' '.join(map(str, args.ranks))}"
        + "".join(
            f" --{flag.replace('_', '-')} {getattr(args, flag)}"
            for flag in ("layers", "width", "batch", "steps", "rounds", "chunk_mb", "device")
            if getattr(args, flag) != parser.get_default(flag) and not args.quick
        )
    )
    print(f"\n{note}")
    results.notes.append(note)
    results.data = {"median_ms": medians, "times_s": measured, "ranks": args.ranks}
    results.write()


if __name__ == "__main__":
    main()
