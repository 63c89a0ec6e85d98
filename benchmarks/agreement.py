"""What the Trainer's per-batch agreement costs under torchrun (gloo, CPU): the all-reduce of two
flags (``unbroken.train.agreement.Agreement.any_of``) against the all-gather of four float64
numbers a rank that just-in-time saves use (``unbroken.train.jit.JustInTime.agree``), and two
alternatives that carry the same numbers. A tight loop of 3,000 calls each, after 200 to warm
up, timed on rank 0.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=3 benchmarks/agreement.py
"""

import time

import torch
import torch.distributed as dist

import unbroken.distributed

unbroken.distributed.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
row = torch.tensor([0.0, 1.0, 123.0, 0.5], dtype=torch.float64)


def reduce2():
    t = torch.tensor([0, 1])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def slots_int():
    t = torch.zeros(w, 4, dtype=torch.int64)
    t[r] = row.view(torch.int64)
    dist.all_reduce(t)
    return t.view(torch.float64).tolist()


def gather_f64():  # what JustInTime.agree does
    g = [torch.empty_like(row) for _ in range(w)]
    dist.all_gather(g, row)
    return torch.stack(g).tolist()


def gather_int():
    mine = row.view(torch.int64)
    g = [torch.empty_like(mine) for _ in range(w)]
    dist.all_gather(g, mine)
    return torch.stack(g).view(torch.float64).tolist()


def reduce_f64_2():
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


for name, f in [
    ("all_reduce of 2 int64 flags (no JIT)", reduce2),
    ("all_reduce of 3x4 int64 slots", slots_int),
    ("all_gather of 4 float64 (JIT)", gather_f64),
    ("all_gather of 4 float64 as int64", gather_int),
    ("all_reduce of 2 float64", reduce_f64_2),
] * 2:
    for _ in range(200):
        f()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(3000):
        f()
    dt = (time.perf_counter() - t) / 3000 * 1e6
    if r == 0:
        print(f"{name}: {dt:.1f} us", flush=True)
assert slots_int() == [[0.0, 1.0, 123.0, 0.5]] * w
dist.destroy_process_group()
