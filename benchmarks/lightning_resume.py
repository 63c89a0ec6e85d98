"""Lightning 2.6 resumed mid-epoch: plain (torch's DataLoader) vs unbroken.

The job is ``tests/lightning_job.py``, run as a subprocess (as ``tests/test_lightning.py`` runs
it): a small MLP with dropout on 96 samples with a random augmentation, batch 8 (12 steps an
epoch), 3 epochs (36 steps), validating twice an epoch, ``last.ckpt`` every 5 steps, resumed with
``ckpt_path="last"``. ``--loader torch`` is plain Lightning (torch's DataLoader, no callback);
``--loader unbroken`` returns ``unbroken.DataLoader`` and adds ``unbroken.lightning.ExactResume``.

For each loader and each ``--workers`` value: the job uninterrupted, then, per cut point
(``--cuts``, default 7, 21 and 30: mid-epoch in each of the 3 epochs), the job SIGKILLed at the
end of that step (its own ``--kill-at``), then run again in the same directory, which resumes
from the last checkpoint before the cut (5, 20 and 25: the cut step's own save comes after the
kill). Reported per cut, from the job's log of the sample indices of every step (a step run
again after the resume replaces the killed run's):

- samples repeated and skipped in the interrupted epoch (of its 96);
- whether every step trained on the uninterrupted run's samples;
- whether the final weights are bit-identical to the uninterrupted run's (``torch.equal``);
- wall time of the uninterrupted run, of the killed run and of the resumed run (whole processes,
  Python and Lightning start-up included: the resumed run's restart cost is in its total; one
  run each, on a shared machine: a rough figure).

    .venv/bin/python benchmarks/lightning_resume.py            # ~5 minutes on 2 cores
    .venv/bin/python benchmarks/lightning_resume.py --quick    # one cut, num_workers 0 (~1 min)

The numbers also go to ``bench_output/lightning_resume.json`` (``--json PATH``; ``--json ''``
for none), from which ``benchmarks/report.py`` draws the plots and RESULTS.md's generated
section (``make bench``).
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, Results, add_json_option, environment, load_line, table

JOB = REPO / "tests" / "lightning_job.py"
N, BATCH, EPOCHS = 96, 8, 3  # the job's dataset, batch size and epochs
PER_EPOCH = N // BATCH
LOADERS = ("torch", "unbroken")


def run_job(out: Path, loader: str, workers: int, kill_at: int, timeout: float) -> float:
    """Run the job once in ``out``; its wall time. SIGKILLed by itself when ``kill_at`` >= 0."""
    command = [sys.executable, str(JOB), str(out), "--loader", loader, "--workers", str(workers)]
    if kill_at >= 0:
        command += ["--kill-at", str(kill_at)]
    expect = -signal.SIGKILL if kill_at >= 0 else 0
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
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
    return wall


def log_lines(out: Path) -> list[str]:
    path = out / "samples-rank0.txt"
    return path.read_text().splitlines() if path.exists() else []


def steps(out: Path) -> dict[int, list[int]]:
    """The indices trained on at each global step; a step run again replaces the lost one."""
    trained: dict[int, list[int]] = {}
    for line in log_lines(out):
        step, *indices = map(int, line.split())
        trained[step] = indices
    return trained


def epoch_damage(trained: dict[int, list[int]], epoch: int) -> tuple[int, int]:
    """(samples repeated, samples skipped) in one epoch of the effective stream."""
    seen = [
        i for s in range(epoch * PER_EPOCH, (epoch + 1) * PER_EPOCH) for i in trained.get(s, [])
    ]
    counts = collections.Counter(seen)
    return sum(c - 1 for c in counts.values()), N - len(counts)


def weights_equal(a: Path, b: Path) -> bool:
    first, second = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def checkpoint_step(out: Path) -> int | None:
    path = out / "ckpt" / "last.ckpt"
    if not path.exists():
        return None
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cuts", type=int, nargs="+", default=[7, 21, 30], help="steps the job is SIGKILLed at"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job run")
    parser.add_argument(
        "--dir",
        type=Path,
        default=REPO / "bench_output",
        help="where the runs' directories go (a fresh subdirectory, removed at the end)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    parser.add_argument("--quick", action="store_true", help="cut at 21 only, num_workers 0")
    add_json_option(parser, "lightning_resume")
    args = parser.parse_args()
    if args.quick:
        args.cuts, args.workers = [21], [0]
    total = PER_EPOCH * EPOCHS
    if any(not 0 < c < total for c in args.cuts):
        parser.error(f"--cuts: steps between 1 and {total - 1}")
    results = Results("lightning_resume", args.json, args)
    lightning_version = importlib.metadata.version("lightning")

    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="lightning_resume-", dir=args.dir))
    rows, whole_orders = [], {}
    try:
        for workers in args.workers:
            for loader in LOADERS:
                label = f"{loader}, num_workers={workers}"
                whole = root / f"{loader}-w{workers}-whole"
                whole.mkdir()
                whole_s = run_job(whole, loader, workers, -1, args.timeout)
                reference = steps(whole)
                if sorted(reference) != list(range(total)):
                    raise SystemExit(
                        f"{label}: the uninterrupted run logged steps {sorted(reference)}"
                    )
                whole_orders[(loader, workers)] = reference
                print(f"[{label}: uninterrupted {whole_s:.1f} s]", file=sys.stderr, flush=True)
                for cut in args.cuts:
                    out = root / f"{loader}-w{workers}-cut{cut}"
                    out.mkdir()
                    killed_s = run_job(out, loader, workers, cut, args.timeout)
                    if (out / "final.pt").exists():
                        raise SystemExit(f"{label}: the run killed at step {cut} finished")
                    resumed_from = checkpoint_step(out)
                    logged_before = len(log_lines(out))
                    resumed_s = run_job(out, loader, workers, -1, args.timeout)
                    trained = steps(out)
                    epoch = cut // PER_EPOCH
                    repeated, skipped = epoch_damage(trained, epoch)
                    row = {
                        "loader": loader,
                        "workers": workers,
                        "cut": cut,
                        "resumed_from": resumed_from,
                        "epoch": epoch,
                        "repeated": repeated,
                        "skipped": skipped,
                        "steps_equal": trained == reference,
                        "weights_equal": weights_equal(whole, out),
                        "steps_resumed": len(log_lines(out)) - logged_before,
                        "whole_s": whole_s,
                        "killed_s": killed_s,
                        "resumed_s": resumed_s,
                    }
                    rows.append(row)
                    print(
                        f"[{label}: killed at {cut}, resumed from {resumed_from}: "
                        f"{repeated} repeated, {skipped} skipped, steps equal "
                        f"{row['steps_equal']}, weights equal {row['weights_equal']}; "
                        f"{killed_s:.1f} s + {resumed_s:.1f} s]",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if args.keep:
            print(f"[runs kept in {root}]", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    print("# Lightning resumed mid-epoch: plain (torch's DataLoader) vs unbroken\n")
    print("\n".join(environment()))
    print(
        f"- lightning {lightning_version}; job: {JOB.relative_to(REPO)} ({N} samples, batch "
        f"{BATCH}: {PER_EPOCH} steps an epoch, {EPOCHS} epochs = {total} steps; last.ckpt every "
        "5 steps; SIGKILL at the end of the cut step, then resumed with ckpt_path='last')"
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
                "-" if r["resumed_from"] is None else str(r["resumed_from"]),
                str(r["repeated"]),
                str(r["skipped"]),
                yes(r["steps_equal"]),
                yes(r["weights_equal"]),
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
        "resumed from",
        "repeated",
        "skipped",
        "steps equal",
        "weights equal",
        "uninterrupted s",
        "killed run s",
        "resumed run s",
        "resumed / uninterrupted",
    ]
    print(
        results.table(
            f"Killed mid-epoch and resumed: samples repeated and skipped in the interrupted "
            f"epoch (of {N}), equality with the uninterrupted run, wall times",
            table(header, body),
        )
    )
    notes = [
        "repeated/skipped: in the interrupted epoch's effective stream (a step run again after "
        "the resume replaces the killed run's); steps equal: every step's sample indices equal "
        "the uninterrupted run's; weights equal: final state_dict bit-identical (torch.equal).",
        "wall times: one run each on a shared 2-core machine, whole processes (Python, "
        "Lightning and the loader workers' start-up included); the resumed run trains only the "
        "steps after its checkpoint, so its start-up is most of its time.",
    ]
    for workers in args.workers:
        a, b = whole_orders.get(("torch", workers)), whole_orders.get(("unbroken", workers))
        if a is not None and b is not None:
            notes.append(
                f"num_workers={workers}: the uninterrupted runs' sample orders of torch's "
                f"DataLoader and unbroken's are {'the same' if a == b else 'different'} "
                "(unbroken shuffles with its own seeded bijection, not torch.randperm), so "
                "each loader is compared with its own uninterrupted run only."
            )
    inexact = [r for r in rows if r["loader"] == "unbroken" and not r["weights_equal"]]
    for r in inexact:
        notes.append(
            f"unbroken NOT exact: num_workers={r['workers']}, killed at {r['cut']}: reproduce "
            f"with `python {JOB.relative_to(REPO)} OUT --loader unbroken --workers {r['workers']}"
            f" --kill-at {r['cut']}`, then the same without --kill-at."
        )
    print()
    for note in notes:
        print(f"- {note}")
    print()
    print(load_line())
    results.notes = notes
    results.data = {
        "lightning": lightning_version,
        "samples": N,
        "batch_size": BATCH,
        "steps_per_epoch": PER_EPOCH,
        "epochs": EPOCHS,
        "checkpoint_every_steps": 5,
        "cuts": args.cuts,
        "workers": args.workers,
        "rows": rows,
    }
    results.write()


if __name__ == "__main__":
    main()
