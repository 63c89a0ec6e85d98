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
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from locations import SUPPORT

import unbroken
from unbroken import EXIT_CODE
from unbroken.checkpoint import FsspecStorage
from unbroken.errors import CorruptState
from unbroken.lightning import AtomicCheckpointIO, ExactResume
from unbroken.lightning.draws import crossed
from unbroken.lightning.loops import Place

JOB = SUPPORT / "lightning_job.py"
N, BATCH = 96, 8  # the job's dataset and batch size: 12 steps an epoch on one process


def run(out: Path, *args: str, devices: int = 1, expect: int = 0) -> str:
    """Run the job; its stderr (warnings included) is returned."""
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
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", "OMP_NUM_THREADS": "1"}
    # Its own process group, so that a SIGTERM to the group reaches the job and its workers only.
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, start_new_session=True
    )
    ok = done.returncode == expect if expect >= 0 else done.returncode != 0
    assert ok, (
        f"exit {done.returncode}, expected {expect}:\n{done.stdout[-3000:]}{done.stderr[-5000:]}"
    )
    return done.stderr


def steps(out: Path, rank: int = 0) -> dict[int, list[int]]:
    """The indices trained on at each optimizer step (from 0); a step run again after a resume
    replaces the one the killed run lost."""
    trained: dict[int, list[int]] = {}
    for line in (out / f"records-rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            trained[record["step"] - 1] = record["indices"]
    return trained


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records-rank0.jsonl").read_text().splitlines()]


def weights_equal(a: Path, b: Path) -> bool:
    first = torch.load(a / "final.pt", weights_only=False)["model"]
    second = torch.load(b / "final.pt", weights_only=False)["model"]
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


def test_sigkill_with_the_checkpoints_in_s3_resumes_bit_exactly(single, s3, tmp_path, monkeypatch):
    # A new "machine" each time: nothing local is read; last.ckpt is found and read in the store.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    url = s3.make_bucket("lightning-spot") + "/run/ckpt"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    run(first, "--ckpt-url", url, "--kill-at", "21", expect=-signal.SIGKILL)
    stored = FsspecStorage(url, s3.storage_options)
    assert [e.name for e in stored.list_directory(url)] == ["last.ckpt"]
    run(second, "--ckpt-url", url)
    whole, _ = single["unbroken"]
    resumed, reference = steps(second), steps(whole)
    assert min(resumed) == 20 and resumed == {s: ids for s, ids in reference.items() if s >= 20}
    assert weights_equal(whole, second)


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


def test_ddp_three_processes_sigkill_resumes_bit_exactly(tmp_path):
    # Lightning's DDP strategy on 3 CPU processes (gloo) under torchrun; rank 1 is SIGKILLed at
    # step 7 (epoch 1: 4 steps an epoch per rank); torchrun stops the others. The last
    # checkpoint is step 5, written by rank 0 with every rank's random generators. On 3 ranks
    # the resumed step sums its gradients as the uninterrupted one did only with ExactResume's
    # exact_reduce (on 2, a + b == b + a would hide it).
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    run(whole, devices=3)
    run(cut, "--kill-at", "7", "--kill-rank", "1", devices=3, expect=-1)
    assert not (cut / "final.pt").exists()
    assert torch.load(cut / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 5
    run(cut, devices=3)
    for rank in range(3):
        assert steps(cut, rank) == steps(whole, rank)
    each = [steps(whole, r) for r in range(3)]
    for e in range(3):  # the ranks' shares of each epoch are one permutation of the data
        order = [i for s in range(e * 4, (e + 1) * 4) for r in range(3) for i in each[r][s]]
        assert sorted(order) == list(range(N))
    assert weights_equal(whole, cut)


# The cuts issue 21 named, in real processes with 2 workers (every other cut of them, and these,
# in one process each: tests/jobs/test_lightning_cuts.py).


def test_sigkill_after_a_periodic_checkpoint_at_an_epochs_last_batch(single, tmp_path):
    # every_n_train_steps=6 divides the 12-batch epoch: the checkpoint at step 12 is at epoch
    # 0's last batch. Resumed from it, Lightning used to train 0 batches of epoch 1 (the loader
    # was iterated before set_epoch(1) moved it). Now every batch of every epoch, once, and the
    # weights; and it says what Lightning itself skips there (the epoch's end hooks).
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    options = ("--workers", "2", "--no-val", "--every", "6", "--epochs", "2")
    run(whole, *options)
    run(cut, *options, "--kill-at", "13", expect=-signal.SIGKILL)
    assert torch.load(cut / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 12
    # The resumed run is preempted in epoch 1 (SIGTERM after its batch 4) and saves after the
    # next step. It used to count epoch 1 as not started, so that a run resumed from that save
    # ran on_train_epoch_start again and counted batch_idx from 0, silently.
    stderr = run(cut, *options, "--signal-at", "16", expect=EXIT_CODE)
    assert "resuming from a checkpoint saved where Lightning cannot go on exactly" in stderr
    assert "skips the end of this epoch" in stderr
    assert torch.load(cut / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 17
    before = len(records(cut))
    assert "cannot go on exactly" not in run(cut, *options)
    after = records(whole)[[r.get("step") for r in records(whole)].index(17) + 1 :]
    assert records(cut)[before:] == after  # epoch 1 from its batch 5 on, as the whole run
    assert steps(cut) == steps(whole) and len(steps(whole)) == 24
    assert weights_equal(whole, cut)


def test_sigterm_inside_an_accumulation_window_saves_at_its_optimizer_step(tmp_path):
    # Windows of 3 batches: a SIGTERM to the process group after batch 7 (the window's first)
    # is acted on after batch 9, once the window's gradients are in an optimizer step.
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    options = ("--workers", "2", "--accumulate", "3", "--epochs", "2", "--every", "7")
    run(whole, *options)
    run(cut, *options, "--signal-at", "7", expect=EXIT_CODE)
    saved = torch.load(cut / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 3  # 9 batches
    stderr = run(cut, *options)
    assert "ExactResume" not in stderr  # nothing to warn about
    # The signalled run wrote what the whole run did up to its save (the end of batch 9), the
    # resumed run the rest: every batch, validation and epoch record of the whole run.
    assert records(cut) == records(whole)
    assert weights_equal(whole, cut)


def test_ddp_a_signal_on_one_rank_is_agreed_and_every_rank_saves_and_exits_75(tmp_path):
    # SIGTERM reaches rank 1 alone after batch 3 (of 6 an epoch per rank; Lightning validates
    # after it): the ranks agree on it at that validation's end, rank 0 writes last.ckpt there
    # (with both ranks' generators) and both exit 75; a rank acting on its own would leave the
    # other in a collective.
    cut = tmp_path / "cut"
    cut.mkdir()
    stderr = run(cut, "--signal-at", "3", "--signal-rank", "1", devices=2, expect=-1)
    assert len(re.findall(r"exitcode\s*: 75 ", stderr)) == 2, stderr[-3000:]
    saved = torch.load(cut / "ckpt" / "last.ckpt", weights_only=False)
    state = saved["callbacks"]["unbroken.ExactResume"]
    assert saved["global_step"] == 3 and state["saved_at"]["hook"] == "validation_end"
    assert len(state["ranks"]) == 2


def test_ddp_a_signal_on_one_rank_in_the_last_step_lets_every_rank_finish(tmp_path):
    # SIGTERM reaches rank 1 alone in the run's last step (batch 18 of 6 an epoch per rank, 3
    # epochs; Lightning validates after it): the run is complete at that validation's end. The
    # ranks agree that it ends there, save nothing and exit 0; a requeue would be for nothing.
    cut = tmp_path / "cut"
    cut.mkdir()
    stderr = run(cut, "--signal-at", "18", "--signal-rank", "1", devices=2)
    assert "preempted as the run ends: it finishes instead of saving" in stderr
    assert (cut / "final.pt").exists()
    saved = torch.load(cut / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 15  # ModelCheckpoint's (every 5 steps): none at 18


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


def test_atomic_checkpoint_io_on_s3_leaves_the_old_object_whole_when_a_write_fails(s3):
    io = AtomicCheckpointIO(storage_options=s3.storage_options)
    target = s3.make_bucket("lightning-io") + "/ckpt/last.ckpt"
    io.save_checkpoint({"step": 1, "weights": torch.ones(3)}, target)
    with pytest.raises(RuntimeError, match="halfway"):
        io.save_checkpoint({"step": 2, "weights": torch.zeros(1000), "bad": Unpicklable()}, target)
    assert io.load_checkpoint(target, weights_only=True)["step"] == 1
    io.remove_checkpoint(target)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(target)


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


def idle_trainer(tmp_path) -> L.Trainer:
    return L.Trainer(logger=False, default_root_dir=tmp_path, enable_progress_bar=False)


def test_generator_states_and_metrics_are_saved_and_put_back_at_train_start(tmp_path):
    callback, trainer = ExactResume(), idle_trainer(tmp_path)
    callback.setup(trainer, None, "fit")
    trainer.callback_metrics.update(val_loss=torch.tensor(0.25), steps=torch.tensor(3))
    torch.manual_seed(5)
    saved = callback.state_dict()
    expected = torch.rand(4)
    assert saved["version"] == 2 and len(saved["ranks"]) == 1
    assert saved["ranks"][0]["metrics"] == {
        "val_loss": {"value": 0.25, "dtype": "float32"},
        "steps": {"value": 3, "dtype": "int64"},
    }
    torch.manual_seed(6)
    later = idle_trainer(tmp_path)
    callback.load_state_dict(saved)
    assert not torch.equal(torch.rand(4), expected)  # not yet: Lightning still builds loaders
    callback.on_train_start(later, None)
    callback.preemption.uninstall()
    assert torch.equal(torch.rand(4), expected)
    metrics = later.callback_metrics
    assert metrics["val_loss"].dtype == torch.float32 and metrics["val_loss"].item() == 0.25
    assert metrics["steps"].dtype == torch.int64 and metrics["steps"].item() == 3


def test_a_version_1_state_still_loads(tmp_path):
    # unbroken 0.1's ExactResume saved the generators only: {"version": 1, "rng": [per rank]}.
    torch.manual_seed(5)
    rng = ExactResume().state_dict()["ranks"][0]["rng"]
    expected = torch.rand(4)
    torch.manual_seed(6)
    callback = ExactResume()
    callback.load_state_dict({"version": 1, "rng": [rng]})
    callback.on_train_start(idle_trainer(tmp_path), None)
    callback.preemption.uninstall()
    assert torch.equal(torch.rand(4), expected)


PLACE = {
    "hook": "train_batch_end",
    "accumulating": False,
    "validates_next": False,
    "last_batch": False,
    "epoch_end_steps": False,
}


@pytest.mark.parametrize(
    "state",
    [
        None,
        {},
        {"version": 3, "ranks": [{}]},
        {"version": 1, "rng": []},
        {"version": 1},
        {"version": 2, "ranks": [], "saved_at": PLACE},
        {"version": 2, "ranks": [{"rng": {}}], "saved_at": PLACE},
        {"version": 2, "ranks": [{"rng": {}, "metrics": {}, "epoch_metrics": []}]},
        {
            "version": 2,
            "ranks": [{"rng": {}, "metrics": {}, "epoch_metrics": []}],
            "saved_at": {**PLACE, "extra": 1},
        },
        {
            "version": 2,
            "ranks": [{"rng": {}, "metrics": {}, "epoch_metrics": []}],
            "saved_at": PLACE,
            "workers": {"train": ["2"]},
        },
        {
            "version": 2,
            "ranks": [{"rng": {}, "metrics": {}, "epoch_metrics": []}],
            "saved_at": PLACE,
            "should_stop": "yes",
        },
    ],
)
def test_a_malformed_callback_state_is_refused(state):
    with pytest.raises(CorruptState, match="ExactResume state"):
        ExactResume().load_state_dict(state)


def test_a_state_saved_before_the_worker_counts_and_the_later_places_still_loads(tmp_path):
    state = {k: v for k, v in ExactResume().state_dict().items() if k != "workers"}
    callback = ExactResume()
    callback.load_state_dict({**state, "saved_at": PLACE})  # PLACE: the fields of older saves
    callback.on_train_start(idle_trainer(tmp_path), None)
    callback.preemption.uninstall()


def test_worker_counts_that_cross_0_are_found():
    assert crossed({"train": [2], "val": [0]}, {"train": [0], "val": [0]}) == [
        "train loader 0: 2 -> 0"
    ]
    assert crossed({"train": [2], "val": [2]}, {"train": [1], "val": [0]}) == [
        "val loader 0: 2 -> 0"
    ]
    assert crossed({"train": [0]}, {"train": [0], "val": [3]}) == []


def test_the_states_of_another_world_size_load_with_a_warning():
    callback = ExactResume()
    state = callback.state_dict()
    with pytest.warns(UserWarning, match="random generators of 2 ranks and this job has 1"):
        callback.load_state_dict({**state, "ranks": state["ranks"] * 2})


@pytest.mark.parametrize(
    "place, lost",
    [
        ({}, []),
        ({"accumulating": True}, ["gradients accumulated so far"]),
        ({"validates_next": True}, ["skips the validation that follows"]),
        ({"last_batch": True}, ["skips the end of this epoch"]),
        ({"epoch_end_steps": True}, ["ReduceLROnPlateau steps"]),
        ({"validates_next": True, "last_batch": True}, ["validation", "end of this epoch"]),
    ],
)
def test_a_checkpoint_saved_where_lightning_does_not_go_on_exactly_warns_as_it_loads(place, lost):
    state = ExactResume().state_dict()
    state["saved_at"] = {**PLACE, **place}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ExactResume().load_state_dict(state)
    said = [str(w.message) for w in caught if "cannot go on exactly" in str(w.message)]
    assert len(said) == (1 if lost else 0)
    for phrase in lost:
        assert phrase in said[0]


class Tiny(L.LightningModule):
    """12 training batches an epoch (24 samples, batch 2); validation on the same samples."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))

    def train_dataloader(self):
        return unbroken.DataLoader(self.data, batch_size=2, shuffle=True, seed=0)

    def val_dataloader(self):
        return unbroken.DataLoader(self.data, batch_size=8)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def saved_places(tmp_path, saver: ModelCheckpoint, **options) -> dict[int, Place]:
    """Fit ``Tiny`` for 3 epochs with ``saver`` and ``ExactResume``: the place each checkpoint
    the saver wrote was taken at, by its step."""
    trainer = L.Trainer(
        max_epochs=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[ExactResume(), saver],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **options,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny())
    places = {}
    for path in tmp_path.glob("*.ckpt"):
        saved = torch.load(path, weights_only=False)
        state = saved["callbacks"]["unbroken.ExactResume"]["saved_at"]
        places[saved["global_step"]] = Place(**state)
    return places


@pytest.mark.parametrize(
    "every, accumulate, val_every",
    [(7, 1, 6), (8, 1, 6), (6, 1, 4), (5, 2, 4), (4, 3, 6), (2, 3, 6)],
)
def test_where_every_n_train_steps_saves_is_what_the_readme_says(
    tmp_path, every, accumulate, val_every
):
    # The README's rule: ModelCheckpoint(every_n_train_steps=n) saves after every n-th optimizer
    # step, at the end of the batch that made it: never inside an accumulation window; at an
    # epoch's last batch when the step is a multiple of the epoch's optimizer steps S; before a
    # validation when the step's batch is one Lightning validates after (val_check_interval=V
    # batches: the step's place in its epoch a multiple of V / accumulate). Checked against the
    # place ExactResume records in each checkpoint. (8, 1, 6): n neither divides the epoch nor
    # is a multiple of the validation interval, and still lands on an epoch's last batch.
    saver = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=every, save_top_k=-1)
    places = saved_places(
        tmp_path, saver, accumulate_grad_batches=accumulate, val_check_interval=val_every
    )
    per_epoch = -(-12 // accumulate)  # S: optimizer steps an epoch
    found = {step: (p.accumulating, p.last_batch, p.validates_next) for step, p in places.items()}
    expected = {}
    for step in range(every, 3 * per_epoch + 1, every):
        in_epoch = step % per_epoch  # 0: the epoch's last step
        expected[step] = (False, in_epoch == 0, (in_epoch * accumulate) % val_every == 0)
    assert found == expected


def test_saving_at_every_validation_end_is_exact_every_time(tmp_path):
    # The README's exact way to save every N batches: validate every N, save at each end.
    saver = ModelCheckpoint(tmp_path, "{step}", save_on_train_epoch_end=False, save_top_k=-1)
    places = saved_places(tmp_path, saver, val_check_interval=4)
    assert sorted(places) == list(range(4, 37, 4))
    assert all(p.hook == "validation_end" and p.exact for p in places.values())


def test_torch_loaders_in_the_fit_are_warned_about(tmp_path):
    # Every loader of the fit must be an unbroken.DataLoader: torch's training loader restarts
    # its epoch on resume, and torch's workers die of a SIGTERM to the process group.
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=4)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(data, batch_size=4, num_workers=1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[ExactResume()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Model())
    said = " ".join(str(w.message) for w in caught if "ExactResume" in str(w.message))
    assert "the training loader is torch's DataLoader" in said
    assert "a val loader is torch's DataLoader with num_workers=1" in said


@pytest.mark.parametrize("check_every", [0, -1, 1.5, True])
def test_check_every_must_be_a_positive_int(check_every):
    with pytest.raises(ValueError, match="check_every"):
        ExactResume(check_every=check_every)


def test_a_sigterm_in_an_epochs_last_step_of_a_run_bounded_by_max_steps(tmp_path):
    # Found by benchmarks/goodput.py: bounded by max_steps, Lightning resumed a checkpoint of an
    # epoch's end by training one more batch in that epoch and skipping to the epoch after the
    # next: ExactResume saved there on a SIGTERM, and the resumed run trained 8 samples twice
    # and 8 never. Its preemption save now waits for the next epoch's first step.
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    options = ("--no-val", "--max-steps", "30", "--epochs", "-1")
    run(whole, *options)
    run(cut, *options, "--signal-at", "12", expect=EXIT_CODE)  # 12 batches an epoch
    saved = torch.load(cut / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 13  # at the end of the next epoch's first step
    assert "cannot go on exactly" not in run(cut, *options)
    assert steps(cut) == steps(whole)
    assert weights_equal(whole, cut)
    # A checkpoint of that epoch end (Lightning's ModelCheckpoint may save one) says so on load.
    place = Place("train_epoch_end", by_max_steps=True)
    assert not place.exact and "max_steps" in place.problems()[0]
