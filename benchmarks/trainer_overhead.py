"""Training-loop overhead of unbroken.Trainer against a plain PyTorch loop, side by side.

How it measures, and what the numbers mean: ``docs/benchmarks/trainer-overhead.md``.

    .venv/bin/python benchmarks/trainer_overhead.py            # full run, ~2-3 minutes
    .venv/bin/python benchmarks/trainer_overhead.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, add_options, command_line, environment
from harness import parser as harness_parser
from harness.stats import interleaved
from harness.workloads import (
    ImageDataset,
    RowDataset,
    cnn_loss,
    cnn_model,
    flat_weights,
    tiny_loss,
    tiny_model,
)

import unbroken
import unbroken.train
from unbroken.train.globalrng import TRAIN, seed_step

# --------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    dataset: torch.utils.data.Dataset
    batch_size: int
    epochs: int
    base: torch.nn.Module  # every run trains its own copy
    step: object
    lr: float

    def fresh(self):
        """A model copy, its optimizer and a new loader: the same start for every run."""
        model = copy.deepcopy(self.base)
        optimizer = torch.optim.SGD(model.parameters(), lr=self.lr)
        loader = unbroken.DataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=True, num_workers=0, seed=0
        )
        return model, optimizer, loader


def make_workload(name: str, args) -> Workload:
    torch.manual_seed(0)
    if name == "boring":
        return Workload(
            name, RowDataset(args.boring_rows), 2, args.boring_epochs, tiny_model(), tiny_loss, 0.1
        )
    if name == "cnn":
        return Workload(
            name,
            ImageDataset(args.cnn_images, augment=False),
            32,
            args.cnn_epochs,
            cnn_model(),
            cnn_loss,
            0.01,
        )
    raise SystemExit(f"unknown workload {name!r}: expected boring or cnn")


# --------------------------------------------------------------------------- the loops

NO_CHECKPOINTS = "Trainer, checkpoint_every_steps=None"
# The exactness floor: the plain loop making the calls the Trainer makes to seed each step's
# randomness from (seed, epoch, step, rank). Its ratio is what exactness costs; the Trainer's
# rows over it, what the rest of the Trainer costs.
CONTROL = "control: plain loop + the Trainer's per-step seeding"
SEEDED = "seeded"  # the control's "options"
# The Trainer's options, read where they are declared (its keywords are **options: Unpack of
# them, which a signature does not list); older versions took them as plain parameters.
_TRAINER_OPTIONS = getattr(unbroken.train, "TrainerOptions", None)
if _TRAINER_OPTIONS is not None and dataclasses.is_dataclass(_TRAINER_OPTIONS):
    _OPTIONS = {field.name: field.default for field in dataclasses.fields(_TRAINER_OPTIONS)}
else:
    _OPTIONS = {
        name: parameter.default
        for name, parameter in inspect.signature(unbroken.Trainer).parameters.items()
    }
HAS_TENSORBOARD_ARG = "tensorboard" in _OPTIONS
LOG_EVERY = _OPTIONS.get("log_every")  # None: every batch


def variants(tensorboard: str) -> list[tuple[str, dict | str | None]]:
    """(label, Trainer keyword arguments; None for the plain loop, SEEDED for the control), in
    the order run."""
    chosen = {} if tensorboard == "default" else {"tensorboard": tensorboard == "on"}
    out: list[tuple[str, dict | str | None]] = [
        ("plain loop", None),
        (CONTROL, SEEDED),
        (
            NO_CHECKPOINTS,
            {"checkpoint_every_steps": None, "checkpoint_every_seconds": None, **chosen},
        ),
    ]
    if HAS_TENSORBOARD_ARG and tensorboard != "off":  # what the TensorBoard logging costs
        out.append(
            (
                "Trainer, checkpoint_every_steps=None, tensorboard=False",
                {
                    "checkpoint_every_steps": None,
                    "checkpoint_every_seconds": None,
                    "tensorboard": False,
                },
            )
        )
    out += [
        ("Trainer, checkpoint_every_steps=100", {"checkpoint_every_steps": 100, **chosen}),
        ("Trainer, checkpoint_every_steps=1000", {"checkpoint_every_steps": 1000, **chosen}),
        (
            "Trainer, checkpoint_every_steps=100, async_save",
            {"checkpoint_every_steps": 100, "async_save": True, **chosen},
        ),
    ]
    return out


@dataclass
class Run:
    loop: float  # seconds in the training loop
    total: float  # seconds of the whole fit() (the loop for the plain one)
    steps: int
    saves: int  # periodic checkpoints taken inside the timed loop
    weights: torch.Tensor
    tensorboard: bool = False  # the Trainer wrote TensorBoard events


def run_plain(work: Workload, seeded: bool = False) -> Run:
    model, optimizer, loader = work.fresh()
    torch.manual_seed(0)  # as the Trainer seeds at its start (nothing here draws from it)
    step, steps = work.step, 0
    start = time.perf_counter()
    for epoch in range(work.epochs):
        for batch in loader:
            if seeded:  # what the Trainer calls before each step (seed 0, rank 0)
                seed_step(0, TRAIN, epoch, steps, 0)
            loss = step(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    loop = time.perf_counter() - start
    return Run(loop, loop, steps, 0, flat_weights(model))


class Clock:
    """Trainer callback: when the loop starts and ends, and the saves taken inside it."""

    on_train_batch_end = None  # found at once and skipped: the cheapest a callback can be

    def __init__(self) -> None:
        self.start = self.end = None
        self.saves = self.saves_in_loop = 0

    def on_fit_start(self, trainer) -> None:
        self.start = time.perf_counter()

    def on_epoch_end(self, trainer, logs) -> None:
        self.end = time.perf_counter()
        self.saves_in_loop = self.saves  # the end-of-fit save comes after the last epoch's end

    def on_save_start(self, trainer) -> None:
        self.saves += 1


def run_trainer(work: Workload, options: dict, parent: str | None) -> Run:
    model, optimizer, loader = work.fresh()
    directory = tempfile.mkdtemp(prefix="unbroken-trainer-overhead-", dir=parent)
    try:
        clock = Clock()
        trainer = unbroken.Trainer(
            directory,
            max_epochs=work.epochs,
            seed=0,
            progress_bar=False,
            callbacks=[clock],
            **options,
        )
        start = time.perf_counter()
        trainer.fit(model, optimizer, loader, training_step=work.step)
        total = time.perf_counter() - start
        steps = trainer.progress.batches
        run_log = getattr(trainer, "run_log", trainer)  # older versions kept `board` themselves
        board = getattr(run_log, "board", None) is not None
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return Run(
        clock.end - clock.start, total, steps, clock.saves_in_loop, flat_weights(model), board
    )


def run_variant(work: Workload, options: dict | str | None, parent: str | None) -> Run:
    if not isinstance(options, dict):
        return run_plain(work, seeded=options == SEEDED)
    return run_trainer(work, options, parent)


# --------------------------------------------------------------------------- measurement


def bench(work: Workload, args) -> tuple[list[list[str]], list[str], list[dict]]:
    """Rows of the result table for one workload, notes on how it went, and the same numbers
    per variant for the JSON results."""
    labels = [label for label, _ in variants(args.tensorboard)]
    options = dict(variants(args.tensorboard))
    for label in labels:  # warm-up round, untimed
        run_variant(work, options[label], args.dir)

    mismatches = []

    def check(r: int, this_round: dict[str, Run]) -> None:
        plain = this_round[labels[0]]
        for label, run in this_round.items():
            if run.steps != plain.steps:
                mismatches.append(f"{label}: {run.steps} steps, plain {plain.steps}")
            elif not torch.equal(run.weights, plain.weights):
                mismatches.append(
                    f"{label}: final weights differ from the plain loop's (round {r})"
                )
        print(f"[{work.name}: round {r + 1}/{args.reps}]", file=sys.stderr, flush=True)

    run_one = lambda label: run_variant(work, options[label], args.dir)
    rounds, foreign = interleaved(labels, run_one, args.reps, check)
    plain_us = statistics.median(rd[labels[0]].loop / rd[labels[0]].steps for rd in rounds) * 1e6
    rows, entries = [], []
    per_save = {}
    for label in labels:
        runs = [rd[label] for rd in rounds]
        us = [run.loop / run.steps * 1e6 for run in runs]
        ratio = [rd[label].loop / rd[labels[0]].loop for rd in rounds]
        delta = [(rd[label].loop - rd[labels[0]].loop) / rd[label].steps * 1e6 for rd in rounds]
        saves = sorted({run.saves for run in runs})
        save_ms = "-"
        if isinstance(options[label], dict) and saves != [0]:
            costs = [
                (rd[label].loop - rd[NO_CHECKPOINTS].loop) / rd[label].saves * 1e3 for rd in rounds
            ]
            per_save[label] = statistics.median(costs)
            save_ms = f"{per_save[label]:.2f}"
        fixed_ms = (
            None
            if not isinstance(options[label], dict)
            else statistics.median(run.total - run.loop for run in runs) * 1e3
        )
        fixed = "-" if fixed_ms is None else f"{fixed_ms:.1f}"
        is_plain, is_trainer = options[label] is None, isinstance(options[label], dict)
        board = sorted({"on" if run.tensorboard else "off" for run in runs})
        rows.append(
            [
                work.name,
                label,
                "/".join(board) if is_trainer else "-",
                "/".join(map(str, saves)),
                f"{statistics.median(us):.1f}",
                "1" if is_plain else f"{statistics.median(ratio):.3f}",
                "-" if is_plain else f"{min(ratio):.3f}-{max(ratio):.3f}",
                "-" if is_plain else f"{statistics.median(delta):+.1f}",
                save_ms,
                fixed,
            ]
        )
        entries.append(
            {
                "workload": work.name,
                "variant": label,
                "plain": is_plain,
                "tensorboard": board == ["on"] if is_trainer else None,
                "saves": saves,
                "us_per_step": statistics.median(us),
                "ratio": 1.0 if is_plain else statistics.median(ratio),
                "ratio_min_max": None if is_plain else [min(ratio), max(ratio)],
                "extra_us_per_step": None if is_plain else statistics.median(delta),
                "ms_per_save": per_save.get(label),
                "fixed_ms": fixed_ms,
            }
        )

    control = [rd[NO_CHECKPOINTS].loop / rd[CONTROL].loop for rd in rounds]
    floor = [rd[CONTROL].loop / rd[labels[0]].loop for rd in rounds]
    notes = [
        f"{work.name}: the per-step seeding alone (control over plain) "
        f"{statistics.median(floor):.3f}; the checkpoint-free Trainer over the control "
        f"{statistics.median(control):.3f} (min-max {min(control):.3f}-{max(control):.3f}): "
        "what the Trainer costs besides deriving each step's randomness",
        f"{work.name}: {len(work.dataset)} samples, batch {work.batch_size}, {work.epochs} "
        f"epoch(s) = {rounds[0][labels[0]].steps} steps per run",
    ]
    if foreign:
        notes.append(
            f"{work.name}: other processes' CPU use during a round: median "
            f"{statistics.median(foreign):.2f} cores, max {max(foreign):.2f}"
        )
    sync = per_save.get("Trainer, checkpoint_every_steps=100")
    if sync is not None:
        notes.append(
            f"{work.name}: a blocking save costs ~{sync:.1f} ms (checkpoint_every_steps=100 row), i.e. "
            f"~{sync * 1e3 / plain_us:.0f} plain steps of {plain_us:.0f} us: "
            + ", ".join(
                f"+{sync * 1e3 / (n * plain_us) * 100:.1f}% at one save per {n} steps"
                for n in (100, 1000, 10000)
            )
        )
    if mismatches:
        notes.append(f"{work.name}: NOT THE SAME WORK: " + "; ".join(sorted(set(mismatches))))
    else:
        notes.append(
            f"{work.name}: every run's final weights equal the plain loop's "
            "(torch.equal): the same training computation in every loop"
        )
    return rows, notes, entries


def _filesystem(path: str) -> str:
    """The mount point and type holding ``path`` (fsync costs depend on it)."""
    path, best = os.path.realpath(path), ("?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            mount, kind = fields[1], fields[2]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, kind)
    except OSError:
        return "unknown filesystem"
    return f"{best[1]} mounted at {best[0]}"


def _tensorboard_version() -> str:
    try:
        import tensorboard
    except ImportError:
        return "not installed"
    return f"{tensorboard.__version__} installed"


QUICK = "tiny datasets, 2 rounds (numbers are not meaningful)"


def main() -> None:
    parser = harness_parser(__doc__, "trainer_overhead", QUICK)
    add_options(parser, {
        "workloads": ("boring,cnn", "comma-separated: boring,cnn"),
        "reps": (5, "timed rounds per workload"),
        "boring_rows": (4096, None), "boring_epochs": (2, None),
        "cnn_images": (1024, None), "cnn_epochs": (8, None),
        "dir": (None, "parent of the per-run checkpoint directories (default: the system "
                "temporary directory)"),
        "threads": (1, "torch.set_num_threads"),
    })  # fmt: skip
    parser.add_argument(
        "--tensorboard",
        choices=("default", "off", "on"),
        default="default",
        help="the Trainer's TensorBoard logging in the Trainer rows: its own "
        "default (on when tensorboard is installed), or forced off/on. "
        "Unless off, a checkpoint_every_steps=None, tensorboard=False row is "
        "added to show what that logging costs",
    )
    args = parser.parse_args()
    if args.quick:
        args.reps, args.boring_rows, args.boring_epochs = 2, 512, 1
        args.cnn_images, args.cnn_epochs = 256, 1
    torch.set_num_threads(args.threads)
    parent = args.dir or tempfile.gettempdir()
    results = Results("trainer_overhead", args.json, args)

    print("# unbroken.Trainer training-loop overhead vs a plain PyTorch loop\n")
    print(f"Command: `{command_line()}`\n")
    print("\n".join(environment()))
    print(
        f"- torch.set_num_threads({args.threads}); loader: unbroken.DataLoader(shuffle=True, "
        "num_workers=0, seed=0), the same for both loops"
    )
    print(
        f"- checkpoint directories: fresh tempfile.mkdtemp() under {parent} "
        f"({_filesystem(parent)}), keep=2, every file fsynced"
    )
    if HAS_TENSORBOARD_ARG:
        print(
            f"- TensorBoard logging in the Trainer rows: --tensorboard {args.tensorboard} "
            f"(tensorboard {_tensorboard_version()}); the plain loop logs nothing"
        )
    else:
        print("- this unbroken.Trainer has no tensorboard option: --tensorboard is ignored")
    print(
        f"- the Trainer logs a batch's loss every {LOG_EVERY} batches (its default log_every)"
        if LOG_EVERY is not None
        else "- this unbroken.Trainer has no log_every: it logs every batch's loss"
    )
    if args.quick:
        print("- --quick: a smoke run; its numbers mean nothing")
    print(
        f"- 1 warm-up round, then {args.reps} rounds, each running every variant once in an "
        "order rotated every round"
    )
    sys.stdout.flush()

    rows, notes, entries = [], [], []
    for name in args.workloads.split(","):
        start = time.perf_counter()
        work_rows, work_notes, work_entries = bench(make_workload(name.strip(), args), args)
        rows += work_rows
        notes += work_notes
        entries += work_entries
        print(f"[{name}: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)

    print("\n## Time per training step\n")
    print(
        "TensorBoard: whether the Trainer wrote TensorBoard events (a scalar per step). "
        "saves: periodic checkpoints inside the timed loop per run. us/step: loop wall time / "
        "steps, median over rounds. ratio: loop time / the plain loop's in the same round, "
        "median and min-max over rounds. +us/step: the same difference per step (median). "
        "ms/save: (loop time - the checkpoint-free Trainer's in the same round) / saves, "
        "median: what each periodic save added to the loop. fixed ms: whole fit() minus the "
        "loop (setup + the end-of-fit save), not in the other columns.\n"
    )
    print(f"Command: `{command_line()}`\n")
    results.show("Time per training step", [
        "workload", "loop", "TensorBoard", "saves", "us/step", "ratio vs plain", "ratio min-max",
        "+us/step", "ms/save", "fixed ms",
    ], rows, left=3)  # fmt: skip
    results.finish(notes, {"log_every": LOG_EVERY, "rows": entries})


if __name__ == "__main__":
    main()
