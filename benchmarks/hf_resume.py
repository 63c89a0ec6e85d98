"""transformers and Accelerate resumed after a SIGKILL: stock vs unbroken.hf.

How it measures, and what the numbers mean: ``docs/benchmarks/hf-resume.md``.

    .venv/bin/python benchmarks/hf_resume.py            # n=20000, 50 us a sample (~4 min)
    .venv/bin/python benchmarks/hf_resume.py --quick    # n=2000, 0 workers, 95% only (~1.5 min)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from harness import REPO, Results, environment, load_line, table
from harness import parser as harness_parser

HERE = Path(__file__).resolve().parent
JOB = REPO / "tests" / "support" / "hf_trainer_job.py"
WORKER = HERE / "hf_resume_job.py"
N, STEPS = 96, 12  # the exactness job: samples, steps an epoch
SYSTEMS = {
    "transformers.Trainer": [str(JOB), "--stock"],
    "Accelerate + skip_first_batches": [str(WORKER), "loop", "--how", "skip"],
    "Accelerate + stateful loader": [str(WORKER), "loop", "--how", "stateful"],
    "unbroken.hf.Trainer": [str(JOB)],
}
KILL_AT, RESUMED_FROM = 10, 8


def run(command: list[str], out: str, *extra: str) -> int:
    with open(out + ".log", "ab") as log:
        done = subprocess.run(
            [sys.executable, *command, "--out", out, *extra], stdout=log, stderr=log, timeout=900
        )
    return done.returncode


def batches(out: str) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    with open(os.path.join(out, "batches-rank0.jsonl")) as lines:
        for line in lines:
            row = json.loads(line)
            steps[row["step"]] = row  # later lines (the resumed run's) replace earlier ones
    return steps


def exactness(system: str, workers: int, root: str) -> dict:
    command = SYSTEMS[system]
    resume = ["--resume"] if command[0] == str(JOB) else []
    reference, cut = os.path.join(root, "reference"), os.path.join(root, "cut")
    flags = ["--workers", str(workers)]
    assert run(command, reference, *flags) == 0, f"{system}: see {reference}.log"
    assert run(command, cut, *flags, "--kill-at", str(KILL_AT)) != 0
    assert run(command, cut, *flags, *resume) == 0, f"{system}: see {cut}.log"
    want, got = batches(reference), batches(cut)
    epoch = [i for s in range(STEPS) for i in got[s]["index"]]
    resumed = [s for s in want if s >= RESUMED_FROM]
    places = [(s, j) for s in resumed for j in range(len(want[s]["index"]))]
    same = [(s, j) for s, j in places if got[s]["index"][j] == want[s]["index"][j]]
    augmented = [(s, j) for s, j in same if got[s]["aug"][j] == want[s]["aug"][j]]
    expected = torch.load(os.path.join(reference, "weights-rank0.pt"))
    final = torch.load(os.path.join(cut, "weights-rank0.pt"))
    return {
        "repeated": len(epoch) - len(set(epoch)),
        "skipped": N - len(set(epoch)),
        "same_samples": len(same),
        "same_augmentations": len(augmented),
        "places": len(places),
        "weights_equal": all(torch.equal(final[k], expected[k]) for k in expected),
    }


def first_step(system: str, stream: bool, at: int, args: argparse.Namespace, root: str) -> float:
    """The median over ``--rounds`` resumes of one checkpoint, each a fresh process."""
    out = os.path.join(root, f"{system}-{'stream' if stream else 'map'}-{at}")
    common = ["first-step", "--system", system, "--at", str(at), "--n", str(args.n)]
    common += ["--cost-us", str(args.cost_us)] + (["--stream"] if stream else [])
    assert run([str(WORKER), *common, "--phase", "make"], out) == 0, f"see {out}.log"
    measured = []
    for _ in range(args.rounds):
        with open(out + ".log", "ab") as log:
            done = subprocess.run(
                [sys.executable, str(WORKER), *common, "--phase", "resume", "--out", out],
                stdout=subprocess.PIPE,
                stderr=log,
                timeout=900,
                check=True,
            )
        measured.append(json.loads(done.stdout.decode().strip().splitlines()[-1])["seconds"])
    return statistics.median(measured)


QUICK = "n=2000, 1 round, 0 workers, a checkpoint at 95%% only"


def main() -> None:
    parser = harness_parser(__doc__, "hf_resume", QUICK)
    parser.add_argument("--n", type=int, default=20000, help="samples in the timed epoch")
    parser.add_argument("--cost-us", type=float, default=50.0, help="CPU cost of a sample")
    parser.add_argument("--rounds", type=int, default=3, help="timings per point (median)")
    args = parser.parse_args()
    if args.quick:
        args.n, args.rounds = 2000, 1
    results = Results("hf_resume", args.json, args)
    root = tempfile.mkdtemp(prefix="hf-resume-", dir=REPO)
    print("\n".join(environment()))
    print(load_line())
    try:
        rows, data = [], {}
        for workers in (0,) if args.quick else (0, 2):
            for system in SYSTEMS:
                where = os.path.join(root, f"{system}-{workers}".replace(" ", "_"))
                os.makedirs(where)
                found = exactness(system, workers, where)
                data[f"{system}|{workers}"] = found
                rows.append(
                    [
                        system,
                        str(workers),
                        f"{found['repeated']} / {found['skipped']}",
                        f"{found['same_samples']}/{found['places']}",
                        f"{found['same_augmentations']}/{found['places']}",
                        "bit-equal" if found["weights_equal"] else "differ",
                    ]
                )
        header = ["system", "workers", "repeated / skipped", "same samples"]
        header += ["same augmentations", "final weights"]
        print()
        results.show(
            f"SIGKILLed after step {KILL_AT}, resumed from step {RESUMED_FROM} (mid-epoch 0)",
            header,
            rows,
        )
        per_epoch = args.n // 8
        timings, rows = {}, []
        for stream in (False, True):
            for fraction in (0.95,) if args.quick else (0.01, 0.5, 0.95):
                at = max(1, round(fraction * per_epoch))
                seconds = {}
                for system in ("stock", "unbroken"):
                    seconds[system] = first_step(system, stream, at, args, root)
                timings[f"{'stream' if stream else 'map'}|{fraction}"] = seconds
                rows.append(
                    [
                        "stream, no len()" if stream else "map-style",
                        f"{fraction:.0%} (step {at})",
                        f"{seconds['stock']:.2f}",
                        f"{seconds['unbroken']:.2f}",
                        f"{seconds['stock'] / seconds['unbroken']:.1f}x",
                    ]
                )
        print()
        print(
            results.table(
                f"Seconds from train() to the first step after a resume ({args.n} samples an "
                f"epoch, {args.cost_us:g} us a sample, median of {args.rounds})",
                table(
                    ["dataset", "checkpoint at", "transformers (s)", "unbroken (s)", "ratio"],
                    rows,
                    left=2,
                ),
            )
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    note = (
        "each run is a fresh process; the times count from the call of train() (imports and "
        "model creation excluded for both); command: .venv/bin/python benchmarks/hf_resume.py"
        + (" --quick" if args.quick else "")
    )
    print(f"\n{note}")
    results.notes.append(note)
    results.data = {"exactness": data, "first_step_s": timings}
    results.write()


if __name__ == "__main__":
    main()
