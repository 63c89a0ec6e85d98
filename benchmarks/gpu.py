"""The GPU figures (``make bench-gpu``): the Trainer's step against a hand loop, exact_reduce's
cost, and a bit-exact resume after SIGKILLs, on CUDA, in 450 seconds at most (``--budget``).

1. ``trainer_ddp.py`` on CUDA with NCCL: one torchrun job on as many ranks as GPUs, and the same
   comparison in one process without DDP.
2. ``ddp_reduction.py`` on CUDA with NCCL on 3 ranks (and on every GPU, if more): only with 3 or
   more GPUs, since exact_reduce changes nothing below 3 ranks; otherwise it says so.
3. ``tests/support/cuda_job.py`` (bf16 autocast, then fp16 with a GradScaler) run to its end, then run
   again, SIGKILLed at step boundaries and inside steps, restarted each time until it finishes:
   its final weights must equal the uninterrupted run's (``torch.equal``).

Everything goes to ``bench_output/gpu.json`` (``--json``); each script's own JSON beside it, in
``bench_output/gpu/``. Without a GPU it says so in one line and exits 0.

    .venv/bin/python benchmarks/gpu.py                 # on a CUDA machine
    .venv/bin/python benchmarks/gpu.py --device cpu    # a dry run on CPU (gloo, small sizes)
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, Results
from harness import parser as harness_parser
from harness.jobs import kill_group

HERE = Path(__file__).resolve().parent
JOB = REPO / "tests" / "support" / "cuda_job.py"
# (option, value) per killed run, each restarted from the checkpoints the last one left; the
# counts are this process's steps (the job has 36 and saves every 2), so the job finishes after
# the last one. kill_after: at a step's end; kill_in_step: after a step's forward.
KILLS = (("kill_after", 5), ("kill_in_step", 4), ("kill_after", 6), ("kill_in_step", 3))


class Budget:
    """The seconds left of the whole run: no part may run past it."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self, most: float) -> float:
        return max(1.0, min(most, self.deadline - time.monotonic()))


def run(command: list[str], timeout: float) -> int:
    """Run ``command`` in its own process group, output passed through; on timeout the whole
    group (torchrun and its ranks) is SIGKILLed and the return code is None's stand-in, -1."""
    print("=== " + shlex.join(command), flush=True)
    process = subprocess.Popen(command, start_new_session=True)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        process.wait()
        print(f"=== timed out after {timeout:.0f} s: killed", flush=True)
        return -1


def benchmark(script: str, flags: list[str], out: Path, timeout: float) -> dict[str, Any]:
    """``benchmarks/script`` with ``flags``; its JSON results, or why there are none."""
    path = out / f"{Path(script).stem}.json"
    path.unlink(missing_ok=True)
    code = run([sys.executable, str(HERE / script), "--json", str(path), *flags], timeout)
    if code != 0 or not path.exists():
        return {
            "failed": f"exit code {code}" + ("" if code != -1 else f" (timeout {timeout:.0f} s)")
        }
    return json.loads(path.read_text())


def resume_check(precision: str, device: str, out: Path, budget: Budget) -> dict[str, Any]:
    """The job uninterrupted, then killed at KILLS and restarted until it ends: are the final
    weights equal?"""
    root = out / f"resume-{precision}"
    shutil.rmtree(root, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def job(directory: Path, **options: Any) -> int:
        options = {"precision": precision, "device": device, **options}
        command = [sys.executable, str(JOB), str(directory), json.dumps(options)]
        print("=== " + shlex.join(command), flush=True)
        try:
            done = subprocess.run(command, env=env, timeout=budget.left(180), check=False)
        except subprocess.TimeoutExpired:
            return -1
        return done.returncode

    started = time.perf_counter()
    runs: list[dict[str, Any]] = [{"run": "reference", "exit": job(root / "reference")}]
    for option, count in KILLS:
        runs.append({"run": f"{option}={count}", "exit": job(root / "killed", **{option: count})})
    runs.append({"run": "to the end", "exit": job(root / "killed")})
    killed = [r for r in runs[1:-1] if r["exit"] != -signal.SIGKILL]
    result: dict[str, Any] = {"precision": precision, "runs": runs, "equal": False}
    if runs[0]["exit"] or runs[-1]["exit"] or killed:
        result["failed"] = "a run did not exit as planned (0 at the ends, -9 when killed)"
    else:
        expected = torch.load(root / "reference" / "final.pt")
        got = torch.load(root / "killed" / "final.pt")
        differ = [name for name in expected if not torch.equal(expected[name], got[name])]
        result.update(equal=not differ, tensors=len(expected), differ=differ)
    result["seconds"] = time.perf_counter() - started
    shutil.rmtree(root, ignore_errors=True)
    return result


QUICK = "fewer rounds and steps in parts 1 and 2"
PARTS = ("trainer_ddp", "ddp_reduction", "resume")
NOT_RUN = {"skipped": "not in --parts"}


def main() -> None:
    parser = harness_parser(__doc__, "gpu", QUICK)
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the whole pipeline on CPU with gloo at small sizes (a dry run)",
    )
    parser.add_argument(
        "--dry-ranks", type=int, default=3, help="--device cpu: the ranks standing for GPUs"
    )
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all parts")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="which parts to run (default: all three)",
    )
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench-gpu: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return
    budget = Budget(args.budget)
    gpus = torch.cuda.device_count() if cuda else args.dry_ranks
    results = Results("gpu", args.json, args)
    out = Path(args.json).with_suffix("") if args.json else Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    device = [f"--device={args.device}"]
    quick = ["--quick"] if args.quick or not cuda else []

    # 1. The Trainer's step against a hand loop: every GPU in one job, and one process.
    sizes = [] if not cuda else ["--steps", "200", "--rounds", "7"]
    trainer = NOT_RUN
    if "trainer_ddp" in args.parts:
        flags = [*device, "--ranks", str(max(1, gpus)), "--single", *quick, *sizes]
        trainer = benchmark("trainer_ddp.py", flags, out, budget.left(240))
    # 2. exact_reduce against DDP's own all-reduce: from 3 ranks on, where it does anything.
    if "ddp_reduction" not in args.parts:
        reduction = NOT_RUN
    elif gpus >= 3:
        worlds = sorted({3, min(gpus, 8)})
        small = [] if cuda else ["--layers", "3", "--width", "256"]
        flags = [*device, "--ranks", *map(str, worlds), *quick, *small]
        reduction = benchmark("ddp_reduction.py", flags, out, budget.left(150))
    else:
        why = f"{gpus} GPU(s): it needs 3 ranks of a GPU each (exact_reduce acts from 3 on)"
        print(f"=== ddp_reduction.py skipped: {why}", flush=True)
        reduction = {"skipped": why}
    # 3. SIGKILLed and resumed, bit for bit.
    precisions = ("bf16", "fp16") if cuda else ("bf16",)
    resume = []
    if "resume" in args.parts:
        resume = [resume_check(p, args.device, out, budget) for p in precisions]

    name = torch.cuda.get_device_name(0) if cuda else "CPU (dry run)"
    for part in (trainer, reduction):
        results.tables += part.get("tables", [])
        results.notes += part.get("notes", [])
    results.show(
        f"Bit-exact resume on {args.device} (tests/support/cuda_job.py, SIGKILLed {len(KILLS)} times)",
        ["precision", "runs (exit codes)", "final weights", "seconds"],
        [
            [
                r["precision"],
                ", ".join(f"{one['run']}: {one['exit']}" for one in r["runs"]),
                r.get("failed") or ("torch.equal" if r["equal"] else f"DIFFER: {r['differ']}"),
                f"{r['seconds']:.0f}",
            ]
            for r in resume
        ],
        left=3,
    )
    failed = [
        part
        for part, data in (("trainer_ddp", trainer), ("ddp_reduction", reduction))
        if "failed" in data
    ] + [f"resume {r['precision']}" for r in resume if not r["equal"]]
    results.finish(
        [*results.notes, f"device: {name}, {gpus} GPU(s)" if cuda else f"{name}: {gpus} ranks"]
        + ([f"FAILED: {', '.join(failed)}"] if failed else []),
        {
            "device": name,
            "gpus": gpus,
            "trainer_ddp": trainer.get("data", trainer),
            "ddp_reduction": reduction.get("data", reduction),
            "resume": resume,
            "failed": failed,
        },
    )
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
