"""The main job: train a convnet on scikit-learn's digits, SIGKILL it again and again, compare.

`make demo` runs this file. The training process (`--train DIR`) is an unbroken.Trainer run:
shuffled loader with random augmentation (torch, numpy and `random` draws) and 2 workers,
dropout, SGD with momentum, a OneCycle LR schedule stepped per batch, gradient accumulation
over 2 batches, gradient clipping, torchmetrics accuracy for training and validation.

The driver starts it, SIGKILLs it at several random moments (one inside a checkpoint write, one
during validation, the others anywhere), once sends SIGTERM to its whole process group (as
`docker stop`, Kubernetes and SLURM do: the loader workers get it too), and restarts the same
command each time until training completes. Then it trains once more, uninterrupted, in another directory, and prints the verdict:
final weights and every logged value identical bit for bit, or the first difference. It writes
`demo_output/loss_curves.png` with both loss curves and the kill points.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import unbroken

OUTPUT = Path(__file__).resolve().parent.parent / "demo_output"
EPOCHS, BATCH, SEED = 5, 32, 7


class Digits(torch.utils.data.Dataset):
    """scikit-learn's bundled 8x8 digits (real data, no download), with random augmentation."""

    def __init__(self, train: bool) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
        labels = torch.tensor(digits.target)
        split = slice(0, 1500) if train else slice(1500, None)
        self.images, self.labels, self.augment = images[split], labels[split], train

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image = self.images[index].unsqueeze(0)
        if self.augment:
            dy, dx = torch.randint(-1, 2, (2,)).tolist()  # shift by up to a pixel (torch RNG)
            image = torch.roll(image, shifts=(dy, dx), dims=(1, 2))
            image = image * random.uniform(0.8, 1.2)  # contrast (random)
            image = image + torch.from_numpy(np.random.normal(0, 0.05, image.shape)).float()
        return image, self.labels[index]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(0.2),
            nn.Linear(32 * 4 * 4, 10),
        )

    def forward(self, x):
        return self.net(x)


class Status:
    """Tells the driver where the run is (phase and batch), so it can aim its kills."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _write(self, text: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)

    def on_train_batch_end(self, trainer, logs) -> None:
        self._write(f"train {trainer.progress.batches}")

    def on_validation_batch_end(self, trainer, logs) -> None:
        self._write(f"val {trainer.progress.batches}")

    def on_save_start(self, trainer) -> None:
        self._write(f"saving {trainer.progress.batches}")


def train(
    directory: Path | str,
    local: Path | None = None,
    storage_options: dict | None = None,
    callbacks: tuple = (),
    **options,
) -> None:
    """One training process: resumes from the newest checkpoint in `directory` if any. `local`
    (default: `directory`) gets the status file and the final weights: the machine's own disk
    when `directory` is a URL in object storage (`train_digits_spot.py`)."""
    local = Path(directory) if local is None else local
    from torchmetrics.classification import MulticlassAccuracy

    torch.set_num_threads(1)
    torch.manual_seed(SEED)  # model init; a resumed run takes the weights from its checkpoint
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_loader = unbroken.DataLoader(
        Digits(train=True),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        seed=SEED,
    )
    val_loader = unbroken.DataLoader(Digits(train=False), batch_size=100, seed=SEED)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.1, total_steps=EPOCHS * len(train_loader) // 2 + EPOCHS
    )
    train_acc, val_acc = MulticlassAccuracy(10), MulticlassAccuracy(10)

    def training_step(model, batch):
        images, labels = batch
        logits = model(images)
        train_acc.update(logits, labels)
        return nn.functional.cross_entropy(logits, labels)

    def validation_step(model, batch):
        images, labels = batch
        logits = model(images)
        val_acc.update(logits, labels)
        return nn.functional.cross_entropy(logits, labels)

    trainer = unbroken.Trainer(
        directory,
        max_epochs=EPOCHS,
        seed=SEED,
        checkpoint_every_steps=5,
        log_every=1,  # every batch's loss in metrics.csv: the curves of loss_curves.png
        accumulate=2,
        clip_grad_norm=1.0,
        callbacks=[Status(local / "status"), *callbacks],
        storage_options=storage_options,
        **options,
    )
    trainer.fit(
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
    torch.save(model.state_dict(), local / "final_weights.pt")


def main() -> int:
    shutil.rmtree(OUTPUT, ignore_errors=True)
    interrupted, reference = OUTPUT / "interrupted", OUTPUT / "uninterrupted"
    command = [sys.executable, __file__, "--train"]
    rng = random.Random()
    started = time.perf_counter()
    # Kill moments: inside a checkpoint write, during validation, three at random batches, and
    # a preemption: SIGTERM to the process group, after which the run saves and exits with 75.
    targets = ["saving", "val", "random", "random", "random", "preempt"]
    rng.shuffle(targets)
    kills: list[tuple[int, str]] = []
    print(
        f"unbroken demo: {EPOCHS} epochs of a convnet on scikit-learn's digits, 2 loader "
        f"workers, augmentation, dropout, accumulation; SIGKILL at {len(targets) - 1} moments "
        "and one SIGTERM to the whole process group"
    )
    batch = 0
    while True:
        (interrupted / "status").unlink(missing_ok=True)
        # A session of its own: the process group a scheduler would signal.
        process = subprocess.Popen([*command, str(interrupted)], start_new_session=True)
        target = targets[len(kills)] if len(kills) < len(targets) else None
        if target is not None and _kill_when(
            process, interrupted, target, batch + rng.randint(5, 40)
        ):
            phase, batch_text = (interrupted / "status").read_text().split()
            batch = int(batch_text)
            kills.append((batch, "SIGTERM" if target == "preempt" else phase))
            if target == "preempt":
                if process.returncode != unbroken.EXIT_CODE:
                    print(
                        f"training process exited with {process.returncode} after SIGTERM, "
                        f"not {unbroken.EXIT_CODE}"
                    )
                    return 1
                print(
                    f"  SIGTERM to the process group during {phase} at training batch {batch}: "
                    f"checkpoint committed, exit code {process.returncode}; restarting"
                )
                continue
            leftovers = [p.name for p in (interrupted / "checkpoints").glob(".*")]
            note = f" (its partial checkpoint {leftovers[0]} is ignored)" if leftovers else ""
            print(f"  SIGKILL during {phase} at training batch {batch}{note}; restarting")
            continue
        if process.wait() != 0:
            print(f"training process failed with exit code {process.returncode}")
            return 1
        break
    print(f"  interrupted run finished after {len(kills)} kills and {len(kills) + 1} processes")
    subprocess.run([*command, str(reference)], check=True)
    print(f"  uninterrupted run finished ({time.perf_counter() - started:.0f} s in all)")
    verdict, text = compare_runs(interrupted, reference)
    print(text)
    _plot(interrupted, reference, kills, OUTPUT / "loss_curves.png")
    print(f"  loss curves with kill points: {OUTPUT / 'loss_curves.png'}")
    return verdict


def _kill_when(process: subprocess.Popen, directory: Path, target: str, earliest: int) -> bool:
    """SIGKILL `process` at the first moment matching `target` from training batch `earliest` on;
    False if it finished first."""
    status_file, checkpoints = directory / "status", directory / "checkpoints"
    while process.poll() is None:
        try:
            phase, batch = status_file.read_text().split()
        except (FileNotFoundError, ValueError):
            phase, batch = "", "0"
        if target == "saving":  # the checkpointer writes into a hidden temporary directory
            writing = any(p.name.startswith(".tmp") for p in checkpoints.glob(".*"))
            hit = int(batch) >= earliest and writing
        else:
            hit = int(batch) >= earliest and (target in ("random", "preempt") or phase == target)
        if hit and target == "preempt":
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
            return True
        if hit:
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        time.sleep(0.0005)
    return False


def compare_runs(interrupted: Path, reference: Path) -> tuple[int, str]:
    """(0, "IDENTICAL: ...") or (1, "DIFFERENT: " and the first difference): the final
    weights (every tensor, ``torch.equal``) and ``metrics.csv`` byte for byte. Shared by the
    demos (``train_digits_ddp``, ``train_digits_stream``)."""
    weights = torch.load(interrupted / "final_weights.pt", weights_only=True)
    expected = torch.load(reference / "final_weights.pt", weights_only=True)
    if weights.keys() != expected.keys():
        return 1, "DIFFERENT: the final weights have other tensors"
    for name, tensor in expected.items():
        if not torch.equal(weights[name], tensor):
            return 1, f"DIFFERENT: final weight {name} differs from the uninterrupted run's"
    got, want = (interrupted / "metrics.csv").read_bytes(), (reference / "metrics.csv").read_bytes()
    lines = list(zip(got.decode().splitlines(), want.decode().splitlines()))
    for i, (a, b) in enumerate(lines):
        if a != b:
            return 1, f"DIFFERENT: metrics.csv line {i + 1}: {a!r} != {b!r}"
    if got != want:
        return (
            1,
            f"DIFFERENT: metrics.csv has {len(got)} bytes, the uninterrupted run's {len(want)}",
        )
    return 0, (
        f"IDENTICAL: all {len(expected)} final weight tensors (torch.equal) and metrics.csv byte "
        f"for byte ({len(lines) - 1} logged values) are those of the uninterrupted run"
    )


def _plot(interrupted: Path, reference: Path, kills: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run, style, label in (
        (reference, "-", "uninterrupted"),
        (interrupted, "--", "killed and resumed"),
    ):
        with open(run / "metrics.csv", newline="") as log:  # step,epoch,phase,name,value
            rows = [r for r in csv.DictReader(log) if (r["phase"], r["name"]) == ("train", "loss")]
        steps, losses = [int(r["step"]) for r in rows], [float(r["value"]) for r in rows]
        ax.plot(steps, losses, style, label=label, lw=1)
    for i, (batch, target) in enumerate(kills):  # target: the phase it hit, or "SIGTERM"
        ax.axvline(batch, color="red", alpha=0.6, lw=1, label="kill" if i == 0 else None)
        what = "SIGTERM (group)" if target == "SIGTERM" else f"SIGKILL, {target}"
        ax.text(
            batch,
            ax.get_ylim()[0],
            f" {what}",
            color="red",
            fontsize=8,
            rotation=90,
            va="bottom",
            ha="right",
        )
    ax.set(xlabel="training batch", ylabel="training loss", title="unbroken: identical loss curves")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, help="run one training process in this directory")
    arguments = parser.parse_args()
    if arguments.train:
        train(arguments.train)
    else:
        sys.exit(main())
