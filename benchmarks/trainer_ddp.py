"""unbroken.Trainer against a hand-written DDP loop, per training step, at 2, 3 and 4 ranks.

How it measures, and what the numbers mean: ``docs/benchmarks/trainer-ddp.md``.

    .venv/bin/python benchmarks/trainer_ddp.py              # ~5 minutes on 2 busy cores
    .venv/bin/python benchmarks/trainer_ddp.py --quick      # smoke run: seconds of noise
    .venv/bin/python benchmarks/trainer_ddp.py --ranks 1 --single --device cuda  # one GPU

Each world size is one torchrun job (gloo on CPU, NCCL on CUDA; one thread per rank). Inside
it, rounds alternate three variants, the first variant rotated every round: the hand loop
(torch's ``DistributedSampler`` and ``DataLoader``, DDP, SGD), ``unbroken.Trainer`` with its
defaults, and ``Trainer(just_in_time=False)``. ``--single`` adds the same comparison in one
process, without torch.distributed or DDP. ``--parts`` adds three hand loops between them, each
with one more of the Trainer's exactness parts: ``exact_reduce``; then ``unbroken.DataLoader``
and the per-step seeding; then the Trainer's own reduction, carrying the agreement's row. Each
row's excess over the one before it is what that part costs; the Trainer's over the last of
them, what its loop's own bookkeeping costs. A control comes first: the hand loop with torch's
own Python all-reduce hook (``default_hooks.allreduce_hook``), what DDP costs with any
communication hook written in Python, before the hook does anything of its own.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, ForeignLoad, Results, environment, quartiles, rotated
from harness import parser as harness_parser
from harness.jobs import parse_or_work, send_back, torchrun_worker

import unbroken
import unbroken.distributed
from unbroken.train.agreement import Carrier
from unbroken.train.globalrng import TRAIN, seed_step

HAND, TRAINER, NO_JIT = "hand loop", "Trainer()", "Trainer(just_in_time=False)"
VARIANTS = (HAND, TRAINER, NO_JIT)
# --parts: a control, torch's own Python hook; then hand loops with the Trainer's parts, one
# more each (the Trainer's rows come last).
HOOK = "hand + torch's Python allreduce_hook"
EXACT = "hand + exact_reduce"
DATA = "hand + exact_reduce + seeded data"
ROW = "hand + agreement row + seeded data"
PARTS = {HOOK: {"hook"}, EXACT: {"exact"}, DATA: {"exact", "data"}, ROW: {"row", "data"}}


def variants(args: argparse.Namespace) -> tuple[str, ...]:
    return (HAND, *PARTS, NO_JIT, TRAINER) if args.parts else VARIANTS


WIDTH, LAYERS = 512, 4
# The automatic interval's first save comes 2 s into a fresh run, inside the timed window: a
# fixed interval this long keeps the wall-clock check of every batch and saves only at the end.
NO_SAVE_SECONDS = 24 * 3600.0


class Synthetic(torch.utils.data.Dataset):
    """``n`` fixed (input, target) pairs of ``WIDTH`` floats: a map-style dataset."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, WIDTH, generator=generator)
        self.y = torch.randn(n, WIDTH, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Clock:
    """The timed window's two moments, taken at the end of optimizer steps ``first`` and
    ``last`` (synchronizing the device first), and the saves that started between them."""

    def __init__(self, first: int, last: int, sync: Callable[[], None]) -> None:
        self.first, self.last, self.sync = first, last, sync
        self.steps, self.saves = 0, 0
        self.start = self.end = float("nan")
        self.cpu_start = self.cpu_end = float("nan")  # this process's CPU time, all threads
        self.jit: bool | None = None  # whether the Trainer's just-in-time saves were on

    def stepped(self) -> None:
        self.steps += 1
        if self.steps in (self.first, self.last):
            self.sync()
            now, cpu = time.perf_counter(), time.process_time()
            if self.steps == self.first:
                self.start, self.cpu_start = now, cpu
            else:
                self.end, self.cpu_end = now, cpu

    def ms_per_step(self) -> float:
        return (self.end - self.start) / (self.last - self.first) * 1e3

    def cpu_ms_per_step(self) -> float:
        return (self.cpu_end - self.cpu_start) / (self.last - self.first) * 1e3

    # As a Trainer callback: the same moment as the hand loop's, right after the step.
    def on_optimizer_step(self, trainer: Any) -> None:
        self.stepped()

    def on_fit_start(self, trainer: Any) -> None:
        # Not a public attribute: read where it is, None where a version keeps it elsewhere.
        self.jit = getattr(getattr(trainer, "jit", None), "enabled", None)

    def on_save_start(self, trainer: Any) -> None:
        if self.first <= self.steps < self.last:  # the end-of-fit save comes after the window
            self.saves += 1


class Bench:
    """One process's part: its model factory, data, device and the variants' loops."""

    def __init__(self, args: argparse.Namespace, distributed: bool) -> None:
        self.args, self.distributed = args, distributed
        self.world = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = args.device == "cuda"
        self.device = torch.device("cuda", self.local) if cuda else torch.device("cpu")
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.steps = args.warmup + args.steps
        self.dataset = Synthetic((self.steps + 1) * args.batch * self.world)

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)  # the same weights for every variant and round
        blocks: list[torch.nn.Module] = []
        for _ in range(LAYERS):
            blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        model = torch.nn.Sequential(*blocks).to(self.device)
        if not self.distributed:
            return model
        ids = [self.local] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = (t.to(self.device, non_blocking=True) for t in batch)
        return torch.nn.functional.mse_loss(model(x), y)

    def clock(self) -> Clock:
        return Clock(self.args.warmup, self.steps, self.sync)

    def hand(self, parts: frozenset[str] = frozenset()) -> Clock:
        """The hand loop; with ``parts`` (``PARTS``), the Trainer's exactness parts in it, or
        the control: ``hook``: torch's ``allreduce_hook``, which divides and all-reduces each
        bucket as DDP does without a hook, from Python; ``exact``: ``exact_reduce``;
        ``data``: ``unbroken.DataLoader`` and the Trainer's seeding before each step; ``row``: the Trainer's own reduction instead of
        ``exact_reduce`` (its loss divided by the world size, the hook only summing), carrying
        a row as wide as the Trainer's agreement, read after each backward."""
        model = self.model()
        optimizer = torch.optim.SGD(model.parameters(), lr=self.args.lr)
        reduction, row, divisor = None, None, 1
        if self.distributed and "hook" in parts:
            model.register_comm_hook(None, default_hooks.allreduce_hook)  # type: ignore[operator]
        if self.distributed and "exact" in parts:
            unbroken.distributed.exact_reduce(model)
        if self.distributed and "row" in parts:
            # What Trainer.fit registers, by the same call: not a public API.
            from unbroken.distributed.reduction import ensure_exact, reduction_of

            width = Carrier.width(self.world)
            ensure_exact(model, "trainer_ddp.py", width)
            reduction = reduction_of(model)
            assert reduction is not None
            reduction.predivided, divisor = True, self.world
            row = torch.zeros(width, dtype=torch.uint8, device=self.device)
        if "data" in parts:
            loader: Any = unbroken.DataLoader(
                self.dataset, batch_size=self.args.batch, shuffle=True, seed=0
            )
        elif self.distributed:
            sampler = torch.utils.data.DistributedSampler(self.dataset, shuffle=True, seed=0)
            sampler.set_epoch(0)
            loader = torch.utils.data.DataLoader(
                self.dataset, batch_size=self.args.batch, sampler=sampler
            )
        else:
            generator = torch.Generator().manual_seed(0)
            loader = torch.utils.data.DataLoader(
                self.dataset, batch_size=self.args.batch, shuffle=True, generator=generator
            )
        clock = self.clock()
        seeded = "data" in parts
        for batch in loader:
            if seeded:  # as the Trainer seeds a step: seed 0, epoch 0, the step, the rank
                seed_step(0, TRAIN, 0, clock.steps, self.rank)
            loss = self.step(model, batch)
            if reduction is not None:
                reduction.carry(row)  # type: ignore[arg-type]  # set with the reduction
                loss = loss / divisor
            loss.backward()
            if reduction is not None:
                reduction.carried()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.stepped()
            if clock.steps == self.steps:
                break
        return clock

    def trainer(self, directory: Path, **options: Any) -> Clock:
        model = self.model()
        optimizer = torch.optim.SGD(model.parameters(), lr=self.args.lr)
        loader = unbroken.DataLoader(self.dataset, batch_size=self.args.batch, shuffle=True, seed=0)
        clock = self.clock()
        trainer = unbroken.Trainer(
            directory,
            max_epochs=1,
            max_steps=self.steps,
            checkpoint_every_seconds=NO_SAVE_SECONDS,
            progress_bar=False,
            callbacks=[clock],
            **options,
        )
        trainer.fit(model, optimizer, loader, training_step=self.step)
        return clock

    def run(self, variant: str, directory: Path) -> Clock:
        if self.distributed:
            dist.barrier()  # every rank starts the variant together, outside the window
        if variant == HAND:
            return self.hand()
        if variant in PARTS:
            return self.hand(frozenset(PARTS[variant]))
        return self.trainer(directory, **({"just_in_time": False} if variant == NO_JIT else {}))


def measure(args: argparse.Namespace, distributed: bool, out: Path) -> dict[str, Any]:
    """Every round of every variant in this process; rank 0's clocks, and the other
    processes' load (cores) per round."""
    bench = Bench(args, distributed)
    # rank 0 counts every rank as its own: torchrun's agent, their parent, is the root
    monitor = ForeignLoad(root=os.getppid() if distributed else None)
    monitor.available &= bench.rank == 0
    chosen = variants(args)
    ms: dict[str, list[float]] = {v: [] for v in chosen}
    cpu: dict[str, list[float]] = {v: [] for v in chosen}
    saves: dict[str, list[int]] = {v: [] for v in chosen}
    jit: dict[str, list[bool | None]] = {v: [] for v in chosen}
    foreign: list[float] = []
    for index in range(-1, args.rounds):  # round -1: a warm-up, untimed
        before = monitor.snapshot()
        for variant in rotated(chosen, max(index, 0)):
            directory = out / f"round{index + 1}-{chosen.index(variant)}"
            clock = bench.run(variant, directory)
            spent = torch.tensor(clock.cpu_ms_per_step(), dtype=torch.float64)
            if distributed:  # every rank's CPU time: the mean over the ranks, after the window
                dist.all_reduce(spent)
                spent /= bench.world
            if index >= 0:
                ms[variant].append(clock.ms_per_step())
                cpu[variant].append(float(spent))
                saves[variant].append(clock.saves)
                jit[variant].append(clock.jit)
            gc.collect()  # the DDP models of this variant go now, not inside a later window
            if bench.rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
        if index >= 0:
            foreign.append(ForeignLoad.cores(before, monitor.snapshot()))
    return {
        "world": bench.world,
        "ms": ms,
        "cpu": cpu,
        "saves": saves,
        "jit": jit,
        "foreign": foreign,
    }


def quiet() -> None:
    """Only the Trainer's warnings: its two INFO lines a fit would fill the output."""
    logging.getLogger("unbroken").setLevel(logging.WARNING)


def worker(args: argparse.Namespace) -> None:
    quiet()
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    unbroken.distributed.init_process_group(args.backend)
    result = measure(args, True, Path(args.out))
    send_back(args, result)


def summarize(label: str, measured: dict[str, Any]) -> tuple[list[list[str]], dict[str, Any]]:
    """The table's rows for one world, and the same numbers for the JSON."""
    ms, rows, entry = measured["ms"], [], {"world": measured["world"], "variants": {}}
    cpu = measured["cpu"]
    for variant in ms:
        ratio = [t / h for t, h in zip(ms[variant], ms[HAND])]
        cpu_ratio = [t / h for t, h in zip(cpu[variant], cpu[HAND])]
        low, high = quartiles(ms[variant])
        median = statistics.median(ms[variant])
        entry["variants"][variant] = {
            "ms_per_step": median,
            "ms_iqr": [low, high],
            "ms_per_round": ms[variant],
            "ratio": statistics.median(ratio),
            "ratio_min_max": [min(ratio), max(ratio)],
            "cpu_ms_per_step": statistics.median(cpu[variant]),
            "cpu_ms_per_round": cpu[variant],
            "cpu_ratio": statistics.median(cpu_ratio),
            "cpu_ratio_min_max": [min(cpu_ratio), max(cpu_ratio)],
            "saves_in_window": sum(measured["saves"][variant]),
            "just_in_time": sorted({str(on) for on in measured["jit"][variant]}),
        }
        rows.append(
            [
                label,
                variant,
                f"{median:.2f}",
                f"{low:.2f}-{high:.2f}",
                "1" if variant == HAND else f"{statistics.median(ratio):.3f}",
                "-" if variant == HAND else f"{min(ratio):.3f}-{max(ratio):.3f}",
                f"{statistics.median(cpu[variant]):.2f}",
                "1" if variant == HAND else f"{statistics.median(cpu_ratio):.3f}",
                "-" if variant == HAND else f"{min(cpu_ratio):.3f}-{max(cpu_ratio):.3f}",
            ]
        )
    entry["foreign_cores"] = measured["foreign"]
    return rows, entry


def over_control(label: str, measured: dict[str, Any]) -> list[list[str]]:
    """``--parts``: each loop after the control over the control, round by round."""
    rows, measured_in_order = [], list(measured["ms"])  # the variants, in ``variants()`` order
    for variant in measured_in_order[measured_in_order.index(HOOK) + 1 :]:
        cells = [label, variant]
        for kind in ("ms", "cpu"):
            ratio = [t / h for t, h in zip(measured[kind][variant], measured[kind][HOOK])]
            cells += [f"{statistics.median(ratio):.3f}", f"{min(ratio):.3f}-{max(ratio):.3f}"]
        rows.append(cells)
    return rows


QUICK = "2 rounds of 2 + 5 steps"


def main() -> None:
    parser = harness_parser(__doc__, "trainer_ddp", QUICK)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4], help="world sizes")
    parser.add_argument(
        "--single", action="store_true", help="also one process without DDP (no torchrun)"
    )
    parser.add_argument(
        "--parts",
        action="store_true",
        help="also hand loops with the Trainer's exactness parts, one more each (see above)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", default="", help="default: gloo on cpu, nccl on cuda")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per round")
    parser.add_argument(
        "--steps",
        type=int,
        default=50,
        help="timed steps per variant and round (a multiple of the Trainer's log_every, 50, "
        "keeps its logging at its steady-state share)",
    )
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per world size")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parse_or_work(parser, worker)
    if args is None:
        return
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.quick:
        args.warmup, args.steps, args.rounds = 2, 5, 2
    results = Results("trainer_ddp", args.json, args)
    print("\n".join(environment()), flush=True)
    flags = ("device", "backend", "batch", "warmup", "steps", "rounds", "lr", "parts")
    runs: list[tuple[str, dict[str, Any]]] = []
    if args.single:
        quiet()
        torch.set_num_threads(1)
        out = Path(tempfile.mkdtemp(prefix="trainer_ddp-single-", dir=REPO))
        try:
            runs.append(("1 (no DDP)", measure(args, False, out)))
        finally:
            shutil.rmtree(out, ignore_errors=True)
    for ranks in args.ranks:
        runs.append((str(ranks), torchrun_worker(__file__, ranks, args, *flags)))

    rows, entries = [], []
    for label, measured in runs:
        world_rows, entry = summarize(label, measured)
        rows += world_rows
        entries.append({"label": label, **entry})
    print()
    results.show(
        f"A training step, {LAYERS} x Linear({WIDTH}, {WIDTH}) MLP, batch {args.batch} a rank "
        f"({args.device}, {args.backend}): ms per step on rank 0",
        [
            "ranks",
            "loop",
            "ms/step",
            "ms IQR",
            "ratio vs hand",
            "ratio min-max",
            "CPU ms/step",
            "CPU ratio",
            "CPU ratio min-max",
        ],
        rows,
        left=2,
    )
    if args.parts:
        print()
        results.show(
            "The same rounds over the control (a loop's time over the hand loop with torch's "
            "Python hook, in the same round): median and min-max over the rounds",
            ["ranks", "loop", "wall ratio", "wall min-max", "CPU ratio", "CPU min-max"],
            [row for label, measured in runs for row in over_control(label, measured)],
            left=2,
        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    notes = [
        f"medians over {args.rounds} rounds (after 1 warm-up round) of {args.steps} timed steps "
        f"after {args.warmup} untimed ones, per variant; ratio: a loop's time over the hand "
        "loop's in the same round, median and min-max over rounds; ms: rank 0's wall clock; "
        "CPU ms: each process's CPU time (all its threads: gloo's, autograd's), the mean over "
        "the ranks, taken at the same two moments",
        f"Trainer options besides its defaults: max_epochs=1, max_steps={args.warmup + args.steps}, "
        f"checkpoint_every_seconds={NO_SAVE_SECONDS:.0f}, progress_bar=False; saves started in "
        "the timed windows: "
        + ", ".join(
            f"{e['label']}: {sum(v['saves_in_window'] for v in e['variants'].values())}"
            for e in entries
        ),
        "just-in-time saves on in Trainer() / Trainer(just_in_time=False): "
        + ", ".join(
            f"{e['label']}: {'/'.join(e['variants'][TRAINER]['just_in_time'])} / "
            f"{'/'.join(e['variants'][NO_JIT]['just_in_time'])}"
            for e in entries
        ),
        "other processes' load during a round (cores, median/max): "
        + ", ".join(
            f"{e['label']}: {statistics.median(e['foreign_cores']):.2f}/"
            f"{max(e['foreign_cores']):.2f}"
            for e in entries
        ),
    ]
    if args.device == "cuda":
        notes.append(f"device: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPUs")
    else:
        notes.append(f"1 thread per rank on {cores} cores usable")
        oversubscribed = [r for r in args.ranks if r > (cores or 1)]
        if oversubscribed:
            notes.append(
                f"{', '.join(map(str, oversubscribed))} ranks on {cores} cores: oversubscribed, "
                "the ranks take turns on the cores"
            )
    results.finish(notes, {"runs": entries, "variants": list(variants(args))})


if __name__ == "__main__":
    main()
