"""Run by torchrun (gloo, 2 ranks) from test_distributed_checkpoint.py: the Checkpointer's
collective protocol, one scenario after another in one process group (a torchrun start costs
seconds). Each scenario writes what every rank saw to <out>/<scenario>.rank<r>.json, and the
test checks it; a scenario that raises where it should not fails the job."""

import json
import os
import pickle
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import unbroken
import unbroken.distributed
from unbroken import PerRank
from unbroken.errors import DirectoryNotShared, RankFailure

OUT = Path(sys.argv[1])
unbroken.distributed.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()


def report(scenario, **seen):
    (OUT / f"{scenario}.rank{RANK}.json").write_text(json.dumps(seen))


def outcome(call):
    """What ``call`` raised, as (type name, message), or ("ok", its result)."""
    try:
        return "ok", call()
    except Exception as error:
        return type(error).__name__, str(error)


class Counter:
    """A stateful object whose state differs per rank."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def state(value):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)  # the same on every rank: replicated
    return {"model": model, "counter": PerRank(Counter(value)), "step": value // 100}


shared = OUT / "shared"

# 1. Saves: replicated entries once, PerRank ones per rank; each rank loads its own part.
checkpointer = unbroken.Checkpointer(shared, keep=3)
for step in (1, 2, 3):
    checkpointer.save(step, state(100 * step + RANK))
loaded = state(-1)
restored = checkpointer.load_latest(loaded)
report(
    "same_world",
    step=restored.step,
    world_size=restored.world_size,
    counter=loaded["counter"].obj.value,
    values=restored.values,
    files=sorted(p.name for p in (shared / "step-000000003").iterdir()),
)

# 2. A rank's part corrupt in the newest checkpoint, missing in the next: every rank skips both
# and loads step 1, the same step everywhere, though rank 0's own files are fine.
dist.barrier()
if RANK == 0:
    part = next((shared / "step-000000003").glob("*counter.rank-00001.pt"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    next((shared / "step-000000002").glob("*counter.rank-00001.pt")).unlink()
dist.barrier()
loaded = state(-1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    restored = checkpointer.load_latest(loaded)
report(
    "skip",
    step=restored.step,
    counter=loaded["counter"].obj.value,
    warnings=[str(w.message) for w in caught],
)

# 3. A failure on one rank fails the save on every rank and commits nothing.
bad = state(400 + RANK)
if RANK == 1:
    bad["counter"] = PerRank(torch.empty(2, device="meta"))  # cannot be saved
report("one_rank_fails", error=outcome(lambda: str(checkpointer.save(4, bad))))

# 4. Ranks that disagree on the step are refused on every rank.
report("other_steps", error=outcome(lambda: str(checkpointer.save(5 + RANK, state(500)))))
report("after_failures", steps=sorted(p.name for p in shared.iterdir() if p.name[0] != "."))

# 5. A background save commits on every rank once wait() returns.
checkpointer.save(6, state(600 + RANK), blocking=False)
checkpointer.wait()
loaded = state(-1)
report(
    "background", step=checkpointer.load_latest(loaded).step, counter=loaded["counter"].obj.value
)

# 5b. What the ranks exchange to agree is small (verdicts, digests), never the state itself.
from unbroken.checkpoint.group import CheckpointGroup  # noqa: E402

sizes = []
gather = CheckpointGroup._all_gather


def measured(self, value, phase):
    sizes.append(len(pickle.dumps(value)))
    return gather(self, value, phase)


exchange = unbroken.Checkpointer(OUT / "exchange")
CheckpointGroup._all_gather = measured
big = {"big": torch.zeros(1 << 20), "counter": PerRank(Counter(RANK))}  # 4 MB replicated
exchange.save(7, big)
exchange.load_latest(big)
CheckpointGroup._all_gather = gather
report("exchanged", largest=max(sizes), count=len(sizes))

# 6. Each rank its own directory: refused on every rank when the Checkpointer is made.
report(
    "not_shared", error=outcome(lambda: str(unbroken.Checkpointer(OUT / f"local{RANK}").directory))
)

# 7. An FSDP2 model and its optimizer, sharded over the ranks, saved through DCP (Sharded);
# reloaded here after a change, and in one process by the test (2 -> 1 resharding).
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


def fsdp():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=0.01)


net, adam = fsdp()
for _ in range(3):
    net(torch.randn(4, 6, generator=torch.Generator().manual_seed(RANK))).square().sum().backward()
    adam.step()
    adam.zero_grad()
full = StateDictOptions(full_state_dict=True)
model_full = get_model_state_dict(net, options=full)
optim_full = get_optimizer_state_dict(net, adam, options=full)
dcp_dir = OUT / "fsdp"
sharded = unbroken.Checkpointer(dcp_dir)
sharded.save(3, {"net": unbroken.Sharded(net, adam), "note": "fsdp"})
if RANK == 0:
    torch.save({"model": model_full, "optim": optim_full}, OUT / "fsdp_full.pt")
fresh, fresh_adam = fsdp()  # other weights until loaded: the same seed, but no steps taken
restored = sharded.load_latest({"net": unbroken.Sharded(fresh, fresh_adam)})
again = get_model_state_dict(fresh, options=full)
report(
    "fsdp",
    step=restored.step,
    equal=all(torch.equal(again[k], model_full[k]) for k in model_full),
    local=[type(p).__name__ for p in fresh.parameters()][:1],
    shards=json.loads((dcp_dir / "step-000000003" / "manifest.json").read_text())["entries"]["net"],
)

# 7b. The same, in object storage (the suite's S3 server): every rank uploads its own DCP
# shard and its PerRank part, rank 0 commits with the manifest; a fresh pair of objects loads.
remote = unbroken.Checkpointer(
    os.environ["UNBROKEN_TEST_S3_URL"],
    storage_options=json.loads(os.environ["UNBROKEN_TEST_S3_OPTIONS"]),
)
remote.save(3, {"net": unbroken.Sharded(net, adam), "counter": PerRank(Counter(RANK + 70))})
fresh, fresh_adam = fsdp()
counter = Counter(-1)
restored = remote.load_latest(
    {"net": unbroken.Sharded(fresh, fresh_adam), "counter": PerRank(counter)}
)
again = get_model_state_dict(fresh, options=full)
report(
    "fsdp_s3",
    step=restored.step,
    equal=all(torch.equal(again[k], model_full[k]) for k in model_full),
    counter=counter.value,
    sent=remote._storage.sent,
)

# 8. A rank that does not come: a RankFailure after the timeout, not a hang.
late = unbroken.Checkpointer(OUT / "late", timeout=3)
if RANK == 0:
    report("timeout", error=outcome(lambda: late.load_latest({"model": state(0)["model"]})))
else:
    report("timeout", error=["absent", ""])
dist.barrier()  # the default group: rank 1 waits here while rank 0 times out
dist.destroy_process_group()
assert RankFailure and DirectoryNotShared  # the types the test expects by name
