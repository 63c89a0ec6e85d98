"""The data-parallel job: torchrun trains on scikit-learn's digits on 2 CPU ranks, kill, compare.

`make demo-ddp` runs this file. torchrun (gloo backend, CPU) starts it on every rank with
`--worker DIR OPTIONS`: an unbroken.Trainer run of a DistributedDataParallel MLP with dropout,
SGD with momentum, a cosine LR schedule stepped per epoch, torchmetrics accuracy for training
and validation. The shuffled unbroken.DataLoader splits one global order across the ranks by
itself, with random augmentation (torch, numpy and `random` draws). Every rank logs the ids of
the samples it trained on.

The driver runs torchrun three ways, in `demo_output/ddp/`:

1. 2 ranks, never interrupted: the reference.
2. 2 ranks with `--max-restarts=3`: rank 1 SIGKILLs itself once in each epoch, at a random
   training batch, one of the three times in the middle of writing a checkpoint file; torchrun
   stops the other rank and starts the group again, which resumes from the newest whole
   checkpoint. Verdict: final weights and every logged value bit for bit those of (1), or the
   first difference.
3. 2 ranks, SIGTERM to rank 1 alone in the middle of epoch 1: the ranks agree, save the same
   step and exit with 75. Copies of that run directory are continued on 1 rank and on 3 ranks.
   Verdict: in each, every sample of every epoch trained on exactly once, or which were not.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from train_digits import compare_runs  # the main demo's (demo/ is on sys.path)

import unbroken

OUTPUT = Path(__file__).resolve().parent.parent / "demo_output" / "ddp"
EPOCHS, BATCH, VAL_BATCH, SEED = 3, 16, 56, 7
# 1440 training and 336 validation images of the 1797: multiples of 48, so that the global
# batches of 1, 2 and 3 ranks (16, 32, 48 samples; 56, 112, 168 for validation) divide them and
# no rank repeats a sample to fill the last one (the loader would, as DistributedSampler pads).
TRAIN, VAL = 1440, 336
PER_EPOCH = TRAIN // (2 * BATCH)  # 45 global batches per epoch on 2 ranks
# The ranks agree on a signal with the next batch's gradients, so the signal after epoch 1's
# batch 20 is saved after its batch 21: 768 samples left, 16 global batches on 3 ranks.
PREEMPT_AT = PER_EPOCH + 20
KILLED_RANK = 1


class Digits(torch.utils.data.Dataset):
    """scikit-learn's bundled 8x8 digits (no download), with random augmentation; a sample is
    (image, label, its index), the index for the per-sample accounting."""

    def __init__(self, train: bool) -> None:
        digits = torch.load(OUTPUT / "digits.pt", weights_only=True)  # written by the driver
        images, labels = digits["images"], digits["labels"]
        split = slice(0, TRAIN) if train else slice(TRAIN, TRAIN + VAL)
        self.images, self.labels, self.augment = images[split], labels[split], train

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image = self.images[index]
        if self.augment:  # the loader seeds these generators per sample: exact after a resume
            dy, dx = torch.randint(-1, 2, (2,)).tolist()  # shift by up to a pixel (torch RNG)
            image = torch.roll(image, shifts=(dy, dx), dims=(0, 1))
            image = image * random.uniform(0.8, 1.2)  # contrast (random)
            image = image + torch.from_numpy(np.random.normal(0, 0.05, image.shape)).float()
        return image.flatten(), self.labels[index], index


class Chaos:
    """A callback on every rank: logs the sample ids this rank trained on, and on rank 1 kills
    the process where the options say, each kill once over all of torchrun's restarts."""

    def __init__(self, run: Path, rank: int, world: int, options: dict) -> None:
        self.run, self.rank, self.world = run, rank, world
        mine = rank == KILLED_RANK
        self.kill_at = set(options.get("kill", [])) if mine else set()
        self.kill_in_save = options.get("kill_in_save") if mine else None
        self.sigterm_at = options.get("sigterm") if mine else None
        self.seen = open(run / f"seen.rank{rank}.jsonl", "a")
        self.ids: list[int] = []
        self.trainer: unbroken.Trainer | None = None
        self.writes = 0  # file writes of the checkpoint being saved, on this rank
        if self.kill_in_save is not None:
            from unbroken.checkpoint import LocalStorage

            write = LocalStorage.write

            def dying_write(storage_self, path, fill):
                self.writes += 1
                if self.writes == 2 and self._due_in_save():
                    data = io.BytesIO()
                    fill(data)
                    with open(path, "xb") as file:  # half the file, as a crash would leave it
                        file.write(data.getvalue()[: len(data.getvalue()) // 2])
                    where = self.trainer.progress.where() if self.trainer else "?"
                    self._die(
                        signal.SIGKILL,
                        f"SIGKILL to rank {rank} halfway through writing "
                        f"{Path(path).parent.name}/{Path(path).name} (after {where})",
                    )
                return write(storage_self, path, fill)

            LocalStorage.write = dying_write

    def _due_in_save(self) -> bool:
        batches = self.trainer.progress.batches if self.trainer else 0
        return batches >= self.kill_in_save and self._once("kill-in-save")

    def _once(self, name: str) -> bool:
        marker = self.run / f".done-{name}"  # survives the restarts
        if marker.exists():
            return False
        marker.touch()
        return True

    def _die(self, sig: signal.Signals, message: str) -> None:
        print(f"demo: {message}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), sig)

    def on_save_start(self, trainer) -> None:
        self.writes = 0

    def on_train_batch_end(self, trainer, logs) -> None:
        progress = trainer.progress
        self.seen.write(json.dumps([progress.epoch, self.world, self.ids]) + "\n")
        self.seen.flush()
        if progress.batches in self.kill_at and self._once(f"kill-{progress.batches}"):
            self._die(signal.SIGKILL, f"SIGKILL to rank {self.rank} after {progress.where()}")
        if progress.batches == self.sigterm_at and self._once("sigterm"):
            self._die(signal.SIGTERM, f"SIGTERM to rank {self.rank} after {progress.where()}")


def worker(run: Path, options: dict) -> None:
    """One rank of the job (torchrun starts one per rank); resumes from the newest checkpoint in
    `run` if any."""
    import torch.distributed as dist
    from torchmetrics.classification import MulticlassAccuracy

    import unbroken.distributed

    torch.set_num_threads(1)
    # Not torch's: under torchrun --max-restarts it can read an address of the previous attempt.
    unbroken.distributed.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run.mkdir(parents=True, exist_ok=True)
    chaos = Chaos(run, rank, world, options)

    torch.manual_seed(SEED)  # the same initial weights on every rank; a resume loads its own
    # Dropout draws from each rank's own torch RNG, which the Trainer checkpoints per rank.
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    model = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS)
    # No rank= or world_size=: under an initialized process group the loaders split by themselves.
    train_loader = unbroken.DataLoader(
        Digits(train=True), batch_size=BATCH, shuffle=True, seed=SEED
    )
    val_loader = unbroken.DataLoader(Digits(train=False), batch_size=VAL_BATCH, seed=SEED)
    train_acc, val_acc = MulticlassAccuracy(10), MulticlassAccuracy(10)

    def training_step(model, batch):
        images, labels, ids = batch
        chaos.ids = ids.tolist()
        logits = model(images)
        train_acc.update(logits.detach(), labels)
        return nn.functional.cross_entropy(logits, labels)

    def validation_step(model, batch):
        images, labels, _ids = batch
        logits = model(images)
        val_acc.update(logits, labels)
        return nn.functional.cross_entropy(logits, labels)

    trainer = unbroken.Trainer(
        run,
        max_epochs=EPOCHS,
        seed=SEED,
        checkpoint_every_steps=10,
        scheduler_interval="epoch",
        callbacks=[chaos],
        progress_bar=False,
        tensorboard=False,
    )
    chaos.trainer = trainer
    logs = trainer.fit(
        model,
        optimizer,
        train_loader,
        val_loader,
        scheduler=scheduler,
        training_step=training_step,
        validation_step=validation_step,
        train_metrics={"accuracy": train_acc},
        val_metrics={"accuracy": val_acc},
    )
    if rank == 0:
        torch.save(net.state_dict(), run / "final_weights.pt")
        (run / "logs.json").write_text(json.dumps(logs))
    chaos.trainer = None  # the DDP model goes before its process group (README: torchrun)
    del trainer, model, optimizer, scheduler
    dist.destroy_process_group()


def torchrun(run: Path, options: dict, ranks: int, restarts: int = 0) -> tuple[int, str, float]:
    """Run the job under torchrun; (exit code, its output, seconds). The output goes to
    demo_output/ddp/<run>.log too."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={ranks}", f"--max-restarts={restarts}"]
    command += [__file__, "--worker", str(run), json.dumps(options)]
    started = time.perf_counter()
    result = subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=600,
    )
    seconds = time.perf_counter() - started
    run.with_suffix(".log").write_text(result.stdout)
    return result.returncode, result.stdout, seconds


def _narrate(output: str, restarts: bool = False) -> None:
    """The job's own lines (the Trainer's and the kills'), and torchrun's restarts, in order."""
    error = None  # the last exception another rank stopped with
    for line in output.splitlines():
        if line.startswith(("unbroken: ", "demo: ")):
            print(f"    {line.split(': ', 1)[1].replace(f'{OUTPUT}/', '')}")
        elif found := re.match(r"\[rank(\d+)\]: ([\w.]+(?:Error|Failure)): ", line):
            error = f"rank {found[1]} failed with {found[2].rsplit('.', 1)[-1]}"
        elif restarts and (
            found := re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", line)
        ):
            others = error or "the other was stopped by torchrun"
            print(f"    torchrun: rank {found[2]} exited with {found[1]} ({others}); restarting")
            error = None


def _failed(name: str, code: int, output: str, run: Path) -> int:
    print(output[-3000:])
    print(f"torchrun ({name}) exited with {code}; its whole output: {run.with_suffix('.log')}")
    return 1


def main(kill_seed: int) -> int:
    started = time.perf_counter()
    from sklearn.datasets import load_digits

    shutil.rmtree(OUTPUT, ignore_errors=True)
    OUTPUT.mkdir(parents=True)
    digits = load_digits()  # once here: importing scikit-learn in every rank takes seconds
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    torch.save({"images": images, "labels": torch.tensor(digits.target)}, OUTPUT / "digits.pt")
    timings: list[tuple[str, float]] = []
    # One kill per epoch at a random training batch (seeded: --kill-seed picks others), one of
    # them in the second file write of rank 1's next checkpoint (a save every 10 steps).
    rng = random.Random(kill_seed)
    kinds = ["SIGKILL", "SIGKILL", "in a checkpoint write"]
    rng.shuffle(kinds)
    points = [epoch * PER_EPOCH + rng.randint(3, PER_EPOCH - 8) for epoch in range(EPOCHS)]
    kill = [at for at, kind in zip(points, kinds) if kind == "SIGKILL"]
    kill_in_save = next(at for at, kind in zip(points, kinds) if kind != "SIGKILL")
    print(
        f"unbroken DDP demo: torchrun, 2 CPU ranks (gloo), {EPOCHS} epochs of a DDP MLP with "
        f"dropout on {TRAIN} of scikit-learn's digits, augmentation, validation on {VAL}; "
        f"{PER_EPOCH} global batches of 2 x {BATCH} per epoch, a checkpoint every 10 steps "
        f"(in {OUTPUT})"
    )

    print("1. 2 ranks, uninterrupted (the reference)")
    reference = OUTPUT / "uninterrupted"
    code, output, seconds = torchrun(reference, {}, ranks=2)
    if code != 0:
        return _failed("uninterrupted", code, output, reference)
    _narrate(output)
    timings.append(("uninterrupted", seconds))

    print(
        f"2. 2 ranks, torchrun --max-restarts=3: rank 1 SIGKILLs itself once per epoch, after "
        f"global batches {' and '.join(map(str, kill))}, and halfway through a checkpoint file "
        f"in the first save from batch {kill_in_save} on (points from --kill-seed {kill_seed})"
    )
    killed = OUTPUT / "killed"
    options = {"kill": kill, "kill_in_save": kill_in_save}
    code, output, seconds = torchrun(killed, options, ranks=2, restarts=3)
    if code != 0:
        return _failed("killed", code, output, killed)
    _narrate(output, restarts=True)
    restarts = output.count("exitcode: -9")
    leftovers = [p.name for p in (killed / "checkpoints").glob(".tmp*")]
    print(
        f"    finished after {restarts} restarts; partial checkpoints left: {leftovers or 'none'}"
    )
    timings.append((f"killed {restarts} times", seconds))
    code, message = compare_runs(killed, reference)
    identical, verdicts = (code, f"killed 2-rank job vs uninterrupted: {message}"), []

    print(f"3. 2 ranks, SIGTERM to rank 1 alone after global batch {PREEMPT_AT} (epoch 1)")
    preempted = OUTPUT / "preempted"
    code, output, seconds = torchrun(preempted, {"sigterm": PREEMPT_AT}, ranks=2)
    if f"exitcode: {unbroken.EXIT_CODE}" not in output:
        return _failed("preempted", code, output, preempted)
    _narrate(output)
    timings.append(("preempted", seconds))
    for ranks in (1, 3):
        name = f"continued on {ranks} rank{'s' * (ranks > 1)}"
        print(f"   a copy of its directory {name}")
        run = OUTPUT / f"preempted_on{ranks}"
        shutil.copytree(preempted, run)
        code, output, seconds = torchrun(run, {}, ranks=ranks)
        if code != 0:
            return _failed(name, code, output, run)
        _narrate(output)
        timings.append((name, seconds))
        verdicts.append(_each_sample_once(run, name))

    accuracy = {
        name: json.loads((OUTPUT / name / "logs.json").read_text())["val/accuracy"]
        for name in ("uninterrupted", "killed", "preempted_on1", "preempted_on3")
    }
    print("verdict:")
    for _code, message in [identical, *verdicts]:
        print(f"  {message}")
    print(
        "  validation accuracy at the end: "
        f"uninterrupted {accuracy['uninterrupted']:.4f}, killed {accuracy['killed']:.4f}, "
        f"continued on 1 rank {accuracy['preempted_on1']:.4f}, "
        f"on 3 ranks {accuracy['preempted_on3']:.4f}"
    )
    print(
        "  times: "
        + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings)
        + f"; {time.perf_counter() - started:.0f} s in all (torchrun logs: {OUTPUT}/*.log)"
    )
    return max(code for code, _message in [identical, *verdicts])


def _each_sample_once(run: Path, name: str) -> tuple[int, str]:
    """Counts, per epoch, the sample ids every rank trained on (the copy holds the 2-rank job's
    records from before the SIGTERM too; it was never SIGKILLed, so none was trained twice)."""
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    by_world: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in sorted(run.glob("seen.rank*.jsonl")):
        for epoch, world, ids in map(json.loads, path.read_text().splitlines()):
            counts[epoch].update(ids)
            by_world[epoch][world] += len(ids)
    wrong = []
    for epoch in range(EPOCHS):
        count = counts[epoch]
        missing = [i for i in range(TRAIN) if count[i] == 0]
        repeated = sorted(i for i, n in count.items() if n > 1)
        foreign = sorted(i for i in count if not 0 <= i < TRAIN)
        split = ", ".join(
            f"{n} on {world} rank{'s' * (world > 1)}"
            for world, n in sorted(by_world[epoch].items())
        )
        if missing or repeated or foreign:
            wrong.append(epoch)
            print(
                f"    epoch {epoch}: NOT each sample once: {len(missing)} never trained on "
                f"{missing[:10]}, {len(repeated)} more than once {repeated[:10]}, "
                f"{len(foreign)} unknown ids {foreign[:10]} ({split})"
            )
        else:
            print(f"    epoch {epoch}: each of the {TRAIN} samples exactly once ({split})")
    if wrong:
        return 1, f"NOT EXACTLY ONCE: {name}, epochs {wrong} (above)"
    return 0, (
        f"EXACTLY ONCE: 2 ranks preempted, {name}: each of the {TRAIN} samples trained on "
        f"once in each of the {EPOCHS} epochs"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("DIR", "OPTIONS"), help=argparse.SUPPRESS)
    parser.add_argument("--kill-seed", type=int, default=SEED, help="picks the kill points")
    arguments = parser.parse_args()
    if arguments.worker:
        directory, options = arguments.worker
        worker(Path(directory), json.loads(options))
    else:
        sys.exit(main(arguments.kill_seed))
