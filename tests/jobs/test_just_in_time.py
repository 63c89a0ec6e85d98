"""Just-in-time saves (``train.jit``): when a rank of a torchrun job dies or hangs, a survivor
saves the whole job as of the last completed step, and the restarted job ends bit for bit as
the uninterrupted one, having lost at most the step in flight.

The job is tests/support/ddp_job.py on 3 ranks (gloo, CPU) without its torchmetrics accuracy (a
survivor cannot know another rank's metric state), with a validation loader and a log row every
5 batches. Epoch 0 is ticks 1-20 (training) and 21-24 (validation), epoch 1 ticks 25-44 and
45-48; a periodic checkpoint every 5 optimizer steps (ticks 5, 10, 15, 20, 29, 34, 39, 44).
The unit tests below check the parts: the per-step seeds, the survivor's save of every rank's
files, the log size read after rank 0 died, and when just-in-time saves are off.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from locations import SUPPORT

import unbroken
from unbroken.checkpoint import Checkpointer, PerRank, Sharded
from unbroken.distributed.world import World
from unbroken.train import jit
from unbroken.train.checkpointing import checkpoint_entries
from unbroken.train.csvlog import LossRow, RunLog
from unbroken.train.globalrng import TRAIN, VAL, seed_step
from unbroken.train.progress import Progress, TrainerConfig
from unbroken.train.rundir import RunDirectory

JOB = SUPPORT / "ddp_job.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
BASE = {"metrics": False, "log_every": 5, "val": True}


def torchrun(run, options, restarts=0, timeout=300):
    """The job on 3 ranks; its output. A job still running after ``timeout`` seconds fails the
    test, once torchrun has stopped its ranks (SIGTERM lets it: a SIGKILL would leave them)."""
    job = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc-per-node=3", f"--max-restarts={restarts}"]
        + [str(JOB), str(run), json.dumps({**BASE, **options})],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.terminate()  # torchrun stops its ranks: SIGTERM, then SIGKILL 30 s later
        output, _ = job.communicate(timeout=60)
        pytest.fail(f"the job ran for more than {timeout} s:\n{output[-5000:]}")
    assert job.returncode == 0, output[-5000:]
    return output


def assert_same_run(run, reference):
    ours = torch.load(run / "final.pt", weights_only=True)
    theirs = torch.load(reference / "final.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert (run / "metrics.csv").read_bytes() == (reference / "metrics.csv").read_bytes()


def resumed_ticks(output):
    return [int(t) for t in re.findall(r"resumed from checkpoint \S+/step-(\d+)", output)]


def saved_just_in_time(output):
    return sorted({int(t) for t in re.findall(r"just in time: \S+/step-(\d+)", output)})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("jit") / "reference"
    output = torchrun(run, {})
    assert "just-in-time saves are off" not in output
    return run


def test_ranks_killed_anywhere_cost_at_most_the_step_in_flight(reference, tmp_path):
    """Five failures, each resumed from the last completed step or the checkpoint before it:

    - ranks 0 and 2 killed at once after tick 8: rank 1 alone is elected and saves, but it is
      killed in that save (its 10th file write): the previous checkpoint (tick 5) stays whole;
    - rank 1 killed inside validation batch 3 (tick 23): saved at tick 22;
    - rank 2 killed inside training tick 30, the others waiting in its all-reduce: the last step
      (tick 29) is the periodic checkpoint already written, so nothing is saved again;
    - ranks 0 (the log's writer) and 2 killed after tick 38: saved at tick 38, the log's size
      read from the file rank 0 left.
    """
    run = tmp_path / "run"
    options = {
        "kill": {"rank": [0, 2], "at": [8, 38]},
        "kill_in_step": [
            {"rank": 2, "phase": "train", "at": 30},
            {"rank": 1, "phase": "val", "at": 23},
        ],
        "kill_in_save": {"rank": 1, "write": 10},
    }
    output = torchrun(run, options, restarts=5)
    assert output.count("exitcode: -9") == 4, output[-3000:]
    assert resumed_ticks(output) == [5, 22, 29, 38], output[-3000:]
    assert saved_just_in_time(output) == [22, 38], output[-3000:]
    assert_same_run(run, reference)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_a_rank_killed_in_a_background_save_leaves_its_step_to_a_survivor(reference, tmp_path):
    """async_save: the periodic checkpoints are written in the background while training goes on.

    - rank 1 dies in its first file write of tick 10's (its 5th: 4 files a checkpoint), before
      tick 11's all-reduce: that checkpoint is never committed, so a survivor saves tick 10 and
      says so; the partial files are removed, never resumed from;
    - rank 1 dies in tick 16, once its background save of tick 15 is committed: nothing is
      saved again.
    """
    run = tmp_path / "run"
    options = {
        "async_save": True,
        "kill_in_save": {"rank": 1, "write": 5},
        "kill_in_step": [{"rank": 1, "phase": "train", "at": 16}],
    }
    output = torchrun(run, options, restarts=2)
    assert output.count("exitcode: -9") == 2, output[-3000:]
    assert saved_just_in_time(output) == [10], output[-3000:]
    assert resumed_ticks(output) == [10, 15], output[-3000:]
    lost = re.findall(
        r"background save of step-(\d+) was lost .* save of step-(\d+) covers", output
    )
    assert lost == [("000000010", "000000010")], output[-3000:]
    assert "FAILED" not in output  # dropped, not reported again at exit as never waited for
    assert_same_run(run, reference)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_rank_0_killed_anywhere_costs_at_most_the_step_in_flight(reference, tmp_path):
    """Rank 0 writes the log, so a survivor saving for it needs rank 0's rows of the last step.
    Three failures, each saved just in time at the last completed step:

    - rank 0 killed inside a 30 ms ``on_train_batch_end`` callback at tick 15, a log row: the
      row reached the file when it was logged, before the callbacks;
    - rank 0 killed in ``on_optimizer_step`` at tick 34, a log row: the others completed the
      step, but rank 0 never wrote its row; the saver writes it, rank 0's loss as the step's
      all-reduce carried it;
    - rank 0 killed inside validation batch 46: saved at tick 45.
    """
    run = tmp_path / "run"
    options = {
        "kill_in_hook": [
            {"rank": 0, "hook": "on_train_batch_end", "at": 15, "ms": 30},
            {"rank": 0, "hook": "on_optimizer_step", "at": 34},
        ],
        "kill_in_step": [{"rank": 0, "phase": "val", "at": 46}],
    }
    output = torchrun(run, options, restarts=3)
    assert "no just-in-time save" not in output, output[-3000:]
    assert output.count("exitcode: -9") == 3, output[-3000:]
    assert saved_just_in_time(output) == [15, 34, 45], output[-3000:]
    assert resumed_ticks(output) == [15, 34, 45], output[-3000:]
    assert_same_run(run, reference)


def test_a_rank_killed_inside_an_accumulation_window_resumes_at_the_windows_start(tmp_path):
    # accumulate=2: ticks 15 and 16 make step 8. Rank 2 dies inside tick 16, after tick 15's
    # backward added every rank's loss to the running sums: a survivor saves tick 14 (step 7,
    # not a periodic checkpoint) with the sums as they were there, without tick 15's losses.
    reference = tmp_path / "reference"
    torchrun(reference, {"accumulate": 2})
    run = tmp_path / "run"
    kill = [{"rank": 2, "phase": "train", "at": 16}]
    output = torchrun(run, {"accumulate": 2, "kill_in_step": kill}, restarts=1)
    assert output.count("exitcode: -9") == 1, output[-3000:]
    assert saved_just_in_time(output) == [14], output[-3000:]
    assert resumed_ticks(output) == [14], output[-3000:]
    assert_same_run(run, reference)


def test_a_step_that_does_not_log_reads_nothing_on_the_host_and_runs_no_collective(
    reference, tmp_path
):
    # The ranks' agreement (flags, log size, each rank's loss) rides on DDP's gradient
    # reduction; the running loss stays on the device (its device way, as on an accelerator).
    # Counted per training tick on each rank: the library's host reads of tensor values and its
    # collectives outside the reduction's hook. Only batches that log (every 5th of an epoch:
    # ticks 5-20 and 29-44), the first of epoch 1 (tick 25, after epoch 0's end and its
    # validation) and the start may have any.
    run = tmp_path / "counted"
    torchrun(run, {"count": True, "every_steps": 1000})
    assert_same_run(run, reference)  # the device way and no periodic save: the same run
    for rank in range(3):
        ticks = json.loads((run / f"counts.rank{rank}.json").read_text())
        batch = {int(t): int(t) - (24 if int(t) > 24 else 0) for t in ticks}
        quiet = {t: ticks[str(t)] for t, b in batch.items() if b % 5 and t not in (0, 25)}
        assert len(quiet) == 31  # 16 batches of each epoch, less tick 25
        assert all(n == {"reads": 0, "blocking": 0, "collectives": 0} for n in quiet.values()), {
            t: n for t, n in quiet.items() if any(n.values())
        }
        assert ticks["5"]["reads"] >= 1  # the counting sees the log row's read of the loss


def test_a_hung_rank_becomes_a_save_after_the_process_groups_timeout(reference, tmp_path):
    # Rank 1 SIGSTOPs itself after tick 9; the others' next collective times out after 10 s (a
    # margin for a loaded machine), one of them saves tick 9, and torchrun kills the stopped
    # rank and restarts the group.
    run = tmp_path / "run"
    output = torchrun(run, {"stop": {"rank": 1, "at": 9}, "pg_timeout": 10}, restarts=1)
    assert saved_just_in_time(output) == [9], output[-3000:]
    assert resumed_ticks(output) == [9], output[-3000:]
    assert "Timed out" in output
    assert_same_run(run, reference)


def test_a_stopped_rank_is_saved_for_and_restarted_without_a_process_group_timeout(
    reference, tmp_path
):
    # Rank 1 SIGSTOPs itself after tick 9, under the process group's default timeout (30 min).
    # Rank 0 watches it (train.watchdog): its heartbeat stands still for more than the limit
    # (3 s here; 60 s at least by default), so rank 0 saves tick 9 and exits; rank 2 follows,
    # and torchrun kills the stopped rank (SIGKILL, after its 30 s grace) and restarts.
    run = tmp_path / "run"
    options = {"stop": {"rank": 1, "at": 9}, "hang_timeout": 3}
    output = torchrun(run, options, restarts=1, timeout=150)
    assert re.search(r"rank 1 hung: its process has not run for \d+ s", output), output[-3000:]
    assert "limit is 3 s (hang_timeout)" in output
    assert saved_just_in_time(output) == [9], output[-3000:]
    assert resumed_ticks(output) == [9], output[-3000:]
    assert "Timed out" not in output
    assert_same_run(run, reference)


# -- the parts, in one process ---------------------------------------------------------------


def test_a_step_seeds_every_generator_from_the_seed_phase_epoch_step_and_rank():
    def draws():
        return torch.rand(2), np.random.rand(), random.random()

    seed_step(3, TRAIN, 1, 7, 2)
    first = draws()
    seed_step(3, TRAIN, 1, 7, 2)
    again = draws()
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
    for other in [(4, TRAIN, 1, 7, 2), (3, VAL, 1, 7, 2), (3, TRAIN, 2, 7, 2), (3, TRAIN, 1, 8, 2)]:
        seed_step(*other)
        assert not torch.equal(draws()[0], first[0]), other
    seed_step(3, TRAIN, 1, 7, 1)
    assert draws()[1:] != first[1:]


def test_the_trainer_seeds_each_optimizer_steps_first_batch(tmp_path):
    """What a training step draws is what ``seed_step`` gives for (seed, epoch, step, rank 0):
    computed here without the Trainer; with accumulate=2 a window's second batch goes on from
    its first."""
    drawn = []

    def training_step(model, batch):
        drawn.append(torch.rand(1).item())
        return model(batch[0]).sum()

    model = torch.nn.Linear(3, 1)
    data = torch.utils.data.TensorDataset(torch.randn(12, 3))
    loader = unbroken.DataLoader(data, batch_size=2, seed=1)
    trainer = unbroken.Trainer(
        tmp_path, max_epochs=2, seed=5, accumulate=2, progress_bar=False, tensorboard=False
    )
    trainer.fit(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, training_step=training_step
    )
    expected = []
    for epoch in range(2):
        for step in range(3 * epoch, 3 * epoch + 3):
            seed_step(5, TRAIN, epoch, step, 0)
            expected += [torch.rand(1).item(), torch.rand(1).item()]
    assert drawn == expected


def test_one_process_saves_every_ranks_files_and_each_rank_loads_its_own(tmp_path):
    model = torch.nn.Linear(2, 2)
    checkpointer = Checkpointer(tmp_path)
    parts = {"progress": [{"rank": r} for r in range(3)]}
    path = checkpointer.save_alone(7, {"model": model, "log": {"bytes": 40}}, parts)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert manifest["world_size"] == 3 and manifest["step"] == 7
    files = manifest["entries"]["progress"]["ranks"]
    assert [torch.load(Path(path) / f, weights_only=True) for f in files] == parts["progress"]
    # One process loading a 3-rank checkpoint gets the parts resized (here: rank 0's).
    state = {"model": torch.nn.Linear(2, 2), "progress": PerRank({}, resize="rank0")}
    restored = checkpointer.load_latest(state)
    assert restored is not None and restored.world_size == 3
    assert torch.equal(state["model"].weight, model.weight)


def test_save_alone_refuses_shards_and_ragged_parts(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="shards"):
        checkpointer.save_alone(1, {"model": Sharded(model, optimizer)}, {"p": [1, 2]})
    with pytest.raises(ValueError, match="one value per rank"):
        checkpointer.save_alone(1, {}, {"a": [1, 2], "b": [1]})
    assert not list(tmp_path.iterdir())


def test_the_log_size_of_a_dead_rank_0_is_that_of_the_records_rows_found_in_the_file(tmp_path):
    log = tmp_path / "metrics.csv"
    log.write_bytes(b"header\nrow 1\nrow 2\n")
    base = len(b"header\n")
    assert jit.logged_through(log, base, 2) == log.stat().st_size
    assert jit.logged_through(log, base, 0) == base
    # More rows than the record's (rank 0 logged the next step's, or a part of a row, before
    # it died): the record's are the first ones.
    assert jit.logged_through(log, base, 1) == base + len(b"row 1\n")
    log.write_bytes(b"header\nrow 1\nrow 2\nro")
    assert jit.logged_through(log, base, 2) == base + len(b"row 1\nrow 2\n")
    assert log.read_bytes() == b"header\nrow 1\nrow 2\nro"  # read only


def test_a_row_that_never_reached_the_file_is_written_only_if_it_is_the_known_last_one(tmp_path):
    log = tmp_path / "metrics.csv"
    base = len(b"header\n")
    for left in (b"header\nrow 1\n", b"header\nrow 1\nro"):  # rank 0 died before or in it
        log.write_bytes(left)
        with pytest.raises(jit.LogUnknown, match="1 of rank 0's 2 log row"):
            jit.logged_through(log, base, 2)  # only rank 0 knew it
        assert log.read_bytes() == left
        assert jit.logged_through(log, base, 2, b"row 2\n") == len(b"header\nrow 1\nrow 2\n")
        assert log.read_bytes() == b"header\nrow 1\nrow 2\n"  # in the place of the part
    log.write_bytes(b"header\n")
    with pytest.raises(jit.LogUnknown, match="2 of rank 0's 2 log row"):
        jit.logged_through(log, base, 2, b"row 2\n")  # the first was not the known one
    assert log.read_bytes() == b"header\n"


def test_rank_0_hands_each_logged_batchs_rows_to_the_file_and_notes_the_carried_loss(tmp_path):
    """Before the callbacks run: a rank 0 killed in one leaves them in the file. The loop's
    own loss row is noted on every rank (a survivor may write rank 0's from the agreement)."""
    run = RunDirectory(tmp_path)
    run_log = RunLog(run, False, {})
    run_log.log({"loss": torch.tensor(0.5), "acc": 1.0}, "train", 3, 0, 7, carried=True)
    run_log.log({"lr": 0.1}, "train", 3, 0, 7)
    assert (tmp_path / "metrics.csv").read_text().splitlines()[1:] == [
        "3,0,train,loss,0.5",
        "3,0,train,acc,1.0",
        "3,0,train,lr,0.1",
    ]
    assert run_log.rows == 3
    assert run_log.loss_row == LossRow(index=0, tick=7, step=3, epoch=0, phase="train")
    run_log.close()


def test_just_in_time_saves_are_off_where_a_survivor_cannot_know_a_rank(monkeypatch):
    loader = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4)), batch_size=2)
    entries = {"model": torch.nn.Linear(1, 1), "train_loader": PerRank(loader, resize="rank0")}
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert "torchrun" in jit.off_because(entries, 1)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert jit.off_because(entries, 1) is None
    assert "preemption_check_every" in jit.off_because(entries, 2)
    assert "torchmetrics" in jit.off_because({**entries, "metric.train.acc": object()}, 1)
    per_rank = PerRank([1, 2], resize="rank0")  # not an unbroken.DataLoader
    assert "train_loader" in jit.off_because({**entries, "train_loader": per_rank}, 1)
    # A model sharded by FSDP2, in the entries as the Trainer builds them: one Sharded entry.
    sharded = fsdp2_entries(loader)
    assert isinstance(sharded["model"], Sharded)
    assert "sharded (FSDP2)" in jit.off_because(sharded, 1)
    # An unsharded model resuming a sharded run's checkpoint is saved through DCP too.
    through_dcp = {**entries, "model": Sharded(torch.nn.Linear(1, 1))}
    assert "through DCP" in jit.off_because(through_dcp, 1)


def fsdp2_entries(loader):
    """The Trainer's entries for a ``fully_shard``-ed model (on a 1-rank gloo group, then gone)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
        return checkpoint_entries(
            progress=Progress(
                TrainerConfig(seed=0, accumulate=1, clip_grad_norm=None, scheduler_interval="step")
            ),
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_loader=loader,
            val_loader=None,
            scheduler=None,
            scaler=None,
            log=None,
            metrics={},
            callbacks=[],
        )
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_turns_just_in_time_saves_off_or_refuses_them(monkeypatch, caplog):
    # Under torchrun, on 3 ranks (JustInTime decides before any collective or store).
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    loader = unbroken.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4)), batch_size=2)
    entries, ranks = fsdp2_entries(loader), SimpleNamespace(world=World(0, 3))
    log = SimpleNamespace(csv=None)

    def just_in_time(wanted):
        return jit.JustInTime(wanted, ranks, None, entries, None, None, log, 1)

    with caplog.at_level(logging.INFO, logger="unbroken"):
        assert not just_in_time(None).enabled
    assert "just-in-time saves are off: the model is sharded (FSDP2)" in caplog.text
    with pytest.raises(ValueError, match=r"just_in_time=True\) .*sharded \(FSDP2\)"):
        just_in_time(True)
