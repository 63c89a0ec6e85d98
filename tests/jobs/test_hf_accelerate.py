"""Accelerate in a loop of one's own: an ``unbroken.DataLoader`` kept out of ``prepare``,
registered for checkpointing, with ``unbroken.hf.accelerate.save_state``/``load_state``: a job
SIGKILLed at every boundary resumes bit for bit (every trained sample, its augmentation and
loss, the final weights), a save killed midway is skipped by name, 3 DDP ranks under torchrun,
resumed by a new torchrun or by torchrun's own restart after one rank is SIGKILLed (a process
group made by torch's own ``init_process_group`` is refused there, with the fix); the loader
passed through ``prepare`` loses its place.

The job is ``tests/support/hf_accelerate_job.py`` (96 samples, batch 8: 12 steps an epoch, 3 epochs, a
save every 4 optimizer steps). Each run is a real process forked from a ``multiprocessing``
forkserver that imported Accelerate once; torchrun runs the 3-rank jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import forked
import hf_accelerate_job
import pytest
import torch
from locations import SUPPORT
from safetensors.torch import load_file

import unbroken.distributed
import unbroken.hf
import unbroken.hf.accelerate
from unbroken.data.keys import derive_key
from unbroken.data.rng import batch_seeds
from unbroken.errors import CorruptCheckpoint

N, BATCH, EPOCHS, SEED = (hf_accelerate_job.N, hf_accelerate_job.BATCH, 3, 7)
STEPS = N // BATCH  # per epoch, on one process


@pytest.fixture(scope="module")
def job():
    return forked.jobs(hf_accelerate_job.main)


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """Uninterrupted runs, one per configuration, made once."""
    return forked.made_once(job, tmp_path_factory)


def read(path: str) -> str:
    with open(path) as file:
        return file.read()


def records(out: str, rank: int = 0) -> dict[int, dict]:
    """Each micro-batch as the run that counted trained it: after a resume, the resumed run's
    rows (written later) replace the killed run's."""
    rows: dict[int, dict] = {}
    with open(os.path.join(out, f"batches-rank{rank}.jsonl")) as lines:
        for line in lines:
            row = json.loads(line)
            rows[row["batch"]] = row
    return rows


def folders(out: str) -> list[str]:
    return sorted(name for name in os.listdir(out) if name.startswith("checkpoint-"))


def weights(out: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(out, f"weights-rank{rank}.pt"))


def assert_same_run(expected: str, resumed: str, ranks: int = 1) -> None:
    for rank in range(ranks):
        want, got = records(expected, rank), records(resumed, rank)
        assert got.keys() == want.keys(), f"rank {rank}"
        for batch, row in want.items():
            assert got[batch] == row, f"rank {rank}, batch {batch}"
        want_weights = weights(expected, rank)
        for name, value in weights(resumed, rank).items():
            assert torch.equal(value, want_weights[name]), f"rank {rank}, {name}"


CUTS = [
    # (the reference's configuration, the run's other options, where the kill comes)
    ((), (), ("--kill-at", "18")),  # mid-epoch: resumed from step 16, epoch 1's 4th batch
    ((), (), ("--kill-at", "13")),  # from an epoch's last batch (12): its remainder is empty
    ((), ("--save-every", "13"), ("--kill-at", "15")),  # from an epoch's first batch (13)
    ((), ("--workers", "2"), ("--kill-at", "18")),  # workers: the stream of 0 workers
    ((), ("--workers", "2"), ("--kill-at", "25")),  # workers, from an epoch's last batch (24)
    # Inside a window of 5 that spans epochs 0 and 1 (batches 11-15): resumed from batch 10.
    (("--accum", "5"), ("--save-every", "2"), ("--kill-in-window", "13")),
    (("--accum", "3"), ("--save-every", "2"), ("--kill-at", "4")),  # a window ending an epoch
]


@pytest.mark.parametrize(
    "config, options, cut", CUTS, ids=[" ".join(c + o + k) for c, o, k in CUTS]
)
def test_a_killed_loop_resumes_bit_for_bit(job, reference, tmp_path, config, options, cut):
    out = str(tmp_path / "run")
    assert job(out, *config, *options, *cut, expect=None) == -9  # SIGKILL
    job(out, *config, *options)
    assert_same_run(reference(*config), out)


def test_a_save_killed_midway_is_skipped_with_a_message(job, reference, tmp_path):
    # keep=1: the previous checkpoint goes only once the new one is sealed.
    out = str(tmp_path / "run")
    assert job(out, "--keep", "1", "--kill-in-save", "16", expect=None) == -9
    killed = os.path.join(out, "checkpoint-16")
    assert os.path.exists(os.path.join(killed, "model.safetensors"))  # Accelerate wrote files
    assert unbroken.hf.check(killed).status == "unsealed"
    assert folders(out) == ["checkpoint-12", "checkpoint-16"]
    assert unbroken.hf.check(os.path.join(out, "checkpoint-12")).sealed
    job(out, "--keep", "1")
    assert f"skipping checkpoint {killed}: it has no unbroken-seal.json" in read(out + ".log")
    assert folders(out) == ["checkpoint-36"]
    assert_same_run(reference(), out)


def test_the_uninterrupted_loop_trains_the_documented_order(reference):
    # Not the loader's own stream: each epoch a permutation, another each epoch, and each
    # sample's augmentation drawn from torch's generator seeded for its batch from
    # (seed, epoch, the batch's first position), as the README's "Randomness" section says.
    rows = records(reference())
    orders = []
    for epoch in range(EPOCHS):
        key, order = derive_key(SEED, epoch), []
        for position in range(0, N, BATCH):
            row = rows[epoch * STEPS + position // BATCH + 1]
            generator = torch.Generator().manual_seed(batch_seeds(key, position)[0])
            drawn = [(torch.rand(4, generator=generator) * 0.1).sum().item() for _ in row["aug"]]
            assert row["aug"] == drawn, f"epoch {epoch}, position {position}"
            order += row["index"]
        assert sorted(order) == list(range(N))
        orders.append(order)
    assert orders[0] != orders[1] != orders[2] != orders[0]


def torchrun(
    ranks: int,
    out: str,
    *args: str,
    restarts: int = 0,
    timeout: float = 300,
    job: str = "hf_accelerate_job.py",
) -> int:
    """torchrun's exit status running ``tests/support/<job>``, its output in ``out + ".log"``. Past
    ``timeout`` seconds the test fails on the hang, after a SIGTERM to torchrun, which stops its
    ranks (each in a session of its own) as on a failure."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={ranks}", f"--max-restarts={restarts}"]
    command += [os.path.join(SUPPORT, job), "--out", out, *args]
    with open(out + ".log", "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            process.wait(60)
    pytest.fail(f"torchrun hangs after {timeout} s: {read(out + '.log')[-3000:]}")


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    """An uninterrupted 3-rank run: 4 steps an epoch, a save every 3 steps."""
    expected = str(tmp_path_factory.mktemp("ddp") / "reference")
    assert torchrun(3, expected, "--save-every", "3") == 0, read(expected + ".log")[-3000:]
    assert read(expected + ".log").count("of 3: DistributedType.MULTI_CPU") == 3
    return expected


def test_three_ddp_ranks_resume_bit_for_bit(ddp_reference, tmp_path):
    # Accelerate's MULTI_CPU under torchrun (gloo); every rank SIGKILLs itself at step 7,
    # mid-epoch 1; exact_reduce on the prepared DDP model; a new torchrun resumes.
    out = str(tmp_path / "run")
    assert torchrun(3, out, "--save-every", "3", "--kill-at", "7") != 0
    assert torchrun(3, out, "--save-every", "3") == 0, read(out + ".log")[-3000:]
    assert_same_run(ddp_reference, out, ranks=3)
    shares = [
        sum((records(ddp_reference, r)[b]["index"] for b in range(1, 5)), []) for r in range(3)
    ]
    assert sorted(sum(shares, [])) == list(range(N))  # each rank its share of one epoch


def test_torchruns_own_restart_resumes_bit_for_bit(ddp_reference, tmp_path):
    # Rank 1 alone is SIGKILLed at step 7 of the first attempt; torchrun stops the others and
    # starts all three again, against the same store. The group made by Accelerate's call of
    # torch's init_process_group would read the dead attempt's addresses there ("connectFullMesh
    # failed", or a hang); the job starts it with unbroken.distributed.init_process_group.
    out = str(tmp_path / "run")
    cut = ("--save-every", "3", "--kill-at", "7", "--kill-rank", "1")
    assert torchrun(3, out, *cut, restarts=1, timeout=180) == 0, read(out + ".log")[-3000:]
    assert read(out + ".log").count("attempt='1'") == 3  # one restart
    assert f"resumed from {os.path.join(out, 'checkpoint-6')}" in read(out + ".log")
    assert_same_run(ddp_reference, out, ranks=3)


def test_a_loader_passed_through_prepare_loses_its_place(job, reference, tmp_path):
    # Accelerate rebuilds the loader as a DataLoaderShard around its sampler and dataset: the
    # order survives (the sampler is unbroken's view), but the loader is never iterated, so
    # its saved position stays at its epoch's start, and the augmentations come from torch's
    # generator in turn rather than from each sample's position.
    expected, out = str(tmp_path / "expected"), str(tmp_path / "run")
    job(expected, "--prepare")
    assert job(out, "--prepare", "--kill-at", "18", expect=None) == -9
    saved = torch.load(
        os.path.join(out, "checkpoint-16", "custom_checkpoint_0.pkl"), weights_only=False
    )
    assert (saved["epoch"], saved["batches"]) == (1, 0)  # 4 batches into epoch 1, it says 0
    job(out, "--prepare")
    want, got = records(expected), records(out)
    assert len(got) == len(want) + 4  # epoch 1's first 4 batches trained twice
    assert [got[16 + b]["index"] for b in range(1, 5)] == [
        want[12 + b]["index"] for b in range(1, 5)
    ]
    assert any(not torch.equal(v, weights(expected)[k]) for k, v in weights(out).items())
    exact = records(reference())
    assert all(want[b]["index"] == exact[b]["index"] for b in want)  # the same order
    assert not any(want[b]["aug"] == exact[b]["aug"] for b in want)  # other augmentations


# The helper's own refusals and bookkeeping, on a real Accelerator in this process.


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def test_no_checkpoint_starts_and_no_sealed_one_is_refused(accelerator, tmp_path):
    assert unbroken.hf.accelerate.load_state(accelerator, str(tmp_path)) == 0
    os.makedirs(tmp_path / "checkpoint-4")
    with pytest.warns(unbroken.hf.UnsealedCheckpointWarning, match="checkpoint-4"):
        with pytest.raises(CorruptCheckpoint, match="no sealed checkpoint.*checkpoint-4"):
            unbroken.hf.accelerate.load_state(accelerator, str(tmp_path))


def test_a_resume_loads_the_newest_sealed_and_removes_the_unsealed_newer(accelerator, tmp_path):
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    for step in (1, 2, 3):
        unbroken.hf.accelerate.save_state(accelerator, str(tmp_path), step, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-3"]
    saved = load_file(os.path.join(tmp_path, "checkpoint-3", "model.safetensors"))["weight"]
    os.makedirs(tmp_path / "checkpoint-4")  # a save killed before Accelerate wrote anything
    with torch.no_grad():
        model.weight.add_(1)
    with pytest.warns(unbroken.hf.UnsealedCheckpointWarning, match="checkpoint-4"):
        assert unbroken.hf.accelerate.load_state(accelerator, str(tmp_path)) == 3
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-3"]
    assert torch.equal(model.weight.detach(), saved)


def test_automatic_checkpoint_naming_is_refused_with_the_fix(tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    naming = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=naming)
    with pytest.raises(ValueError, match="automatic_checkpoint_naming.*keep="):
        unbroken.hf.accelerate.save_state(accelerator, str(tmp_path), 1)


def test_a_group_of_torchs_own_under_an_agent_is_refused_with_the_fix(
    accelerator, tmp_path, monkeypatch
):
    # A world of one in this process, under the environment torchrun gives its ranks; the agent's
    # store is a TCPStore served here. Torch's own group (Accelerate's call) is refused on the
    # first attempt already, unbroken.distributed.init_process_group's is taken.
    import torch.distributed as dist

    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environment = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    environment |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent_store.port)}
    environment |= {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "2"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    directory = str(tmp_path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"max-restarts=2.*unbroken\.distributed\.init_"):
            unbroken.hf.accelerate.load_state(accelerator, directory)
        with pytest.raises(RuntimeError, match="before building the Accelerator"):
            unbroken.hf.accelerate.save_state(accelerator, directory, 1)
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # a relaunch is a new torchrun
        assert unbroken.hf.accelerate.load_state(accelerator, directory) == 0
    finally:
        dist.destroy_process_group()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    unbroken.distributed.init_process_group("gloo")
    try:
        assert unbroken.hf.accelerate.load_state(accelerator, directory) == 0
    finally:
        dist.destroy_process_group()
