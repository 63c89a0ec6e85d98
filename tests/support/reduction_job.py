"""Run by torchrun (gloo, 3 ranks) from test_exact_reduction.py: DDP's gradient sums with and
without ``unbroken.distributed.exact_reduce``, and a user's own DDP loop resumed from a
``Checkpointer`` by a fresh DDP model, as a restarted process would be. Rank 0 writes what it
saw to ``<out>/seen.json``; a check that fails on any rank fails the job."""

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import unbroken
import unbroken.distributed
from unbroken.distributed import InexactReduction, exact_reduce
from unbroken.distributed.reduction import _register, reduction_of

OUT = Path(sys.argv[1])
torch.set_num_threads(1)
unbroken.distributed.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()
seen = {}


def net():
    torch.manual_seed(0)  # the same weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(12, 48),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(48, 48),
        torch.nn.ReLU(),
        torch.nn.Linear(48, 4),
    )


def batch(step):
    generator = torch.Generator().manual_seed(1000 * step + RANK)  # each rank its own data
    return torch.randn(16, 12, generator=generator), torch.randint(0, 4, (16,), generator=generator)


CARRY = 5  # bytes a backward carries in the carrying runs


def row(step):
    """What each rank carries: a flag every rank sets, and one byte of its own."""
    out = torch.zeros(CARRY, dtype=torch.uint8)
    out[0], out[1 + RANK] = 1, (step * 10 + RANK) % 256
    return out


def carried_right(model, step):
    sums = reduction_of(model).carried()
    expected = torch.tensor([WORLD] + [(step * 10 + r) % 256 for r in range(WORLD)] + [0])
    return sums is not None and torch.equal(sums, expected[:CARRY].to(torch.uint8))


def gradients(model, step, iterations, carry=False, divide=1):
    """The reduced gradients of one batch, computed ``iterations`` times (DDP rebuilds its
    buckets after the first), each from the same weights and the same dropout draws; the loss
    divided by ``divide`` (the world size, for a predivided reduction)."""
    out = []
    for _ in range(iterations):
        torch.manual_seed(step * 7 + RANK)
        x, y = batch(step)
        if carry:
            reduction_of(model).carry(row(step))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (loss / divide if divide > 1 else loss).backward()
        assert not carry or carried_right(model, step), "the carried row is not its sum"
        out.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return out


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# 1. One batch's gradients: the same in the first and in the rebuilt layout, with exact_reduce;
# and what the documented reduction gives, computed here without DDP: the gradients in the
# order the backward makes them (the Sequential's parameters from its end), cut where DDP cuts
# its rebuilt buckets, each chunk flattened, divided by the world size and all-reduced. With
# bucket_cap_mb=25 everything is one chunk; with 0.002 (2,097 bytes a bucket) the last two
# layers' 10,192 bytes reach the limit: [5, 4, 3, 2] and [1, 0]. From the second backward on,
# every bucket is a chunk: no copy.
alone = net()
torch.manual_seed(7 * 0 + RANK)
x, y = batch(0)
torch.nn.functional.cross_entropy(alone(x), y).backward()
local = [p.grad for p in alone.parameters()]
for cap, chunks in ((25, [[5, 4, 3, 2, 1, 0]]), (0.002, [[5, 4, 3, 2], [1, 0]])):
    model = exact_reduce(DDP(net(), bucket_cap_mb=cap))
    first, rebuilt, steady = gradients(model, 0, 3)
    assert same(first, rebuilt) and same(rebuilt, steady), f"cap {cap}: depends on the layout"
    assert reduction_of(model).copied == 1, "the rebuilt buckets are not the chunks"
    reference = [None] * len(local)
    for chunk in chunks:
        flat = torch.cat([local[i].reshape(-1) for i in chunk]) / WORLD
        dist.all_reduce(flat)
        for i, part in zip(chunk, torch.split(flat, [local[i].numel() for i in chunk])):
            reference[i] = part.view_as(local[i])
    assert same(first, reference), f"cap {cap}: not the chunked sum"
# The mean of the ranks' gradients, gathered and averaged in rank order: close, not equal.
flat = torch.cat([g.reshape(-1) for g in local])
gathered = [torch.zeros_like(flat) for _ in range(WORLD)]
dist.all_gather(gathered, flat)
mean = torch.stack(gathered).sum(0) / WORLD
assert torch.allclose(torch.cat([g.reshape(-1) for g in first]), mean, atol=1e-6)
# Carrying a row: it rides at the end of the smallest chunk ([1, 0] at 0.002; the only one at
# 25) in every layout, so the sums are again one, and equal to that packed chunked sum.
for cap, chunks, target in ((25, [[5, 4, 3, 2, 1, 0]], 0), (0.002, [[5, 4, 3, 2], [1, 0]], 1)):
    model = _register(DDP(net(), bucket_cap_mb=cap), carry_bytes=CARRY)
    first, rebuilt, steady = gradients(model, 0, 3, carry=True)
    assert same(first, rebuilt) and same(rebuilt, steady), f"cap {cap}: carrying depends on it"
    assert reduction_of(model).copied == 1 and reduction_of(model).target == target
    # A row carried but not read, then a backward that carries nothing (its zeros overwrite the
    # reused buffer): no sum to read, rather than that backward's zeros as the row's.
    reduction_of(model).carry(row(1))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    gradients(model, 0, 1)
    assert reduction_of(model).carried() is None, "a backward without a row left a sum"
    reference = [None] * len(local)
    for index, chunk in enumerate(chunks):
        flat = torch.cat([local[i].reshape(-1) for i in chunk]) / WORLD
        if index == target:
            flat = torch.cat([flat, row(0).to(flat.dtype)])
        dist.all_reduce(flat)
        sizes = [local[i].numel() for i in chunk]
        for i, part in zip(chunk, torch.split(flat[: sum(sizes)], sizes)):
            reference[i] = part.view_as(local[i])
    assert same(first, reference), f"cap {cap}: not the packed chunked sum"
    seen[f"carrying cap {cap} differs from not carrying"] = not same(
        first, gradients(exact_reduce(DDP(net(), bucket_cap_mb=cap)), 0, 1)[0]
    )
# Predivided (the Trainer's way without accumulation): each rank's loss divided by the world
# size, and the hook only sums, with the row carried. One result in every layout, equal to the
# packed chunked sum of those gradients with no division, and close to the ranks' mean.
alone = net()
torch.manual_seed(7 * 0 + RANK)
(torch.nn.functional.cross_entropy(alone(x), y) / WORLD).backward()
shares = [p.grad for p in alone.parameters()]
for cap, chunks, target in ((25, [[5, 4, 3, 2, 1, 0]], 0), (0.002, [[5, 4, 3, 2], [1, 0]], 1)):
    model = _register(DDP(net(), bucket_cap_mb=cap), carry_bytes=CARRY)
    reduction_of(model).predivided = True
    first, rebuilt, steady = gradients(model, 0, 3, carry=True, divide=WORLD)
    assert same(first, rebuilt) and same(rebuilt, steady), f"cap {cap}: predivided depends on it"
    reference = [None] * len(shares)
    for index, chunk in enumerate(chunks):
        flat = torch.cat([shares[i].reshape(-1) for i in chunk])
        if index == target:
            flat = torch.cat([flat, row(0).to(flat.dtype)])
        dist.all_reduce(flat)
        sizes = [shares[i].numel() for i in chunk]
        for i, part in zip(chunk, torch.split(flat[: sum(sizes)], sizes)):
            reference[i] = part.view_as(shares[i])
    assert same(first, reference), f"cap {cap}: predivided is not the packed chunked sum"
    whole = torch.cat([g.reshape(-1) for g in first])
    assert torch.allclose(whole, mean, atol=1e-6), f"cap {cap}: predivided is not the mean"
# Without it, DDP's own layouts give other sums: the hazard the hook removes.
stock = gradients(DDP(net(), bucket_cap_mb=0.002), 0, 2)
seen["stock layouts differ"] = not same(stock[0], stock[1])


# 2. A user's own loop, saving every 4 steps; "restarted" after step 6 by a fresh DDP model (a
# new process's layout) that loads the newest checkpoint (step 4) and trains on. DDP made with
# find_unused_parameters=True never rebuilds its buckets: exact without the hook, and not warned.
def train(wrap, directory, steps, resume=False, **ddp):
    model = wrap(DDP(net(), **ddp))
    carry = reduction_of(model) is not None and reduction_of(model).carry_bytes > 0
    divide = WORLD if carry and reduction_of(model).predivided else 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpointer = unbroken.Checkpointer(directory, keep=2)
    state = {"model": model, "optimizer": optimizer}
    start = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if resume:
            start = checkpointer.load_latest(state).step
    inexact = [w for w in caught if issubclass(w.category, InexactReduction)]
    for step in range(start, steps):
        torch.manual_seed(step * 7 + RANK)
        x, y = batch(step)
        if carry:
            reduction_of(model).carry(row(step))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (loss / divide if divide > 1 else loss).backward()
        assert not carry or carried_right(model, step), "the carried row is not its sum"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 4 == 0:
            checkpointer.save(step + 1, state)
    checkpointer.close()
    return [p.detach().clone() for p in model.parameters()], len(inexact)


def as_made(model):
    return model


def carrying(model):
    return _register(model, carry_bytes=CARRY)


def predividing(model):
    carrying(model)
    reduction_of(model).predivided = True
    return model


for name, wrap, ddp in (
    ("exact", exact_reduce, {}),
    ("carrying", carrying, {"bucket_cap_mb": 0.002}),
    ("predivided", predividing, {"bucket_cap_mb": 0.002}),
    ("stock", as_made, {}),
    ("unused", as_made, {"find_unused_parameters": True}),
):
    whole, _ = train(wrap, OUT / f"{name}-whole", 10, **ddp)
    train(wrap, OUT / f"{name}-cut", 6, **ddp)  # the "killed" run: its newest checkpoint is step 4
    resumed, warned = train(wrap, OUT / f"{name}-cut", 10, resume=True, **ddp)
    seen[f"{name} resumed equal"] = same(whole, resumed)
    seen[f"{name} warned"] = warned
    seen[f"{name} max diff"] = max((a - b).abs().max().item() for a, b in zip(whole, resumed))


# 2b. A user's loop accumulating under no_sync: a window's first backwards reduce nothing (no
# hook call), and the chunks come from the first reduced backward's order alone. A process
# whose first backward is reduced (one resumed at a window's last batch) learns the same
# chunks, and from then on DDP's buckets are the chunks: no copy.
def chunk_indices(model):
    index = {id(p): i for i, p in enumerate(model.module.parameters())}
    return [[index[id(p)] for p in chunk] for chunk in reduction_of(model).chunks]


quiet_first = exact_reduce(DDP(net(), bucket_cap_mb=0.002))
reduced_first = exact_reduce(DDP(net(), bucket_cap_mb=0.002))
for step in range(3):
    x, y = batch(step)
    for model, accumulates in ((quiet_first, True), (reduced_first, step > 0)):
        if accumulates:
            with model.no_sync():
                torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
seen["no_sync first: chunks"] = chunk_indices(quiet_first)
seen["reduced first: chunks"] = chunk_indices(reduced_first)
seen["no_sync first: copies"] = reduction_of(quiet_first).copied


# 3. The Trainer's DDP step: one optimizer step of SGD (lr 1) moves the weights by the ranks'
# mean gradient, with and without accumulation (its reduction sums loss-divided gradients in
# the first case, divides them itself in the second).
def recording(got):
    def step(model, batch):
        got.append(batch.clone())
        return model(batch).square().mean()

    return step


for accumulate in (1, 2):
    got = []
    step = recording(got)

    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 3)
    start = [p.detach().clone() for p in linear.parameters()]
    model = DDP(linear)
    data = torch.randn(48, 6, generator=torch.Generator().manual_seed(3))
    loader = unbroken.DataLoader(data, batch_size=4, shuffle=True, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unbroken.Trainer(
            OUT / f"trainer-{accumulate}",
            max_epochs=1,
            max_steps=1,
            accumulate=accumulate,
            progress_bar=False,
        ).fit(model, torch.optim.SGD(model.parameters(), lr=1.0), loader, training_step=step)
    assert len(got) == accumulate
    fresh = torch.nn.Linear(6, 3)
    with torch.no_grad():
        for p, value in zip(fresh.parameters(), start):
            p.copy_(value)
    for batch in got:
        (fresh(batch).square().mean() / accumulate).backward()
    local = torch.cat([p.grad.reshape(-1) for p in fresh.parameters()])
    gathered = [torch.zeros_like(local) for _ in range(WORLD)]
    dist.all_gather(gathered, local)
    expected = torch.cat([v.reshape(-1) for v in start]) - torch.stack(gathered).sum(0) / WORLD
    trained = torch.cat([p.detach().reshape(-1) for p in linear.parameters()])
    assert torch.allclose(trained, expected, atol=1e-6), (
        f"accumulate {accumulate}: the Trainer's step is not the ranks' mean gradient"
    )
    seen[f"trainer step {accumulate} is the mean"] = True

# 4. A model with a hook of its own cannot take exact_reduce: refused with the reason.
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402

hooked = DDP(net())
hooked.register_comm_hook(None, allreduce_hook)
try:
    exact_reduce(hooked)
    seen["second hook"] = "accepted"
except RuntimeError as error:
    seen["second hook"] = str(error)

if RANK == 0:
    (OUT / "seen.json").write_text(json.dumps(seen))
dist.destroy_process_group()
