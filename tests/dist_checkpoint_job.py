"""Run by torchrun (gloo, 2 ranks) from test_distributed_checkpoint.py: the Checkpointer's
collective protocol, one scenario after another in one process group (a torchrun start costs
seconds). Each scenario writes what every rank saw to <out>/<scenario>.rank<r>.json, and the
test checks it; a scenario that raises where it should not fails the job."""

import json
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

# 6. Each rank its own directory: refused on every rank when the Checkpointer is made.
report(
    "not_shared", error=outcome(lambda: str(unbroken.Checkpointer(OUT / f"local{RANK}").directory))
)

# 7. A rank that does not come: a RankFailure after the timeout, not a hang.
late = unbroken.Checkpointer(OUT / "late", timeout=3)
if RANK == 0:
    report("timeout", error=outcome(lambda: late.load_latest({"model": state(0)["model"]})))
else:
    report("timeout", error=["absent", ""])
dist.barrier()  # the default group: rank 1 waits here while rank 0 times out
dist.destroy_process_group()
assert RankFailure and DirectoryNotShared  # the types the test expects by name
