"""Per-call costs of unbroken's own code, and of the calls it makes, each timed alone.

The modules' documentation cites these figures; this script measures them. Every row calls the
function the library calls (internals included) in a tight ``timeit`` loop, in one process, on
the CPU; the agreement's all-reduce alone needs a second process (a 2-rank gloo group on
loopback, started here). How it measures, and what each row means:
``docs/benchmarks/unit-costs.md``.

    .venv/bin/python benchmarks/unit_costs.py          # ~30 s of CPU (85 s at load 8 on 2 cores)
    .venv/bin/python benchmarks/unit_costs.py --quick  # smoke run, ~4 s of CPU (11 s at load 8)
"""

from __future__ import annotations

import random
import socket
import statistics
import sys
import tempfile
import time
import timeit
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, add_options, environment
from harness import parser as harness_parser


@dataclass
class Row:
    """One measured cost: ``fn()`` does ``per`` units of work (items, indices), reported per unit."""

    name: str  # the row's id on the page: docstrings refer to it
    what: str
    module: str
    before: str  # the figure the module's documentation gave, measured once by hand
    fn: Callable[[], Any]
    per: int = 1
    unit: str = "call"


# --------------------------------------------------------------------------- timing


class _Clocks(tuple):
    """(wall seconds, this process's CPU seconds): ``timeit`` only subtracts its timer's
    readings, so one timer can read both clocks."""

    def __sub__(self, other: tuple) -> _Clocks:  # type: ignore[override]
        return _Clocks((self[0] - other[0], self[1] - other[1]))


def _clocks() -> _Clocks:
    return _Clocks((time.perf_counter(), time.process_time()))


def time_per_call(
    fn: Callable[[], Any], target_s: float, repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds per call of ``fn``, CPU and wall, in each of ``repeats`` timeit repeats of about
    ``target_s`` of CPU time each. The loop count is calibrated first, as
    ``timeit.Timer.autorange`` does, to a shorter target (40-odd rows fit in a minute). CPU
    time (``time.process_time``: every thread of this process) is what the code costs; wall
    time adds what other processes took from it meanwhile."""
    timer = timeit.Timer(fn, timer=_clocks)
    number = 1
    while True:
        took = timer.timeit(number)[1]
        if took >= target_s / 5 or number >= 1 << 24:
            break
        number *= 2 if took <= 0 else min(10, max(2, int(target_s / 5 / took) + 1))
    number = max(1, round(number * target_s / max(took, 1e-9)))
    readings = timer.repeat(repeats, number)
    return [r[1] / number for r in readings], [r[0] / number for r in readings]


# --------------------------------------------------------------------------- the rows


class _CountingIterable:
    """An iterable with its own small state (torch's Stateful protocol), as ``resumable``'s
    first way wraps: the count of items yielded."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __iter__(self):
        while self.i < self.n:
            self.i += 1
            yield self.i

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class _Keys3:
    """A batch's keys as a small class of three fields (what the plain tuple avoids)."""

    __slots__ = ("indices", "key", "first")

    def __init__(self, indices: Any, key: int, first: int) -> None:
        self.indices, self.key, self.first = indices, key, first


def _drain(iterable: Any) -> None:
    for _ in iterable:
        pass


def trainer_rows(tmp: Path, close: list[Callable[[], None]]) -> list[Row]:
    """The Trainer's rows; ``close`` gets what to close once they are measured."""
    from unbroken.data import DataLoader
    from unbroken.train.agreement import Agreement
    from unbroken.train.csvlog import open_tensorboard
    from unbroken.train.globalrng import TRAIN, GlobalRNG, seed_step
    from unbroken.train.jit import JustInTime
    from unbroken.train.progress import Progress

    config = {"seed": 0, "accumulate": 1, "clip_grad_norm": None, "scheduler_interval": "step"}
    progress = Progress(config)  # type: ignore[arg-type]
    loss = torch.tensor(0.25)

    # A loader mid-epoch, its iterator alive: the state the record takes after a step.
    loader = DataLoader(list(range(4096)), batch_size=8, shuffle=True, seed=0)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    # The Trainer's JustInTime, enabled as on several ranks; one process, no log file (rank 0's
    # CSV flush is a file write, not the record's own cost).
    jit = JustInTime(
        None,
        Agreement(),
        progress,
        {"loader": loader},
        None,  # type: ignore[arg-type]  # the checkpointer: take() does not use it
        None,  # type: ignore[arg-type]  # the run directory: likewise
        SimpleNamespace(csv=None, rows=0),  # type: ignore[arg-type]
        1,
    )
    jit.enabled, jit.sums = True, [0.0, 0.0, 0.0]
    jit._keep = batches  # type: ignore[attr-defined]  # the iterator lives as long as the row

    from tqdm import tqdm

    off_bar = tqdm(total=None, disable=True)
    board = open_tensorboard(None, tmp / "tensorboard", 0)
    if board is not None:
        close.append(board.close)  # its writer thread, before the directory goes
    board_step = iter(range(1 << 62))
    rng = GlobalRNG()
    rng_state = rng.state_dict()

    rows = [
        Row(
            "jit_record",
            "just-in-time record after an optimizer step (`JustInTime.take`, one loader)",
            "unbroken.train.jit",
            "~2 us",
            jit.take,
        ),
        Row(
            "jit_loader_state",
            "its part: the loader's `state_dict()` mid-epoch",
            "unbroken.data.loader",
            "0.7 us",
            loader.state_dict,
        ),
        Row(
            "jit_counters",
            "its part: the counters (`Progress.state_with`)",
            "unbroken.train.progress",
            "1.3 us",
            lambda: progress.state_with(0.0),
        ),
        Row(
            "progress_batch",
            "`Progress.batch_done` of a CPU loss (counters + `loss.item()` add)",
            "unbroken.train.progress",
            "~0.2 us",
            lambda: progress.batch_done(loss),
        ),
        Row(
            "progress_bar_off",
            "tqdm `update(1)` on a disabled bar",
            "unbroken.train.progress",
            "~0.2 us",
            lambda: off_bar.update(1),
        ),
    ]
    if board is not None:
        rows.append(
            Row(
                "tensorboard_value",
                "TensorBoard `SummaryWriter.add_scalar`, one value",
                "unbroken.train.csvlog",
                "~40 us",
                lambda: board.add_scalar("loss", 0.5, next(board_step)),
            )
        )
    rows += [
        Row(
            "globalrng_capture",
            "`GlobalRNG().state_dict()`: torch, numpy, random",
            "unbroken.train.globalrng",
            "~20 us",
            rng.state_dict,
        ),
        Row(
            "globalrng_restore",
            "`GlobalRNG().load_state_dict(state)`",
            "unbroken.train.globalrng",
            "~20 us",
            lambda: rng.load_state_dict(rng_state),
        ),
        Row(
            "seed_step",
            "`globalrng.seed_step`: the Trainer's per-step seeding of the 3 generators",
            "unbroken.train.globalrng",
            "~6 us",
            lambda: seed_step(12345, TRAIN, 3, 1000, 0),
        ),
        Row(
            "torch_manual_seed",
            "`torch.manual_seed(s)` (every backend torch knows), for comparison",
            "torch",
            "~85 us",
            lambda: torch.manual_seed(0x9E3779B9),
        ),
    ]
    return rows


def data_rows(quick: bool) -> list[Row]:
    from unbroken.data import resumable, shuffle_buffer
    from unbroken.data.bijection import IndexShuffle
    from unbroken.data.buffered_shuffle import ShuffleBuffer
    from unbroken.data.iterable import take_state
    from unbroken.data.rng import GLOBAL_RNGS, clear_sample, keep_main_torch_rng, make_seeder
    from unbroken.data.sources.base import Cursor
    from unbroken.data.sources.fetch import SeededCollate
    from unbroken.data.sources.orders import NativeOrder

    value = 0x9E3779B9  # a 32-bit seed, as the loader passes
    generator = torch.default_generator
    torch_state = generator.get_state()
    np_state = np.random.get_state(legacy=True)
    py_state = random.getstate()
    seeders = {
        rngs: make_seeder(rngs) for rngs in [("torch",), ("numpy",), ("random",), GLOBAL_RNGS]
    }

    def seeding(rngs: tuple[str, ...]) -> Callable[[], None]:
        seeder = seeders[rngs]
        return lambda: seeder(0x9E3779B97F4A7C15, 12345)

    def put_torch_back() -> None:  # what the loader does around a batch with num_workers=0
        clear_sample(keep_main_torch_rng(GLOBAL_RNGS))

    def put_numpy_back() -> None:
        np.random.set_state(np.random.get_state(legacy=True))

    def put_random_back() -> None:
        random.setstate(random.getstate())

    seeded_collate = SeededCollate(lambda batch: batch, GLOBAL_RNGS)  # a collate_fn of the user's
    default_collate = SeededCollate(torch.utils.data.default_convert, GLOBAL_RNGS)  # not seeded

    block = 4096
    starts = np.arange(block, dtype=np.int64)
    dense = IndexShuffle(1_000_000, 0x1234)  # 20 bits: the domain is 1.05 x n
    sparse = IndexShuffle((1 << 20) + 1, 0x1234)  # 22 bits: the domain is ~4 x n

    n_order = 65536
    order = NativeOrder(n_order, 32, False, True)

    n_items = 10_000 if quick else 20_000
    plain = resumable(lambda epoch: range(n_items))
    stateful = resumable(lambda epoch: _CountingIterable(n_items))
    skipped = resumable(lambda epoch: range(n_items), progress=False)
    skip_state = {**skipped.state_dict(), "items": n_items - 1}

    def skip_resume() -> None:  # a resume at item n-1: re-reads and drops n-1 items
        skipped.load_state_dict(skip_state)
        next(iter(skipped))

    upstream = resumable(lambda epoch: range(n_items))
    buffers = {size: shuffle_buffer(resumable(lambda epoch: range(n_items)), size, seed=0)
               for size in (100, 10_000)}  # fmt: skip
    windows = ShuffleBuffer(resumable(lambda epoch: range(10)), 100, seed=0)

    rows = [
        Row("seed_torch", "`torch.default_generator.manual_seed(s)`", "torch", "~1.2 us",
            lambda: generator.manual_seed(value)),
        Row("seed_numpy", "`np.random.seed(s)` (numpy's legacy global)", "numpy", "~1.5 us",
            lambda: np.random.seed(value)),
        Row("seed_random", "`random.seed(s)`", "random", "~4 us", lambda: random.seed(value)),
        Row("batch_seeding_torch", 'the per-batch seeder, `global_rngs=("torch",)`',
            "unbroken.data.rng", "1.2 us", seeding(("torch",))),
        Row("batch_seeding_numpy", 'the per-batch seeder, `global_rngs=("numpy",)`',
            "unbroken.data.rng", "1.5 us", seeding(("numpy",))),
        Row("batch_seeding_random", 'the per-batch seeder, `global_rngs=("random",)`',
            "unbroken.data.rng", "4 us", seeding(("random",))),
        Row("batch_seeding_all", "the per-batch seeder, all three (the default)",
            "unbroken.data.rng", "-", seeding(GLOBAL_RNGS)),
        Row("torch_rng_back", "torch's generator put back around a batch, `num_workers=0` "
            "(`keep_main_torch_rng` + `clear_sample`)", "unbroken.data.rng",
            "~1.3-2 us", put_torch_back),
        Row("collate_seeded", "a `collate_fn` of the user's (here the identity) called through "
            "`SeededCollate`: the three generators seeded for it", "unbroken.data.sources.fetch",
            "-", lambda: seeded_collate(None, 0x9E3779B97F4A7C15, 12345)),
        Row("collate_default", "torch's `default_convert` through `SeededCollate`: not seeded",
            "unbroken.data.sources.fetch", "-", lambda: default_collate(None, 0x9E3779B97F4A7C15, 12345)),
        Row("numpy_rng_back", "numpy's legacy global state read and put back (not done)",
            "numpy", "~57 us", put_numpy_back),
        Row("random_rng_back", "`random`'s state read and put back", "random", "~10 us",
            put_random_back),
        Row("shuffle_index", "`IndexShuffle.at`, a block of 4,096 positions, n = 10^6",
            "unbroken.data.bijection", "0.05-0.1 us", lambda: dense.at(starts), block, "index"),
        Row("shuffle_index_walk", "the same, n = 2^20 + 1 (domain ~4 x n: most cycle walking)",
            "unbroken.data.bijection", "0.05-0.1 us", lambda: sparse.at(starts), block, "index"),
        Row("order_index", "a shuffled epoch's batches of indices (`NativeOrder.batches`, "
            "batch 32, 65,536 samples)", "unbroken.data.sources.orders", "~0.1 us",
            lambda: _drain(order.batches(0, 0, Cursor(), deque())), n_order, "index"),
        Row("batch_keys_tuple", "a batch's keys as a plain tuple", "unbroken.data.sources.fetch",
            "-", lambda: ([1, 2], 5, 7)),
        Row("batch_keys_class", "the same as a small class with `__slots__`",
            "unbroken.data.sources.fetch", "~0.5 us more", lambda: _Keys3([1, 2], 5, 7)),
        Row("resumable_item", "`resumable` over a range, per item", "unbroken.data.iterable",
            "~0.1 us", lambda: _drain(plain), n_items, "item"),
        Row("resumable_state_item", "`resumable` over an iterable with a small state of its "
            "own, per item (its `state_dict()` + JSON check)", "unbroken.data.iterable", "~2 us",
            lambda: _drain(stateful), n_items, "item"),
        Row("resumable_skip_item", "a resume by skipping, per item re-read and dropped",
            "unbroken.data.iterable", "~0.06 us", skip_resume, n_items - 1, "item"),
        Row("upstream_state", "`take_state` of a `resumable` (once a window)",
            "unbroken.data.buffered_shuffle", "-", lambda: take_state(upstream, "bench")),
        Row("window_permutation_100", "a window's permutation, 100 items",
            "unbroken.data.buffered_shuffle", "~30 us (20 + 0.1 x 100)", lambda: windows._permutation(0, 7, 100)),
        Row("window_permutation_10000", "a window's permutation, 10,000 items",
            "unbroken.data.buffered_shuffle", "~1,020 us (20 + 0.1 x 10,000)",
            lambda: windows._permutation(0, 7, 10_000)),
        Row("shuffle_buffer_item_100", "`shuffle_buffer(resumable(...), 100)`, per item, in all",
            "unbroken.data.buffered_shuffle", "0.3-0.5 us", lambda: _drain(buffers[100]),
            n_items, "item"),
        Row("shuffle_buffer_item_10000", "the same, windows of 10,000",
            "unbroken.data.buffered_shuffle", "0.3-0.5 us", lambda: _drain(buffers[10_000]),
            n_items, "item"),
    ]  # fmt: skip
    generator.set_state(torch_state)
    np.random.set_state(np_state)
    random.setstate(py_state)
    return rows


def retry_rows() -> list[Row]:
    from unbroken.retry import Deadline, _keeping_random, _Operation

    deadline = Deadline(60.0)

    def nothing() -> None:
        return None

    return [
        Row("remote_attempt_thread", "one attempt under a deadline: a thread started and "
            "waited for (`_Operation.attempt`)", "unbroken.retry", "~50 us",
            lambda: _Operation(deadline).attempt(nothing)),
        Row("remote_attempt_inline", "the same without a deadline (no thread), for comparison",
            "unbroken.retry", "-", lambda: _Operation(None).attempt(nothing)),
        Row("keeping_random", "`random`'s state put back around a call (`_keeping_random`)",
            "unbroken.retry", "~10 us", lambda: _keeping_random(nothing)),
    ]  # fmt: skip


def lightning_rows() -> list[Row]:
    try:
        from unbroken.lightning.draws import DrawWatch
    except ImportError:  # lightning is an extra
        print("- lightning is not installed: the draws check is not measured", flush=True)
        return []
    watch = DrawWatch(["train loader 0: 2 -> 0"])

    def watched_step() -> None:
        watch._left = 1  # watched, whatever count the loop has reached
        watch.start()
        watch.end("training")

    return [
        Row("draws_check", "the draws check of a watched step (`DrawWatch.start` + `end`)",
            "unbroken.lightning.draws", "~40 us", watched_step),
    ]  # fmt: skip


# --------------------------------------------------------------------------- the agreement


def _agreement_rank(rank: int, port: int, calls: int, repeats: int, queue: Any) -> None:
    """One rank of the 2-rank gloo group: ``Agreement.any_of`` of two flags, timed on rank 0."""
    import torch.distributed as dist

    from unbroken.train.agreement import Agreement

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        agreement = Agreement()
        for _ in range(max(50, calls // 10)):  # warm-up: connections, allocator
            agreement.any_of(False, rank == 1)
        readings = []
        for _ in range(repeats):
            dist.barrier()
            before = _clocks()
            for _ in range(calls):
                agreement.any_of(False, rank == 1)
            took = _clocks() - before
            readings.append((took[1] / calls, took[0] / calls))
        if rank == 0:
            queue.put(readings)
    finally:
        dist.destroy_process_group()


def agreement_times(calls: int, repeats: int) -> tuple[list[float], list[float], str]:
    """Seconds per ``any_of`` on rank 0 of a 2-rank gloo group on loopback, CPU and wall, per
    repeat, and how the ranks were started. Forked where the platform allows (no second
    import of torch: seconds on a loaded machine), before this process starts any thread."""
    import multiprocessing

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    queue = mp.get_context(method).SimpleQueue()
    mp.start_processes(
        _agreement_rank, args=(port, calls, repeats, queue), nprocs=2, start_method=method
    )
    readings = queue.get()
    return [r[0] for r in readings], [r[1] for r in readings], method


# --------------------------------------------------------------------------- main

QUICK = (
    "3 repeats of ~5 ms a row, 200 all-reduces a repeat, no draws check (it imports "
    "lightning); numbers are noise"
)


def us(seconds: list[float], per: int = 1) -> list[float]:
    return [t / per * 1e6 for t in seconds]


def main() -> None:
    parser = harness_parser(__doc__, "unit_costs", QUICK)
    add_options(parser, {
        "repeats": (9, "timeit repeats per row"),
        "target_ms": (40.0, "CPU time of one repeat, in milliseconds"),
        "agreement_calls": (1000, "all-reduces per repeat on the 2-rank group"),
        "no_agreement": (False, "skip the 2-rank gloo group (the only row with 2 processes)"),
        "only": (None, "comma-separated row names (or prefixes) to measure; default: all"),
    })  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.target_ms, args.agreement_calls = 3, 5.0, 200
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*resuming re-reads.*")
    results = Results("unit_costs", args.json, args)
    wanted = [w for w in (args.only or "").split(",") if w]

    print("# Unit costs: unbroken's per-call figures, each timed alone\n")
    print("\n".join(environment()))
    print(
        f"- timeit in this process, torch.set_num_threads(1), CPU: {args.repeats} repeats of "
        f"~{args.target_ms:g} ms of CPU time per row; per call (or per unit): the median and "
        "min over the repeats of this process's CPU time, and the min of the wall time"
    )

    # CPU time (process_time) per call, wall time per call, of each row measured.
    measured: list[tuple[Row, list[float], list[float]]] = []
    notes = []
    agreement_row = Row(
        "agreement_any_of",
        "`Agreement.any_of` of two flags: one all-reduce, 2 gloo ranks on loopback",
        "unbroken.train.agreement",
        "~50-100 us",
        lambda: None,
    )
    if not args.no_agreement and (not wanted or agreement_row.name.startswith(tuple(wanted))):
        # First: forked before this process has threads (TensorBoard's writer, the retry rows).
        spawn_start = time.perf_counter()
        cpu, wall, method = agreement_times(args.agreement_calls, args.repeats)
        measured.append((agreement_row, cpu, wall))
        notes.append(
            f"agreement_any_of: 2 ranks ({method}, gloo, 1 thread each), "
            f"{args.agreement_calls} calls a repeat after a warm-up, timed on rank 0; starting "
            f"and joining the group took {time.perf_counter() - spawn_start:.1f} s. Its cost is "
            "the wall time: a rank waits for the other"
        )
    else:
        notes.append("agreement_any_of was not measured (--no-agreement or --only)")

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        empty = Row("empty_call", "an empty call: the timing loop's own cost, in every row",
                    "-", "-", lambda: None)  # fmt: skip
        close: list[Callable[[], None]] = []
        rows = [empty, *trainer_rows(Path(tmp), close), *data_rows(args.quick)]
        rows += retry_rows()
        if args.quick:  # importing lightning alone costs ~6 s of CPU
            notes.append("draws_check was left out of --quick (it imports lightning)")
        else:
            rows += lightning_rows()
        if wanted:
            rows = [r for r in rows if r.name.startswith(tuple(wanted))]
        for row in rows:
            cpu, wall = time_per_call(row.fn, args.target_ms / 1000, args.repeats)
            measured.append((row, cpu, wall))
        for done in close:
            done()
    notes.append(f"{len(rows)} rows in this process took {time.perf_counter() - started:.1f} s")
    notes.append("per: the unit a figure is divided by (a call, an index, an item)")

    header = ["row", "what", "module", "median CPU us", "min CPU us", "min wall us", "per"]
    header.append("hand-measured")
    table_rows = [
        [
            row.name,
            row.what,
            f"`{row.module}`" if row.module != "-" else "-",
            f"{statistics.median(us(cpu, row.per)):.3g}",
            f"{min(us(cpu, row.per)):.3g}",
            f"{min(us(wall, row.per)):.3g}",
            row.unit,
            row.before,
        ]
        for row, cpu, wall in measured
    ]
    print()
    results.show("Per-call costs, microseconds", header, table_rows, left=3)
    results.finish(
        notes,
        {
            "rows": [
                {
                    "name": row.name,
                    "what": row.what,
                    "module": row.module,
                    "unit": row.unit,
                    "per": row.per,
                    "median_cpu_us": statistics.median(us(cpu, row.per)),
                    "min_cpu_us": min(us(cpu, row.per)),
                    "median_wall_us": statistics.median(us(wall, row.per)),
                    "min_wall_us": min(us(wall, row.per)),
                    "cpu_us": us(cpu, row.per),
                    "wall_us": us(wall, row.per),
                    "hand_measured": row.before,
                }
                for row, cpu, wall in measured
            ]
        },
    )


if __name__ == "__main__":
    main()
