"""Lightning 2.6 killed and resumed, mid-epoch and at epoch boundaries: plain (torch's
DataLoader) vs unbroken.

How it measures, and what the numbers mean: ``docs/benchmarks/lightning-resume.md``.

    .venv/bin/python benchmarks/lightning_resume.py            # 5 cuts, num_workers 0 and 2
    .venv/bin/python benchmarks/lightning_resume.py --quick    # cuts 21 and 13:6, num_workers 0
"""

from __future__ import annotations

import collections
import concurrent.futures
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, Results, add_options, environment, table
from harness import parser as harness_parser
from harness.workloads import weights_equal

from unbroken.lightning.loops import Place

JOB = REPO / "tests" / "support" / "lightning_job.py"
N, BATCH, EPOCHS = 96, 8, 3  # the job's dataset, batch size and epochs
PER_EPOCH = N // BATCH
TOTAL = PER_EPOCH * EPOCHS
EVERY = 5  # the job's default every_n_train_steps
LOADERS = ("torch", "unbroken")
CUTS = ["7", "21", "30", "13:6", "25"]
QUICK_CUTS = ["21", "13:6"]
WARNING = "unbroken.lightning.ExactResume: "  # how ExactResume's warnings start
# The sweeps (in one process each, two at a time): the job's options after "--every 7 --epochs
# 2". "saves" sweeps resume from every checkpoint the uninterrupted run saved, then twice more
# in a row (--resumes 3) from the first checkpoint of each kind of place each resumed run saved.
SAVES = ("--sweep", "saves", "--resumes", "3")
MAX_STEPS = ("--max-steps", "30", "--epochs", "4")  # 30 steps: 2.5 epochs
TO_0 = ("--sweep", "saves", "--workers", "2", "--resume-workers", "0")
SWEEPS = {
    "plain": SAVES,
    "no-val": (*SAVES, "--no-val", "--checkpoint", "epoch"),
    "accumulate": (*SAVES, "--accumulate", "3"),
    "onecycle": (*SAVES, "--scheduler", "onecycle"),
    "plateau": (*SAVES, "--scheduler", "plateau"),
    "plateau-max-steps": (*SAVES, "--scheduler", "plateau", *MAX_STEPS),
    "plateau-max-steps-no-val": (*SAVES, "--scheduler", "plateau", "--no-val", *MAX_STEPS),
    "max-steps-no-val": (*SAVES, "--no-val", *MAX_STEPS),
    "iterable": (*SAVES, "--iterable"),
    "epoch-metric-no-val": (*SAVES, "--no-val", "--epoch-metric"),
    "draw": (*SAVES, "--draw"),
    "workers-2-to-0": TO_0,
    "workers-2-to-0-draw": (*TO_0, "--draw"),
    "signals-plateau-max-steps": ("--sweep", "signals", "--scheduler", "plateau", *MAX_STEPS),
}
QUICK_SWEEPS = ["plain", "plateau-max-steps", "workers-2-to-0-draw"]  # and --first kinds
ON_LOAD = "resuming from a checkpoint"  # how its warning on loading an inexact checkpoint starts
# ExactResume's warnings that a resumed run is not exact: on load, and at a step drawing from
# numpy or random after the worker counts crossed 0.
RESUME_WARNINGS = ("cannot go on exactly", "global generator")


@dataclass(frozen=True)
class Cut:
    """SIGKILL at the end of training batch ``kill_at`` (from 1) of a run checkpointing every
    ``every`` steps."""

    kill_at: int
    every: int = EVERY

    @classmethod
    def parse(cls, text: str) -> Cut:
        kill_at, _, every = text.partition(":")
        return cls(int(kill_at), int(every) if every else EVERY)

    @property
    def name(self) -> str:
        return str(self.kill_at) if self.every == EVERY else f"{self.kill_at}:{self.every}"

    @property
    def epoch(self) -> int:
        """The epoch the kill is in (from 0)."""
        return (self.kill_at - 1) // PER_EPOCH

    @property
    def checkpoint(self) -> int:
        """The step of the last checkpoint before the kill (0: none)."""
        return (self.kill_at - 1) // self.every * self.every

    @property
    def kind(self) -> str:
        if self.checkpoint and self.checkpoint % PER_EPOCH == 0:
            return "epoch end"  # resumed from a checkpoint at an epoch's last batch
        if self.kill_at % PER_EPOCH == 1 and self.checkpoint // PER_EPOCH < self.epoch:
            return "epoch start"  # killed at an epoch's first batch, checkpoint in an earlier one
        return "mid-epoch"


def run_job(
    out: Path, loader: str, workers: int, every: int, kill_at: int, timeout: float
) -> tuple[float, str]:
    """Run the job once in ``out``: its wall time and stderr. SIGKILLed by itself when
    ``kill_at`` >= 0."""
    command = [sys.executable, str(JOB), str(out), "--loader", loader, "--workers", str(workers)]
    command += ["--every", str(every)]
    if kill_at >= 0:
        command += ["--kill-at", str(kill_at)]
    expect = -signal.SIGKILL if kill_at >= 0 else 0
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    wall = time.perf_counter() - start
    if done.returncode != expect:
        raise SystemExit(
            f"{' '.join(command)}: exit {done.returncode}, expected {expect}\n"
            f"{done.stdout[-2000:]}{done.stderr[-4000:]}"
        )
    return wall, done.stderr


def records(out: Path) -> list[dict]:
    """The job's records (``records-rank0.jsonl``), in the order written."""
    path = out / "records-rank0.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained(stream: list[dict]) -> list[dict]:
    return [r for r in stream if r["kind"] == "train"]


def steps(stream: list[dict]) -> dict[int, dict]:
    """The training record of each optimizer step (``step``: the steps after the batch); a step
    run again after a resume replaces the earlier record."""
    return {r["step"]: r for r in trained(stream)}


def indices(by_step: dict[int, dict]) -> dict[int, list[int]]:
    return {step: r["indices"] for step, r in by_step.items()}


def epoch_damage(by_step: dict[int, dict], epoch: int) -> tuple[int, int]:
    """(samples repeated, samples skipped) in one epoch of the effective stream."""
    seen = [i for r in by_step.values() if r["epoch"] == epoch for i in r["indices"]]
    counts = collections.Counter(seen)
    return sum(c - 1 for c in counts.values()), N - len(counts)


def batches_once(stream: list[dict]) -> bool:
    """Whether every batch of every epoch was trained exactly once (no step dropped either)."""
    positions = collections.Counter((r["epoch"], r["batch"]) for r in trained(stream))
    expected = {(e, b): 1 for e in range(EPOCHS) for b in range(PER_EPOCH)}
    return positions == expected and sorted(steps(stream)) == list(range(1, TOTAL + 1))


def other_epochs(row: dict) -> tuple[int, int]:
    """(samples repeated, samples skipped) summed over the epochs other than the kill's."""
    others = [d for e, d in enumerate(row["per_epoch"]) if e != row["epoch"]]
    return sum(d[0] for d in others), sum(d[1] for d in others)


def checkpoint(out: Path) -> tuple[int | None, int]:
    """(the step of ``last.ckpt``, or None without one; the number of records written before
    it was saved)."""
    path = out / "ckpt" / "last.ckpt"
    if not path.exists():
        return None, 0
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return int(saved["global_step"]), int(saved.get("records_before", 0))


def missing_records(whole: list[dict], stream: list[dict]) -> list[str]:
    """The uninterrupted run's records other than training batches that ``stream`` lacks (or has
    with other values), as "kind epoch[/batch]" (a validation batch, an epoch's start or end)."""
    left = collections.Counter(json.dumps(r, sort_keys=True) for r in stream)
    missing = []
    for r in whole:
        key = json.dumps(r, sort_keys=True)
        if left[key]:
            left[key] -= 1
        elif r["kind"] != "train":
            missing.append(f"{r['kind']} {r['epoch']}" + (f"/{r['batch']}" if "batch" in r else ""))
    return missing


def exact_resume_warnings(stderr: str) -> list[str]:
    """ExactResume's warnings, each once, without its name."""
    found = [line.split(WARNING, 1)[1].strip() for line in stderr.splitlines() if WARNING in line]
    return list(dict.fromkeys(found))


def same(a: object, b: object) -> bool:
    """Bit for bit: tensors with torch.equal, containers element by element."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def run_sweep(name: str, out: Path, quick: bool, timeout: float) -> dict:
    """One sweep (``SWEEPS[name]``) in its own process, and each of its resumes: exact against
    the run it resumed from (records and final states), and whether ExactResume warned."""
    options = (*SWEEPS[name], *(("--first", "kinds") if quick else ()))
    command = [sys.executable, str(JOB), str(out), "--every", "7", "--epochs", "2", *options]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    if done.returncode != 0:
        raise SystemExit(f"sweep {name}: exit {done.returncode}\n{done.stderr[-4000:]}")
    wall = time.perf_counter() - start
    resumes = []
    for run in sorted((out / "runs").iterdir()):
        about = json.loads((run / "about.json").read_text())
        parent = out / "whole"
        if about["parent"] != "whole":
            parent = out / "runs" / about["parent"] / "resumed"
        reference, own = records(parent), records(run / "resumed")
        before = about["records_before"]
        final = [torch.load(d / "final.pt", weights_only=False) for d in (parent, run / "resumed")]
        said = [w for w in about["warnings"] if "is being saved" not in w]
        resumes.append(
            {
                "name": run.name,
                "depth": run.name.count("+") + 1,
                "exact": reference[:before] + own == reference and same(*final),
                "place_exact": Place(**about["saved_at"]).exact if about["saved_at"] else True,
                "warned": any(m in w for w in said for m in RESUME_WARNINGS),
            }
        )
    return {"sweep": name, "options": list(options), "wall_s": wall, "resumes": resumes}


def sweep_row(sweep: dict) -> list[str]:
    resumes = sweep["resumes"]
    depths = [sum(r["depth"] == d for r in resumes) for d in (1, 2, 3)]
    silent = [r for r in resumes if not r["exact"] and not r["warned"]]
    return [
        sweep["sweep"],
        " / ".join(map(str, depths)),
        str(sum(r["exact"] and not r["warned"] for r in resumes)),
        str(sum(not r["exact"] and r["warned"] for r in resumes)),
        str(sum(r["exact"] and r["warned"] for r in resumes)),
        str(len(silent)) if not silent else f"**{len(silent)}**",
        f"{sweep['wall_s']:.0f}",
    ]


def sweep_summary(sweep: dict) -> dict:
    """A sweep's counts (for the JSON), with the names of its silently wrong resumes."""
    resumes = sweep["resumes"]
    return {
        "sweep": sweep["sweep"],
        "options": sweep["options"],
        "wall_s": sweep["wall_s"],
        "resumes_by_depth": [sum(r["depth"] == d for r in resumes) for d in (1, 2, 3)],
        "exact": sum(r["exact"] and not r["warned"] for r in resumes),
        "inexact_warned": sum(not r["exact"] and r["warned"] for r in resumes),
        "exact_warned": sum(r["exact"] and r["warned"] for r in resumes),
        "silent_wrong": [r["name"] for r in resumes if not r["exact"] and not r["warned"]],
    }


QUICK = f"cuts {' and '.join(QUICK_CUTS)} only (mid-epoch, epoch end), num_workers 0"


def main() -> None:
    parser = harness_parser(__doc__, "lightning_resume", QUICK)
    parser.add_argument(
        "--cuts",
        nargs="+",
        default=CUTS,
        metavar="B[:EVERY]",
        help="SIGKILL at the end of batch B (from 1) of a run saving last.ckpt every EVERY "
        f"steps (default {EVERY}); default: %(default)s",
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers")
    add_options(parser, {
        "timeout": (300.0, "seconds per job run"),
        "dir": (REPO / "bench_output", "where the runs' directories go (a fresh subdirectory, "
                "removed at the end)"),
        "keep": (False, "keep the runs' directories"),
    })  # fmt: skip
    parser.add_argument(
        "--sweeps",
        nargs="*",
        choices=list(SWEEPS),
        default=list(SWEEPS),
        help="the sweeps to run (none: no sweep); default: all",
    )
    args = parser.parse_args()
    if args.quick:
        args.cuts, args.workers = list(QUICK_CUTS), [0]
        args.sweeps = [name for name in args.sweeps if name in QUICK_SWEEPS]
    try:
        cuts = [Cut.parse(c) for c in args.cuts]
    except ValueError:
        parser.error(f"--cuts: B or B:EVERY, integers, not {args.cuts}")
    if any(not 0 < c.kill_at < TOTAL or c.every < 1 for c in cuts):
        parser.error(f"--cuts: B between 1 and {TOTAL - 1}, EVERY at least 1")
    everies = sorted({c.every for c in cuts})
    results = Results("lightning_resume", args.json, args)
    lightning_version = importlib.metadata.version("lightning")

    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="lightning_resume-", dir=args.dir))
    rows: list[dict] = []
    sweeps: list[dict] = []
    whole_orders: dict[tuple[str, int, int], dict[int, list[int]]] = {}
    try:
        for workers in args.workers:
            for loader in LOADERS:
                label = f"{loader}, num_workers={workers}"
                wholes: dict[int, tuple[Path, float, dict[int, list[int]]]] = {}
                for every in everies:
                    whole = root / f"{loader}-w{workers}-every{every}-whole"
                    whole.mkdir()
                    whole_s, _ = run_job(whole, loader, workers, every, -1, args.timeout)
                    stream = records(whole)
                    if not batches_once(stream):
                        raise SystemExit(
                            f"{label}, every {every}: the uninterrupted run did not train every "
                            f"batch once: {[(r['epoch'], r['batch']) for r in trained(stream)]}"
                        )
                    reference = indices(steps(stream))
                    wholes[every] = (whole, whole_s, reference)
                    whole_orders[(loader, workers, every)] = reference
                    print(
                        f"[{label}: uninterrupted, last.ckpt every {every}: {whole_s:.1f} s]",
                        file=sys.stderr,
                        flush=True,
                    )
                for cut in cuts:
                    whole, whole_s, reference = wholes[cut.every]
                    out = root / f"{loader}-w{workers}-cut{cut.kill_at}-every{cut.every}"
                    out.mkdir()
                    killed_s, _ = run_job(
                        out, loader, workers, cut.every, cut.kill_at, args.timeout
                    )
                    if (out / "final.pt").exists():
                        raise SystemExit(f"{label}: the run killed at step {cut.kill_at} finished")
                    resumed_from, records_before = checkpoint(out)
                    before = records(out)
                    resumed_s, stderr = run_job(out, loader, workers, cut.every, -1, args.timeout)
                    after = records(out)[len(before) :]
                    # What the killed run did after its checkpoint is lost: the resumed run
                    # goes on from the checkpoint (and a step it runs again replaces it).
                    stream = before[:records_before] + after
                    by_step = steps(stream)
                    repeated, skipped = epoch_damage(by_step, cut.epoch)
                    warned = exact_resume_warnings(stderr)
                    on_load = [w for w in warned if w.startswith(ON_LOAD)]
                    row = {
                        "loader": loader,
                        "workers": workers,
                        "cut": cut.kill_at,
                        "every": cut.every,
                        "kind": cut.kind,
                        "resumed_from": resumed_from,
                        "epoch": cut.epoch,
                        "repeated": repeated,
                        "skipped": skipped,
                        "per_epoch": [list(epoch_damage(by_step, e)) for e in range(EPOCHS)],
                        "steps_equal": indices(by_step) == reference,
                        "batches_once": batches_once(stream),
                        "weights_equal": weights_equal(
                            whole / "final.pt", out / "final.pt", "model"
                        ),
                        "steps_resumed": len(trained(after)),
                        "trained_after_resume": [(r["epoch"], r["batch"]) for r in trained(after)],
                        "records_equal": stream == records(whole),
                        "missing_records": missing_records(records(whole), stream),
                        "warned_on_load": bool(on_load),
                        "warnings": warned,
                        "whole_s": whole_s,
                        "killed_s": killed_s,
                        "resumed_s": resumed_s,
                    }
                    rows.append(row)
                    print(
                        f"[{label}: killed at {cut.kill_at} ({cut.kind}, every {cut.every}), "
                        f"resumed from {resumed_from}: {repeated} repeated, {skipped} skipped, "
                        f"steps equal {row['steps_equal']}, batches once {row['batches_once']}, "
                        f"weights equal {row['weights_equal']}, ExactResume warned on load "
                        f"{bool(on_load)}; {killed_s:.1f} s + {resumed_s:.1f} s]",
                        file=sys.stderr,
                        flush=True,
                    )
        # The sweeps, after the cuts (whose wall times they would disturb), two at a time.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(run_sweep, name, root / f"sweep-{name}", args.quick, 20 * args.timeout)
                for name in args.sweeps
            ]
            for future in futures:
                sweeps.append(future.result())
                print(f"[sweep: {' | '.join(sweep_row(sweeps[-1]))}]", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print(f"[runs kept in {root}]", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    print(
        "# Lightning killed and resumed, mid-epoch and at epoch boundaries: plain (torch's "
        "DataLoader) vs unbroken\n"
    )
    print("\n".join(environment()))
    print(
        f"- lightning {lightning_version}; job: {JOB.relative_to(REPO)} ({N} samples, batch "
        f"{BATCH}: {PER_EPOCH} steps an epoch, {EPOCHS} epochs = {TOTAL} steps; validation "
        f"twice an epoch; last.ckpt every {EVERY} steps unless the cut says B:EVERY; SIGKILL "
        "at the end of batch B, then resumed with ckpt_path='last')"
    )
    print("- one run of each: wall times are whole processes, start-up included\n")

    def yes(value: bool) -> str:
        return "yes" if value else "**no**"

    body = []
    for r in rows:
        body.append(
            [
                r["loader"],
                str(r["workers"]),
                f"{r['cut']} (epoch {r['epoch']})",
                r["kind"],
                str(r["every"]),
                "-" if r["resumed_from"] is None else str(r["resumed_from"]),
                str(r["repeated"]),
                str(r["skipped"]),
                "{} / {}".format(*other_epochs(r)),
                yes(r["steps_equal"]),
                yes(r["batches_once"]),
                yes(r["weights_equal"]),
                ("yes" if r["warned_on_load"] else "no") if r["loader"] == "unbroken" else "-",
                f"{r['whole_s']:.1f}",
                f"{r['killed_s']:.1f}",
                f"{r['resumed_s']:.1f}",
                f"{r['resumed_s'] / r['whole_s']:.2f}",
            ]
        )
    header = [
        "loader",
        "workers",
        "killed at step",
        "cut",
        "ckpt every",
        "resumed from",
        "repeated",
        "skipped",
        "other epochs rep. / skip.",
        "steps equal",
        "batches once",
        "weights equal",
        "ExactResume warned",
        "uninterrupted s",
        "killed run s",
        "resumed run s",
        "resumed / uninterrupted",
    ]
    print(
        results.table(
            f"Killed and resumed: samples repeated and skipped in the interrupted epoch (of {N}), "
            "every batch trained once, equality with the uninterrupted run, wall times",
            table(header, body),
        )
    )
    notes = [
        "cut: mid-epoch (the checkpoint and the kill in one epoch); epoch end (resumed from a "
        "checkpoint at an epoch's last batch: every_n_train_steps divides the epoch); epoch "
        "start (killed at an epoch's first batch, resumed from a checkpoint in an earlier epoch).",
        "repeated/skipped: in the effective stream of the epoch containing the kill (the killed "
        "run's records up to its checkpoint, then the resumed run's; a step run again after the "
        "resume replaces the killed run's); other epochs: the same, summed over the other epochs (a "
        "run killed at an epoch's first batch is resumed from a checkpoint in an earlier one); "
        "steps equal: every step's sample indices equal the "
        "uninterrupted run's (the one with the same checkpoint interval); batches once: every "
        f"batch position (epoch, batch index) of every epoch trained exactly once, {TOTAL} "
        "steps (the samples in them: repeated/skipped, steps equal); weights equal: "
        "final.pt's model state_dict bit-identical (torch.equal); ExactResume warned: as the "
        "resumed run loaded the checkpoint, that it was saved where Lightning itself cannot go "
        "on exactly.",
        "wall times: one run each on a shared 2-core machine, whole processes (Python, "
        "Lightning and the loader workers' start-up included); the resumed run trains only the "
        "steps after its checkpoint, so its start-up is most of its time.",
    ]
    for workers in args.workers:
        a = whole_orders.get(("torch", workers, everies[0]))
        b = whole_orders.get(("unbroken", workers, everies[0]))
        if a is not None and b is not None:
            notes.append(
                f"num_workers={workers}: the uninterrupted runs' sample orders of torch's "
                f"DataLoader and unbroken's are {'the same' if a == b else 'different'} "
                "(unbroken shuffles with its own seeded bijection, not torch.randperm), so "
                "each loader is compared with its own uninterrupted run only."
            )
        for loader in LOADERS:
            orders = [whole_orders.get((loader, workers, e)) for e in everies]
            if len(everies) > 1 and None not in orders:
                same = all(o == orders[0] for o in orders)
                notes.append(
                    f"{loader}, num_workers={workers}: the uninterrupted runs checkpointing every "
                    f"{' and '.join(map(str, everies))} steps trained on "
                    f"{'the same' if same else '**different**'} samples at every step."
                )
    for r in rows:
        if r["loader"] != "unbroken" or r["records_equal"]:
            continue
        said = [w.split(". ")[0] for w in r["warnings"] if w.startswith(ON_LOAD)]
        missing = r["missing_records"]
        notes.append(
            f"unbroken, num_workers={r['workers']}, killed at {r['cut']} (resumed from "
            f"{r['resumed_from']}): the resumed run's records differ from the uninterrupted "
            "run's"
            + (
                f"; it lacks {len(missing)} of its other records: {', '.join(missing)}"
                if missing
                else ""
            )
            + (f"; ExactResume said: {said[0]}." if said else "; ExactResume said nothing.")
        )
    inexact = [
        r
        for r in rows
        if r["loader"] == "unbroken"
        and not (r["weights_equal"] and r["steps_equal"] and r["batches_once"])
    ]
    for r in inexact:
        notes.append(
            f"unbroken NOT exact: num_workers={r['workers']}, killed at {r['cut']} (every "
            f"{r['every']}): trained after the resume (epoch, batch): "
            f"{r['trained_after_resume']}; reproduce with `python {JOB.relative_to(REPO)} OUT "
            f"--loader unbroken --workers {r['workers']} --every {r['every']} --kill-at "
            f"{r['cut']}`, then the same without --kill-at."
        )
    if sweeps:
        header = [
            "sweep",
            "resumes 1st / 2nd / 3rd in a row",
            "exact",
            "inexact, warned",
            "exact, warned",
            "silent wrong",
            "wall s",
        ]
        print()
        print(
            results.table(
                "Sweeps: every checkpoint Lightning can save resumed, then twice more in a row "
                "from each kind of place; each resume against the run it resumed from",
                table(header, [sweep_row(s) for s in sweeps]),
            )
        )
        notes.append(
            "sweeps: tests/support/lightning_job.py --sweep saves|signals in one process (--every 7 "
            f"--epochs 2 and the sweep's options{'; --first kinds' if args.quick else ''}); a "
            "resume is exact when the records of the run it resumed from up to the checkpoint "
            "and its own are that run's, and its final weights, optimizer and scheduler states "
            "equal that run's; warned: ExactResume said, as it loaded the checkpoint (or at the "
            "first step drawing from numpy or random after a change of worker counts), that the "
            "run cannot go on exactly; silent wrong: neither exact nor warned (must be 0)."
        )
        for sweep in sweeps:
            for r in sweep["resumes"]:
                if not r["exact"] and not r["warned"]:
                    notes.append(
                        f"sweep {sweep['sweep']}: {r['name']} resumed SILENTLY WRONG; reproduce "
                        f"with `python {JOB.relative_to(REPO)} OUT --every 7 --epochs 2 "
                        f"{' '.join(sweep['options'])}` and compare OUT/runs/{r['name']} with "
                        "the run it resumed from."
                    )
    results.finish(
        notes,
        {
            "lightning": lightning_version,
            "samples": N,
            "batch_size": BATCH,
            "steps_per_epoch": PER_EPOCH,
            "epochs": EPOCHS,
            "checkpoint_every_steps": EVERY,
            "cuts": [{"cut": c.kill_at, "every": c.every, "kind": c.kind} for c in cuts],
            "workers": args.workers,
            "rows": rows,
            "sweeps": [sweep_summary(sweep) for sweep in sweeps],
        },
    )


if __name__ == "__main__":
    main()
