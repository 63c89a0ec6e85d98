"""unbroken inside PyTorch Lightning 2.x, proven by running it: ``unbroken.DataLoader`` returned
from ``train_dataloader()`` plus ``unbroken.lightning.ExactResume``, killed mid-epoch (SIGKILL,
or SIGTERM to the process group) and resumed with ``ckpt_path="last"``, ends with the
uninterrupted run's weights bit for bit, on one process (0 and 2 workers, the loaders from the
model or a LightningDataModule) and under Lightning's
DDP strategy on 2 processes started by torchrun. The same job with torch's DataLoader and no
callback (plain Lightning) is run side by side and its repeats, skips and weights reported."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unbroken.errors import CorruptState
from unbroken.lightning import EXIT_CODE, AtomicCheckpointIO, ExactResume

JOB = Path(__file__).with_name("lightning_job.py")
N, BATCH = 96, 8  # the job's dataset and batch size: 12 steps an epoch on one process


def run(out: Path, *args: str, devices: int = 1, expect: int = 0) -> None:
    if devices == 1:
        command = [sys.executable, str(JOB), str(out), *args]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={devices}",
            "--max-restarts=0",
            str(JOB),
            str(out),
            "--devices",
            str(devices),
            *args,
        ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    # Its own process group, so that a SIGTERM to the group reaches the job and its workers only.
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=240, start_new_session=True
    )
    ok = done.returncode == expect if expect >= 0 else done.returncode != 0
    assert ok, (
        f"exit {done.returncode}, expected {expect}:\n{done.stdout[-3000:]}{done.stderr[-5000:]}"
    )


def steps(out: Path, rank: int = 0) -> dict[int, list[int]]:
    """The indices trained on at each global step; a step run again after a resume replaces
    the one the killed run lost."""
    trained: dict[int, list[int]] = {}
    for line in (out / f"samples-rank{rank}.txt").read_text().splitlines():
        step, *indices = map(int, line.split())
        trained[step] = indices
    return trained


def weights_equal(a: Path, b: Path) -> bool:
    first, second = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def epoch_damage(trained: dict[int, list[int]], epoch: int, per_epoch: int) -> tuple[int, int]:
    """(samples repeated, samples skipped) in one epoch of the effective stream."""
    seen = [i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in trained[s]]
    counts = collections.Counter(seen)
    return sum(c - 1 for c in counts.values()), N - len(counts)


def check_epochs_are_permutations(trained: dict[int, list[int]], per_epoch: int, epochs: int):
    # The reference without the loader: every epoch is a permutation of the dataset, and the
    # shuffles of different epochs differ.
    orders = []
    for e in range(epochs):
        order = [i for s in range(e * per_epoch, (e + 1) * per_epoch) for i in trained[s]]
        assert sorted(order) == list(range(N))
        orders.append(order)
    assert len({tuple(o) for o in orders}) == epochs


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, 0 workers: the uninterrupted run, and a run SIGKILLed at step 21 (epoch 1,
    batch 10; the last checkpoint is step 20) then resumed; with unbroken and with plain
    Lightning."""

    def both(loader: str) -> tuple[Path, Path]:
        whole = tmp_path_factory.mktemp(f"{loader}-whole")
        cut = tmp_path_factory.mktemp(f"{loader}-cut")
        run(whole, "--loader", loader)
        run(cut, "--loader", loader, "--kill-at", "21", expect=-signal.SIGKILL)
        assert not (cut / "final.pt").exists()
        run(cut, "--loader", loader)
        return whole, cut

    # The two chains side by side: each job is one process, and the suite's wall time matters.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(("unbroken", "torch"), pool.map(both, ("unbroken", "torch"))))


def test_sigkill_mid_epoch_resumes_bit_exactly(single):
    whole, cut = single["unbroken"]
    check_epochs_are_permutations(steps(whole), 12, 3)
    assert steps(cut) == steps(whole)  # the same samples at every step, nothing repeated
    assert weights_equal(whole, cut)


def test_plain_lightning_side_by_side(single, capsys):
    # Plain Lightning 2.x with torch's DataLoader restarts the interrupted epoch's order: the
    # report says how many samples it repeated and skipped, and whether the weights match.
    report = {}
    for loader, (whole, cut) in single.items():
        repeated, skipped = epoch_damage(steps(cut), 1, 12)
        report[loader] = {
            "samples_repeated": repeated,
            "samples_skipped": skipped,
            "steps_equal": steps(cut) == steps(whole),
            "weights_equal": weights_equal(whole, cut),
        }
    with capsys.disabled():
        print("\nLightning, SIGKILL at step 21 of 36, resumed from step 20:", json.dumps(report))
    assert report["unbroken"] == {
        "samples_repeated": 0,
        "samples_skipped": 0,
        "steps_equal": True,
        "weights_equal": True,
    }
    torch_run = report["torch"]
    assert torch_run["samples_repeated"] > 0 and torch_run["samples_skipped"] > 0
    assert not torch_run["weights_equal"]


def test_sigterm_to_the_process_group_saves_and_exits_75_with_workers(single, tmp_path):
    # A scheduler signals the whole group (the workers too): the job saves at the step's end,
    # exits 75, and the resumed run (from a step that is not a multiple of the periodic
    # checkpoints) is exact. With 2 workers and the loaders from a LightningDataModule, it must
    # end as the uninterrupted run with 0 workers and the model's own loader hooks: neither
    # changes a sample, an augmentation or a draw of the training step.
    whole, cut = single["unbroken"][0], tmp_path
    options = ("--workers", "2", "--datamodule")
    run(cut, *options, "--signal-at", "17", expect=EXIT_CODE)
    saved = torch.load(cut / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 18  # saved at the end of the step the signal came in
    run(cut, *options)
    assert steps(cut) == steps(whole)
    assert weights_equal(whole, cut)


def test_ddp_two_processes_sigkill_resumes_bit_exactly(tmp_path):
    # Lightning's DDP strategy on 2 CPU processes (gloo) under torchrun; rank 1 is SIGKILLed at
    # step 11 (epoch 1: 6 steps an epoch per rank); torchrun stops rank 0. The last checkpoint
    # is step 10, written by rank 0 with both ranks' random generators.
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    run(whole, devices=2)
    run(cut, "--kill-at", "11", "--kill-rank", "1", devices=2, expect=-1)
    assert not (cut / "final.pt").exists()
    run(cut, devices=2)
    for rank in (0, 1):
        assert steps(cut, rank) == steps(whole, rank)
    both = [steps(whole, r) for r in (0, 1)]
    for e in range(3):  # the two ranks' shares of each epoch are one permutation of the data
        order = [i for s in range(e * 6, (e + 1) * 6) for r in (0, 1) for i in both[r][s]]
        assert sorted(order) == list(range(N))
    assert weights_equal(whole, cut)


# The parts, without a training run.


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("killed halfway through the write")


def test_atomic_checkpoint_io_leaves_the_old_file_whole_when_a_write_fails(tmp_path):
    io, target = AtomicCheckpointIO(), tmp_path / "ckpt" / "last.ckpt"
    io.save_checkpoint({"step": 1, "weights": torch.ones(3)}, target)
    before = target.read_bytes()
    with pytest.raises(RuntimeError, match="halfway"):
        io.save_checkpoint({"step": 2, "weights": torch.zeros(1000), "bad": Unpicklable()}, target)
    assert target.read_bytes() == before  # never a torn file under the checkpoint's name
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]  # no temp left
    io.save_checkpoint({"step": 3}, target)
    assert torch.load(target)["step"] == 3


def test_the_callback_installs_atomic_writes_unless_the_trainer_has_its_own(tmp_path):
    import lightning as L
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    trainer = L.Trainer(logger=False, default_root_dir=tmp_path, enable_progress_bar=False)
    assert type(trainer.strategy.checkpoint_io) is TorchCheckpointIO
    ExactResume().setup(trainer, None, "fit")
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO

    class Own(TorchCheckpointIO):
        pass

    trainer = L.Trainer(logger=False, default_root_dir=tmp_path, plugins=[Own()])
    ExactResume().setup(trainer, None, "fit")
    assert type(trainer.strategy.checkpoint_io) is Own


def test_generator_states_are_saved_and_put_back_at_train_start():
    callback = ExactResume()
    torch.manual_seed(5)
    saved = callback.state_dict()
    expected = torch.rand(4)
    assert saved["version"] == 1 and len(saved["rng"]) == 1
    torch.manual_seed(6)
    callback.load_state_dict(saved)
    assert not torch.equal(torch.rand(4), expected)  # not yet: Lightning still builds loaders
    callback.on_train_start(None, None)
    callback.preemption.uninstall()
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize(
    "state", [None, {}, {"version": 2, "rng": [{}]}, {"version": 1, "rng": []}, {"version": 1}]
)
def test_a_malformed_callback_state_is_refused(state):
    with pytest.raises(CorruptState, match="ExactResume state"):
        ExactResume().load_state_dict(state)


def test_the_states_of_another_world_size_load_with_a_warning():
    callback = ExactResume()
    state = callback.state_dict()
    with pytest.warns(UserWarning, match="random generators of 2 ranks and this job has 1"):
        callback.load_state_dict({"version": 1, "rng": state["rng"] * 2})


@pytest.mark.parametrize("check_every", [0, -1, 1.5, True])
def test_check_every_must_be_a_positive_int(check_every):
    with pytest.raises(ValueError, match="check_every"):
        ExactResume(check_every=check_every)
