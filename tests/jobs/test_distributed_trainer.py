"""unbroken.Trainer under torchrun (gloo, CPU): a DDP job killed and restarted by torchrun, or
preempted on one rank, ends with the weights and the log of a job never interrupted, bit for
bit; continued on another number of ranks, it trains on every sample of each epoch exactly
once; two torchrun agents (two "nodes" on 127.0.0.1) train it like one.

The bit-exact jobs run on 3 ranks: on 2, each element of a gradient all-reduce is one addition
(a + b == b + a), which hides a sum whose order changed between the interrupted and the
uninterrupted run. The job is tests/support/ddp_job.py; each torchrun start costs a few seconds, so the
runs are shared module fixtures and the worlds have 1 to 3 ranks."""

import collections
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from locations import ROOT, SUPPORT

from unbroken.data.keys import derive_key
from unbroken.train.lock import DirectoryLock

JOB = SUPPORT / "ddp_job.py"
N, EPOCHS = 240, 2  # as in ddp_job.py: 20 global batches of 3 x 4 samples per epoch on 3 ranks
RANKS = 3
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def torchrun(run, options=None, ranks=RANKS, restarts=0, expect=0):
    result = subprocess.run(
        [TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", f"--max-restarts={restarts}"]
        + [str(JOB), str(run), json.dumps(options or {})],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    output = result.stdout + result.stderr
    assert (result.returncode == 0) == (expect == 0), output[-5000:]
    return output


def weights(run):
    return torch.load(run / "final.pt", weights_only=True)


def assert_same_run(run, reference):
    ours, theirs = weights(run), weights(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert (run / "metrics.csv").read_bytes() == (reference / "metrics.csv").read_bytes()


def seen(*runs):
    """epoch -> Counter of the sample ids trained on by every rank of ``runs`` (used on jobs
    that were never killed: a preempted one stops right after its last checkpoint)."""
    counts = collections.defaultdict(collections.Counter)
    for run in runs:
        for path in sorted(run.glob("seen.rank*.jsonl")):
            for epoch, _tick, ids, _loss in map(json.loads, path.read_text().splitlines()):
                counts[epoch].update(ids)
    return counts


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ddp") / "reference"
    output = torchrun(run)
    assert "starting fresh on 3 ranks" in output
    # A survivor cannot know another rank's torchmetrics state: no just-in-time saves here.
    assert "just-in-time saves are off: torchmetrics states are per rank" in output
    return run


@pytest.fixture(scope="module")
def reference2(tmp_path_factory):
    """The same job on 2 ranks, for the jobs that run on 2."""
    run = tmp_path_factory.mktemp("ddp") / "reference2"
    torchrun(run, ranks=2)
    return run


def test_an_uninterrupted_job_trains_on_each_sample_once_per_epoch(reference):
    counts = seen(reference)
    assert sorted(counts) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        assert counts[epoch] == collections.Counter(range(N)), epoch
    # The ranks' shares differ, and the epochs' orders differ.
    lines = [
        [json.loads(line) for line in (reference / f"seen.rank{r}.jsonl").read_text().splitlines()]
        for r in range(RANKS)
    ]
    assert lines[0][0][2] != lines[1][0][2] != lines[2][0][2] != lines[0][0][2]
    assert lines[0][0][2] != lines[0][20][2]
    # One writer: rank 0 logs each batch's loss once (40 batches), and each epoch's values.
    rows = (reference / "metrics.csv").read_text().splitlines()
    assert sum(",train,loss," in row for row in rows) == 20 * EPOCHS
    assert sum(",train,epoch_loss," in row for row in rows) == EPOCHS
    # The logged epoch loss is the mean over the ranks of each rank's mean, on every rank.
    for epoch in range(EPOCHS):
        means = [
            statistics.fmean(line[3] for line in lines[r] if line[0] == epoch) for r in range(RANKS)
        ]
        logged = [
            dict(map(json.loads, (reference / f"epochs.rank{r}.jsonl").read_text().splitlines()))
            for r in range(RANKS)
        ]
        assert logged[0][epoch] == logged[1][epoch] == logged[2][epoch]
        assert logged[0][epoch] == pytest.approx(sum(means) / RANKS, rel=1e-6)
    files = {p.name for p in (reference / "checkpoints").iterdir()}
    assert files == {"step-000000035", "step-000000040"}  # keep=2


def test_ranks_killed_and_restarted_by_torchrun_end_bit_exact(reference, tmp_path):
    # Rank 2 is SIGKILLed mid-epoch (tick 13) and in the next epoch (tick 27), rank 1 inside
    # its 10th checkpoint file write (the save of step 15, other ranks' files maybe written);
    # torchrun restarts the group each time and the job resumes from the newest whole
    # checkpoint. On 3 ranks: a resumed DDP step sums its gradients as the uninterrupted did.
    run = tmp_path / "chaos"
    options = {"kill": {"rank": 2, "at": [13, 27]}, "kill_in_save": {"rank": 1, "write": 10}}
    output = torchrun(run, options, restarts=3)
    assert output.count("exitcode: -9") == 3, output[-3000:]
    assert "resumed from checkpoint" in output and "step-000000010" in output
    assert_same_run(run, reference)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_ranks_killed_and_restarted_with_the_run_directory_in_s3_end_bit_exact(
    reference, tmp_path, s3
):
    # As above, with the run directory in the S3 server: the checkpoints (each rank uploads its
    # parts), metrics.csv and the lease live there; every restarted process starts without any
    # local file of the run (its log's working copy is a new temporary directory).
    from unbroken.checkpoint import FsspecStorage

    url = s3.make_bucket("ddp-spot") + "/runs/chaos"
    run = tmp_path / "chaos"
    options = {
        "kill": {"rank": 2, "at": [13, 27]},
        "kill_in_save": {"rank": 1, "write": 10},
        "url": url,
        "storage_options": s3.storage_options,
        "lease_seconds": 2.0,
    }
    output = torchrun(run, options, restarts=3)
    assert output.count("exitcode: -9") == 3, output[-3000:]
    assert "resumed from checkpoint" in output and "step-000000010" in output
    storage = FsspecStorage(url, s3.storage_options)
    (run / "metrics.csv").write_bytes(storage.fs.cat_file(f"{url}/metrics.csv"))
    assert_same_run(run, reference)


def test_an_fsdp2_job_killed_and_restarted_ends_bit_exact(tmp_path):
    # The model is sharded with fully_shard over 3 ranks: model and optimizer are saved through
    # DCP, every rank its shards; rank 1 dies mid-epoch, in a checkpoint write and in the next
    # epoch. (FSDP2 reduce-scatters each parameter's gradient in one fixed layout.)
    reference, run = tmp_path / "fsdp", tmp_path / "fsdp-chaos"
    torchrun(reference, {"fsdp": True})
    chaos = {"kill": {"rank": 1, "at": [13, 37]}, "kill_in_save": {"rank": 1, "write": 10}}
    output = torchrun(run, {"fsdp": True, **chaos}, restarts=3)
    assert output.count("exitcode: -9") == 3, output[-3000:]
    # A survivor cannot save a rank's shards: said once an attempt, never tried at a failure.
    assert output.count("just-in-time saves are off: the model is sharded (FSDP2)") == 4
    assert "just-in-time save failed" not in output
    assert_same_run(run, reference)
    assert (max((run / "checkpoints").glob("step-*")) / "001-model.dcp" / ".metadata").exists()


def test_an_fsdp2_job_goes_on_in_one_process_with_the_model_unsharded(tmp_path):
    # FSDP2 on 3 ranks, preempted after global batch 18; then one process, the model as it is
    # (no FSDP, no DDP): DCP loads the shards into its whole tensors, the epoch goes on with
    # every sample once, and the run keeps saving through DCP (so FSDP2 can take it back).
    run = tmp_path / "fsdp-then-one"
    torchrun(run, {"fsdp": True, "signal": {"rank": 1, "at": 18}}, expect=1)
    output = torchrun(run, {"plain": True}, ranks=1)
    assert "saved by 3 ranks, on 1 rank" in output, output[-3000:]
    counts = seen(run)
    for epoch in range(EPOCHS):
        assert counts[epoch] == collections.Counter(range(N)), epoch
    newest = max((run / "checkpoints").glob("step-*"))
    assert json.loads((newest / "manifest.json").read_text())["world_size"] == 1
    assert (newest / "001-model.dcp" / ".metadata").exists()


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """A 3-rank job that got SIGTERM on rank 1 only, after global batch 18 of epoch 0; rank 0
    takes 3 s more to exit after the checkpoint. The flag rides on the next batch's gradient
    all-reduce: the ranks agree, and save, after batch 19."""
    run = tmp_path_factory.mktemp("ddp") / "preempted"
    options = {"signal": {"rank": 1, "at": 18}, "slow_exit": {"rank": 0, "seconds": 3}}
    output = torchrun(run, options, expect=1)
    return run, output


def test_a_signal_on_one_rank_saves_the_same_step_on_every_rank_and_exits_75(preempted):
    run, output = preempted
    # torchrun exits 1 when a rank exits non-zero, and sends SIGTERM to the ranks still running:
    # rank 0, still exiting, ignores it after its checkpoint and exits 75 too (not -15).
    assert "closing signal SIGTERM" in output, output[-3000:]
    assert len(re.findall(r"exitcode\s*: 75 ", output)) == 3, output[-3000:]
    assert not re.search(r"exitcode\s*: -15", output), output[-3000:]
    assert (
        "a preemption signal reached another rank; checkpoint at epoch 0, train batch 19, "
        "optimizer step 19 committed; exiting with 75" in output
    )
    newest = max((run / "checkpoints").glob("step-*"))
    assert newest.name == "step-000000019"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["world_size"] == 3
    assert len(manifest["entries"]["rng"]["ranks"]) == 3


def test_signals_reaching_the_ranks_at_different_moments_are_agreed_on_at_a_check(tmp_path):
    # Rank 1 is signalled after batch 17, rank 0 after 19; the ranks act every 5 batches on
    # what the backwards carried, so both save batch 20 (not 18 or 19) and exit 75.
    run = tmp_path / "signals"
    signals = [{"rank": 1, "at": 17}, {"rank": 0, "at": 19}]
    output = torchrun(run, {"signal": signals, "check_every": 5}, ranks=2, expect=1)
    assert "SIGTERM received; checkpoint at epoch 0, train batch 20" in output, output[-3000:]
    assert max((run / "checkpoints").glob("step-*")).name == "step-000000020"
    ticks = [
        [json.loads(line)[1] for line in (run / f"seen.rank{r}.jsonl").read_text().splitlines()]
        for r in range(2)
    ]
    assert ticks == [list(range(1, 21))] * 2  # nobody trained past the agreed batch


def test_sigterm_to_torchruns_whole_process_group_saves_and_the_job_resumes_bit_exact(
    reference, tmp_path
):
    # A scheduler signals the whole process group: torchrun's agent and the ranks. The agent
    # forwards SIGTERM and gives its workers time to exit; the ranks agree, save the same step
    # and exit 75. Started again, the job ends as if never stopped.
    run = tmp_path / "group"
    job = subprocess.Popen(
        [TORCHRUN, "--standalone", f"--nproc-per-node={RANKS}", str(JOB), str(run), "{}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    seen_file = run / "seen.rank0.jsonl"
    deadline = time.monotonic() + 120
    while not (seen_file.exists() and len(seen_file.read_text().splitlines()) >= 8):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGTERM)
    output = job.communicate(timeout=600)[0]
    assert "SIGTERM received; checkpoint at" in output, output[-3000:]
    saved = max((run / "checkpoints").glob("step-*"))
    ticks = [len((run / f"seen.rank{r}.jsonl").read_text().splitlines()) for r in range(RANKS)]
    assert ticks == [int(saved.name.split("-")[1])] * RANKS  # nothing trained past it
    assert "on 3 ranks" in torchrun(run)
    assert_same_run(run, reference)


def _continue(preempted, tmp_path, name, ranks):
    run = tmp_path / name
    shutil.copytree(preempted[0], run)
    return run, torchrun(run, ranks=ranks)


def test_the_preempted_job_resumed_on_as_many_ranks_ends_bit_exact(preempted, reference, tmp_path):
    run, output = _continue(preempted, tmp_path, "resumed", RANKS)
    assert "epoch 0, train batch 19, optimizer step 19) on 3 ranks" in output
    assert_same_run(run, reference)


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_job_continued_on_another_number_of_ranks_sees_each_sample_once(
    preempted, tmp_path, ranks
):
    run, output = _continue(preempted, tmp_path, f"on{ranks}", ranks)
    assert f"saved by 3 ranks, on {ranks} rank" in output, output[-3000:]
    counts = seen(run)  # the copy holds the 3-rank job's records too
    for epoch in range(EPOCHS):
        assert counts[epoch] == collections.Counter(range(N)), epoch
    logs = json.loads((run / "logs.json").read_text())
    assert 0.0 <= logs["train/acc"] <= 1.0  # the metric's states were merged, not refused
    # No rank has an RNG state saved for it: each is seeded from (seed 0, tick 19, its rank).
    seeds = [json.loads((run / f"fit.rank{r}.json").read_text()) for r in range(ranks)]
    assert seeds == [derive_key(0, 19, r) % 2**63 for r in range(ranks)]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_torchrun_agents_rendezvous_as_two_nodes_and_train_the_same_job(reference2, tmp_path):
    run, port = tmp_path / "nodes", _free_port()
    command = [
        TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=unbroken-test",
        str(JOB),
        str(run),
        "{}",
    ]
    # Each agent writes to a file: with pipes read one after the other, an agent whose pipe filled
    # while the test waited on the other would block, and its peer with it, in a collective.
    # One agent hosts the rendezvous store, the other connects to it: left to guess from the
    # endpoint (both are on 127.0.0.1), two agents starting at once may both try to host it.
    logs = [tmp_path / f"node-{i}.log" for i in range(2)]
    nodes = []
    for log, host in zip(logs, ("true", "false")):
        with open(log, "w") as out:
            nodes.append(
                subprocess.Popen(
                    [*command[:1], f"--rdzv-conf=is_host={host}", *command[1:]],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=ENV,
                    start_new_session=True,
                )
            )
    try:
        for node in nodes:
            node.wait(timeout=600)  # below pytest's timeout, so that the logs are shown
    except subprocess.TimeoutExpired:
        pytest.fail("the two agents did not finish:\n" + _tails(logs))
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], _tails(logs)
    assert_same_run(run, reference2)


def _tails(logs):
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)


def test_a_run_directory_locked_by_another_job_is_refused_on_every_rank(tmp_path):
    # Another job holds rank 0's lock: rank 0 is refused, rank 1 would get its own lock; both
    # must stop at once with DirectoryInUse, not rank 1 waiting for rank 0 in a collective.
    run = tmp_path / "locked"
    run.mkdir()
    with DirectoryLock(run):  # this process plays the other job's rank 0
        output = torchrun(run, expect=1)
    assert output.count("DirectoryInUse") >= 2, output[-3000:]
    assert "another rank of this job found its lock held" in output
    assert not (run / "checkpoints").exists()


def test_the_readme_job_runs_under_torchrun_as_written(tmp_path):
    readme = (ROOT / "docs" / "guides" / "data-parallel.md").read_text()
    heading = "## A training job on several ranks"
    block = readme[readme.index(heading) :].split("```python\n", 1)[1].split("\n```", 1)[0]
    (tmp_path / "train.py").write_text(block)
    result = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting fresh on 2 ranks" in result.stderr
    newest = max((tmp_path / "runs" / "ddp" / "checkpoints").glob("step-*"))
    assert json.loads((newest / "manifest.json").read_text())["world_size"] == 2


def test_metric_states_of_several_ranks_merge_onto_rank_0_on_another_world_size():
    import torchmetrics

    from unbroken.train.checkpointing import MetricState

    ranks = [torchmetrics.Accuracy(task="multiclass", num_classes=3) for _ in range(2)]
    preds, target = torch.tensor([0, 1, 2, 2, 1, 0]), torch.tensor([0, 1, 1, 2, 0, 0])
    ranks[0].update(preds[:4], target[:4])  # 3 of 4 right
    ranks[1].update(preds[4:], target[4:])  # 1 of 2 right
    parts = [MetricState(metric).state_dict() for metric in ranks]
    merged = [torchmetrics.Accuracy(task="multiclass", num_classes=3) for _ in range(2)]
    merged[1].update(preds, target)  # a rank's metric that must start empty
    for rank, metric in enumerate(merged):
        before = MetricState(metric).state_dict()
        state = MetricState(metric).merged(parts, rank, 2)
        assert MetricState(metric).state_dict()["updates"] == before["updates"]  # unchanged
        MetricState(metric).load_state_dict(state)  # what the Checkpointer then restores
    assert merged[0].compute().item() == pytest.approx(4 / 6)
    assert merged[0].update_count == 2 and merged[1].update_count == 0
    assert merged[1].tp.sum().item() == 0  # reset
