"""Checkpoints of a 2-rank job (torchrun, gloo, CPU): how long a save blocks the loop, how long
until it is committed, and how long a load takes, for a DDP model (rank 0 writes the replicated
model and optimizer once) against an FSDP2 model through DCP (``unbroken.Sharded``: every rank
writes its shards), blocking and in the background.

How it measures, and what the numbers mean: ``docs/benchmarks/ddp-checkpoint.md``.

    .venv/bin/python benchmarks/ddp_checkpoint.py             # ~1 minute on 2 cores
    .venv/bin/python benchmarks/ddp_checkpoint.py --quick     # smoke run: 2 layers, 2 rounds
"""

from __future__ import annotations

import argparse
import shutil
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

import unbroken
import unbroken.distributed

WIDTH = 1024


def build(layers: int, fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            fully_shard(layer, mesh=mesh)
        model: torch.nn.Module = fully_shard(net, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    entry = unbroken.Sharded(model, optimizer) if fsdp else None
    return model, optimizer, entry


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    unbroken.distributed.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, list[float]] = {}
    variants = [("DDP (rank 0 writes)", False), ("FSDP2 through DCP (Sharded)", True)]
    built = {fsdp: build(args.layers, fsdp) for _, fsdp in variants}
    for round_ in range(args.reps):
        order = variants if round_ % 2 == 0 else variants[::-1]
        for name, fsdp in order:
            model, optimizer, entry = built[fsdp]
            state = {"model": entry} if fsdp else {"model": model, "optimizer": optimizer}
            root = Path(args.out) / f"r{round_}-{int(fsdp)}"
            checkpointer = unbroken.Checkpointer(root)
            dist.barrier()
            start = time.perf_counter()
            checkpointer.save(1, state)
            results.setdefault(f"{name}|sync", []).append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            checkpointer.save(2, state, blocking=False)
            returned = time.perf_counter() - start
            checkpointer.wait()
            results.setdefault(f"{name}|async returns", []).append(returned)
            results.setdefault(f"{name}|async committed", []).append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            checkpointer.load_latest(state)
            dist.barrier()
            results.setdefault(f"{name}|load", []).append(time.perf_counter() - start)
            if rank == 0:
                shutil.rmtree(root)
    # The models before their process group: DDP torn down after it may abort the exit.
    built.clear()
    del model, optimizer, state, entry
    send_back(args, results)


QUICK = "2 layers, 2 rounds (numbers are noise)"


def main() -> None:
    parser = harness_parser(__doc__, "ddp_checkpoint", QUICK)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parse_or_work(parser, worker)
    if args is None:
        return
    if args.quick:
        args.layers, args.reps = 2, 2
    results = Results("ddp_checkpoint", args.json, args)
    measured = torchrun_worker(__file__, 2, args, "layers", "reps")
    megabytes = args.layers * (WIDTH * WIDTH + WIDTH) * 4 * 3 / 1e6
    print("\n".join(environment()))
    print(f"\nstate: {args.layers} x Linear({WIDTH}, {WIDTH}) + AdamW: {megabytes:.0f} MB")
    print(load_line())
    rows, medians_ms = [], {}
    for name in ("DDP (rank 0 writes)", "FSDP2 through DCP (Sharded)"):
        medians = {
            k: statistics.median(measured[f"{name}|{k}"]) * 1e3
            for k in ("sync", "async returns", "async committed", "load")
        }
        medians_ms[name] = medians
        rows.append([name] + [f"{medians[k]:.0f}" for k in medians])
    print()
    results.show("Checkpoints of a 2-rank job, ms (medians)", [
        "2 ranks, gloo", "save blocking (ms)", "async: loop blocked (ms)", "async: committed (ms)",
        "load_latest (ms)",
    ], rows)  # fmt: skip
    print(
        f"\nmedians of {args.reps} rounds; command: .venv/bin/python benchmarks/ddp_checkpoint.py"
    )
    results.data = {
        "layers": args.layers,
        "megabytes": megabytes,
        "reps": args.reps,
        # per variant: sync = save(blocking=True); async returns / async committed =
        # save(blocking=False) until it returns / until wait() returns; load = load_latest
        "median_ms": medians_ms,
        "times_s": measured,
    }
    results.write()


if __name__ == "__main__":
    main()
