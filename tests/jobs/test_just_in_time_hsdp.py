"""Just-in-time saves of an HSDP model (``train.jit_shards``): when a rank dies, one survivor
holding each shard writes it through DCP, and the restarted job ends bit for bit as the
uninterrupted one, having lost at most the step in flight.

The job is tests/support/ddp_job.py on 4 ranks (gloo, CPU), its model ``fully_shard``-ed over a 2x2 mesh
(replicas {0, 1} and {2, 3}, each holding shards 0 and 1), one epoch without the torchmetrics
accuracy, a validation loader and a log row every 5 batches: ticks 1-15 train, 16-18 validate;
a periodic checkpoint every 5 optimizer steps (ticks 5, 10, 15) and at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from locations import SUPPORT

import unbroken
from unbroken.checkpoint import Checkpointer, PerRank, Sharded

JOB = SUPPORT / "ddp_job.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
HSDP = {"hsdp": True, "metrics": False, "log_every": 5, "val": True, "epochs": 1}


def torchrun(run, options, restarts=0):
    result = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node=4", f"--max-restarts={restarts}"]
        + [str(JOB), str(run), json.dumps({**HSDP, **options})],
        capture_output=True,
        text=True,
        timeout=400,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    return output


def ticks(pattern, output):
    return [int(tick) for tick in re.findall(pattern, output)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("hsdp") / "reference"
    torchrun(run, {})
    return run


def test_a_rank_killed_anywhere_in_an_hsdp_job_costs_at_most_the_step_in_flight(
    reference, tmp_path
):
    """Three failures, each saved just in time at the last completed step, by the survivors:

    - rank 3 killed after tick 7 (a step ended): rank 1 is the only survivor holding shard 1;
      shard 0 lives on ranks 0 and 2, and one of them writes it;
    - rank 0 (the log's writer) killed inside training tick 12, the others waiting in its
      collectives: saved at tick 11, the log's size read from the file rank 0 left;
    - rank 1 killed inside validation tick 17: rank 3, the only survivor holding shard 1, may
      stay blocked in the batch's gather with a survivor that left it to write shard 0, until
      the process group's timeout (10 s); then it writes shard 1: saved at tick 16.
    """
    run = tmp_path / "run"
    options = {
        "pg_timeout": 10,
        "kill": {"rank": 3, "at": [7]},
        "kill_in_step": [
            {"rank": 0, "phase": "train", "at": 12},
            {"rank": 1, "phase": "val", "at": 17},
        ],
    }
    output = torchrun(run, options, restarts=3)
    assert output.count("exitcode: -9") == 3, output[-3000:]
    saved = [7, 11, 16]
    assert ticks(r"resumed from checkpoint \S+/step-(\d+)", output) == saved, output[-3000:]
    assert "just-in-time saves are off" not in output, output[-3000:]
    assert "no just-in-time save" not in output, output[-3000:]
    assert ticks(r"just in time: \S+/step-(\d+)", output) == saved, output[-3000:]
    # Shard 1's writer, for the holder of shard 0: at ticks 7 and 16 its only survivor.
    found = re.findall(r"rank (\d) wrote shard 1 of 2 of step-0*(\d+)", output)
    assert [tick for _, tick in found] == ["7", "11", "16"], output[-3000:]
    assert found[0][0] == "1" and found[2][0] == "3", output[-3000:]
    ours = torch.load(run / "final.pt", weights_only=True)  # the gathered full state dict
    theirs = torch.load(reference / "final.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert (run / "metrics.csv").read_bytes() == (reference / "metrics.csv").read_bytes()
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_shards_staged_by_their_holders_are_sealed_with_the_rest_by_one_process(tmp_path):
    """The Checkpointer's part (in one process: DCP without a group): the shards written into
    a staged directory, then the rest and the seal; a failure before the seal removes it."""
    from unbroken.checkpoint.writing import Staged

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    checkpointer = Checkpointer(tmp_path)
    entry = Sharded(model, optimizer)
    tmp = checkpointer.stage_alone(4)
    part = checkpointer.write_shards(tmp, 1, "model", entry, None, 0)
    order = {"progress": 0, "model": 1, "log": 2}
    staged = Staged(tmp, {"model": part}, order)
    path = checkpointer.save_alone(4, {"log": {"bytes": 9}}, {"progress": [1, 2]}, staged)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert manifest["entries"]["model"]["dcp"] == "001-model.dcp"
    files = ["001-model.dcp/.metadata", "001-model.dcp/__0_0.distcp"]
    assert sorted(file for file, _ in part.files) == manifest["entries"]["model"]["shards"] == files
    state = {"model": Sharded(torch.nn.Linear(3, 2)), "progress": PerRank(0, resize="rank0")}
    state["model"].optimizers = [torch.optim.SGD(state["model"].model.parameters(), lr=0.1)]
    restored = checkpointer.load_latest(state)
    assert restored is not None and restored.step == 4
    assert torch.equal(state["model"].model.weight, model.weight)
    # Staged, then abandoned: nothing is left to be resumed from, or in the way.
    tmp = checkpointer.stage_alone(5)
    checkpointer.write_shards(tmp, 1, "model", entry, None, 0)
    checkpointer.abandon(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(path).name]


def test_a_model_sharded_with_no_replica_keeps_just_in_time_saves_off(monkeypatch):
    from test_just_in_time import fsdp2_entries

    from unbroken.train import jit

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    loader = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4)), batch_size=2)
    entries = fsdp2_entries(loader)  # fully_shard over a 1-D mesh: pure FSDP2
    assert "sharded (FSDP2) with no replica of its shards" in jit.off_because(entries, 1)
