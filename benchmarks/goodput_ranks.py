"""Goodput of a 3-rank torchrun job under failures of one rank at a time: periodic saves alone
against periodic saves with just-in-time saves (``Trainer(just_in_time=True)``).

How it measures, and what the numbers mean: ``docs/benchmarks/goodput-ranks.md``.

    .venv/bin/python benchmarks/goodput_ranks.py           # 5 kills + 1 hang: ~5 min on 2 cores
    .venv/bin/python benchmarks/goodput_ranks.py --quick   # 1 kill + 1 hang: ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput_ranks_job import RANKS, STEPS_PER_EPOCH
from harness import Results, environment, load_line, table
from harness import parser as harness_parser

JOB = Path(__file__).resolve().parent / "goodput_ranks_job.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
JIT_LINE = re.compile(r"just in time: \S+/step-(\d+), ([\d.]+) s after")
JIT_TROUBLE = ("no just-in-time save", "just-in-time save failed", "did not (")


@dataclass
class Failure:
    kind: str  # "kill" (SIGKILL) or "hang" (SIGSTOP)
    rank: int
    gap: float  # seconds after every rank of the attempt began its first step
    attempt: int = -1  # the attempt it struck
    at: float = 0.0  # time.time() of the signal
    struck: str = ""  # what the victim was doing
    resumed: int = -1  # the step the next attempt resumed from
    recomputed: int = -1  # steps begun before it that the next attempt began again
    completed_lost: int = -1  # steps completed before it that the next attempt trained again
    jit_save: float | None = None  # seconds, when a survivor saved for it
    restart: float = 0.0  # seconds from it to the next attempt's first step, less the JIT save
    left_fit: float | None = None  # seconds from it until the last survivor left fit


def failure_trace(seed: int, kills: int, work: float) -> list[Failure]:
    rng = random.Random(seed)
    kinds = ["kill"] * kills + ["hang"]  # the hang last: see the module
    weights = [rng.uniform(0.3, 1.0) for _ in kinds]
    scale = 0.8 * work / sum(weights)
    return [Failure(k, rng.randrange(RANKS), w * scale) for k, w in zip(kinds, weights)]


class Events:
    """The ranks' events files (see the job), read as they grow."""

    def __init__(self, run: Path) -> None:
        self.paths = [run / f"events.rank{r}.log" for r in range(RANKS)]
        self.offsets = [0] * RANKS
        self.lines: list[list[list[str]]] = [[] for _ in range(RANKS)]

    def read(self) -> list[list[list[str]]]:
        for r, path in enumerate(self.paths):
            if not path.exists():
                continue
            with open(path, "rb") as file:
                file.seek(self.offsets[r])
                data = file.read()
            whole = data[: data.rfind(b"\n") + 1]  # a line being written waits
            self.offsets[r] += len(whole)
            self.lines[r] += [line.split() for line in whole.decode().splitlines()]
        return self.lines

    def of(self, rank: int, kind: str, attempt: int | None = None) -> list[list[str]]:
        return [
            e
            for e in self.lines[rank]
            if e[0] == kind and (attempt is None or int(e[1]) == attempt)
        ]

    def first_step(self, attempt: int) -> float | None:
        """When every rank of ``attempt`` had begun its first step (None: not yet)."""
        firsts = [self.of(r, "b", attempt)[:1] for r in range(RANKS)]
        return max(float(f[0][-1]) for f in firsts) if all(firsts) else None


def run_job(run: Path, options: dict[str, Any], trace: list[Failure], cap: float) -> int:
    """torchrun the job, applying ``trace``; the exit status (failures struck: ``attempt >= 0``)."""
    run.mkdir(parents=True)
    log = open(run / "torchrun.log", "wb")
    command = [TORCHRUN, "--standalone", f"--nproc-per-node={RANKS}"]
    command += [f"--max-restarts={len(trace) + 2}", str(JOB), str(run), json.dumps(options)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    events, deadline = Events(run), time.monotonic() + cap
    stopped: list[tuple[int, int, int]] = []  # (pid, rank, attempt) of each SIGSTOP sent
    try:
        for attempt, failure in enumerate(trace):
            started = None
            while started is None and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
                events.read()
                started = events.first_step(attempt)
            if started is None:
                break  # the job ended (or the cap came) before this failure
            time.sleep(max(0.0, started + failure.gap - time.time()))
            pid = int(events.of(failure.rank, "pid", attempt)[0][2])
            events.read()
            if job.poll() is not None or (
                failure.kind == "hang"
                and last_begun(events, failure.rank, attempt) >= options["steps"]
            ):
                break  # a rank stopped in or after the last step can leave its peers done
            os.kill(pid, signal.SIGKILL if failure.kind == "kill" else signal.SIGSTOP)
            failure.attempt, failure.at = attempt, time.time()
            if failure.kind == "hang":
                stopped.append((pid, failure.rank, attempt))
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            events.read()
            for pid, rank, attempt in stopped:
                if peers_finished(events, rank, attempt):
                    resume(pid)  # torchrun would wait on the stopped rank until the cap
        return job.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return -1
    finally:
        for pid, _, _ in stopped:
            resume(pid)  # never leave a process stopped
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # the cap: every rank, stopped ones included
            job.wait()
        log.close()


def last_begun(events: Events, rank: int, attempt: int) -> int:
    """The last step ``rank`` began in ``attempt`` (0: none yet)."""
    return max((int(e[2]) for e in events.of(rank, "b", attempt)), default=0)


def peers_finished(events: Events, rank: int, attempt: int) -> bool:
    """Whether every rank of ``attempt`` but ``rank`` left ``fit`` without a failure and exited:
    the stopped rank then hangs nobody's collective, and torchrun waits on it alone."""
    peers = [events.of(r, "pid", attempt)[:1] for r in range(RANKS) if r != rank]
    if any(events.of(r, "x", attempt) for r in range(RANKS) if r != rank):
        return False  # the hang did its work: torchrun ends the attempt after its stop grace
    return all(pid and not alive(int(pid[0][2])) for pid in peers)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by torchrun, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def analyse(run: Path, trace: list[Failure], rc: int, reference: Path | None) -> dict[str, Any]:
    """What a finished run did: its span, its failures' costs, its steps' and saves' times."""
    events = Events(run)
    events.read()
    output = (run / "torchrun.log").read_text(errors="replace")
    steps = [
        (int(e[1]), int(e[2]), float(e[3])) for e in events.of(0, "b")
    ]  # rank 0's (attempt, step, time)
    dones = [float(e[3]) for e in events.of(0, "d")]
    attempts = 1 + max((a for a, _, _ in steps), default=0)
    span = dones[-1] - steps[0][2] if steps and dones else float("nan")
    jits = [(int(t), float(x)) for t, x in JIT_LINE.findall(output)]
    struck = [f for f in trace if f.attempt >= 0]
    for f in struck:
        a = f.attempt
        resume = events.of(0, "resume", a + 1)
        f.resumed = int(resume[0][2]) if resume else -1
        ticks = int(resume[0][3]) if resume else -1
        begun = [int(e[2]) for r in range(RANKS) for e in events.of(r, "b", a)]
        done = [int(e[2]) for r in range(RANKS) for e in events.of(r, "d", a)]
        f.recomputed = max(0, max(begun, default=0) - f.resumed)
        f.completed_lost = max(0, max(done, default=0) - f.resumed)
        last = [e for e in events.lines[f.rank] if int(e[1]) == a and float(e[-1]) < f.at][-1:]
        f.struck = describe(last[0] if last else None)
        match = next((j for j in jits if j[0] == ticks), None)
        if match is not None:
            jits.remove(match)
            f.jit_save = match[1]
        left = [float(e[-1]) for r in range(RANKS) if r != f.rank for e in events.of(r, "x", a)]
        f.left_fit = max(left) - f.at if left else None
        first = events.first_step(a + 1)
        f.restart = (first - f.at - (f.jit_save or 0.0)) if first else float("nan")
    gaps, saves = step_gaps(events)
    weights = None
    if reference is not None and (run / "final.pt").exists():
        ours, theirs = (torch.load(p / "final.pt", weights_only=True) for p in (run, reference))
        weights = ours.keys() == theirs.keys() and all(
            torch.equal(ours[k], theirs[k]) for k in ours
        )
    return {
        "rc": rc,
        "finished": bool(events.of(0, "done")),
        "attempts": attempts,
        "start": steps[0][2] if steps else float("nan"),
        "span": span,
        "failures": [asdict(f) for f in struck],
        "unmatched_jit": jits,
        "jit_trouble": [
            line for line in output.splitlines() if any(t in line for t in JIT_TROUBLE)
        ],
        "weights_equal": weights,
        "step_gaps": gaps,
        "save_gaps": saves,
    }


def describe(event: list[str] | None) -> str:
    if event is None:
        return "before its first event"
    kind = event[0]
    if kind == "b":
        return f"in step {event[2]}"
    if kind == "d":
        return f"after step {event[2]}"
    if kind == "s":
        return f"in the save after step {event[2]}"
    return kind


def step_gaps(events: Events) -> tuple[list[float], list[float]]:
    """Rank 0's times between two steps' starts in one attempt: without a save between (none
    across an epoch's end), and around each periodic save."""
    saved = {(int(e[1]), int(e[2])) for e in events.of(0, "s")}
    begun = [(int(e[1]), int(e[2]), float(e[3])) for e in events.of(0, "b")]
    plain, around = [], []
    for (a, s, t), (a2, s2, t2) in zip(begun, begun[1:]):
        if a2 != a or s2 != s + 1 or s % STEPS_PER_EPOCH == 0:
            continue
        (around if (a, s) in saved else plain).append(t2 - t)
    return plain, around


def measured_costs(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    step = statistics.median(g for r in runs.values() for g in r["step_gaps"])
    around = [g for r in runs.values() for g in r["save_gaps"]]
    failures = [f for name in ("periodic", "jit") for f in runs[name]["failures"]]
    jit_saves = [f["jit_save"] for f in failures if f["jit_save"] is not None]
    kills = [f["restart"] for f in failures if f["kind"] == "kill" and f["restart"] == f["restart"]]
    hangs = [f["restart"] for f in failures if f["kind"] == "hang" and f["restart"] == f["restart"]]
    return {
        "step_seconds": step,
        "save_seconds": max(0.0, statistics.median(around) - step) if around else 0.0,
        "jit_save_seconds": statistics.median(jit_saves) if jit_saves else 0.0,
        "restart_seconds": statistics.median(kills) if kills else 0.0,
        "saves_timed": len(around),
        "jit_saves_timed": len(jit_saves),
        "kills_timed": len(kills),
        "restart_seconds_hang": statistics.median(hangs) if hangs else None,
    }


QUICK = "400 steps, 1 kill and the hang"


def main() -> None:
    parser = harness_parser(__doc__, "goodput_ranks", QUICK)
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps (~33 ms each)")
    parser.add_argument("--interval", type=float, default=5.0, help="periodic save, seconds")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs (and one SIGSTOP)")
    parser.add_argument("--pg-timeout", type=float, default=5.0, help="process group, seconds")
    parser.add_argument("--seed", type=int, default=0, help="the failure trace's seed")
    parser.add_argument("--cap", type=float, default=600.0, help="a run's most seconds")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.kills = 400, 1
    results = Results("goodput_ranks", args.json, args)
    print("\n".join(environment()), flush=True)
    root = Path(tempfile.mkdtemp(prefix="goodput_ranks-"))
    base = {"steps": args.steps, "interval": args.interval, "pg_timeout": args.pg_timeout}
    runs: dict[str, dict[str, Any]] = {}
    print(f"[reference: {args.steps} steps, no failure, no save]", file=sys.stderr, flush=True)
    rc = run_job(root / "none", {**base, "policy": "none"}, [], args.cap)
    runs["none"] = analyse(root / "none", [], rc, None)
    work = runs["none"]["span"]
    if rc != 0 or not work == work:
        raise SystemExit(f"the reference run failed (exit {rc}): see {root / 'none'}/torchrun.log")
    for policy in ("periodic", "jit"):
        trace = failure_trace(args.seed, args.kills, work)
        print(f"[{policy}: {len(trace)} failures]", file=sys.stderr, flush=True)
        rc = run_job(root / policy, {**base, "policy": policy}, trace, args.cap)
        runs[policy] = analyse(root / policy, trace, rc, root / "none")
    measured = measured_costs(runs)
    report(results, args, runs, work, measured)
    if args.keep:
        print(f"[runs kept in {root}]", file=sys.stderr)
    else:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def report(
    results: Results, args: argparse.Namespace, runs: dict, work: float, measured: dict
) -> None:
    contract = []
    rows, detail = [], []
    for policy in ("periodic", "jit"):
        r = runs[policy]
        fs = r["failures"]
        goodput = work / r["span"] if r["span"] == r["span"] else 0.0
        contract.append({
            "policy": policy, "ranks": RANKS, "interval_seconds": args.interval,
            "work_seconds": work, "failure_times": [f["at"] - r["start"] for f in fs],
            "goodput": goodput, "steps_recomputed": [f["recomputed"] for f in fs],
            "steps_completed_lost": [f["completed_lost"] for f in fs],
            "weights_equal": r["weights_equal"], "finished": r["finished"],
            "attempts": r["attempts"], "wall_seconds": r["span"], "exit_status": r["rc"],
            "failures": fs, "jit_trouble": r["jit_trouble"],
        })  # fmt: skip
        rows.append([
            policy, f"{args.interval:g}", f"{r['span']:.1f}", f"{goodput:.3f}",
            f"{sum(f['kind'] == 'kill' for f in fs)} + {sum(f['kind'] == 'hang' for f in fs)}",
            " ".join(str(f["recomputed"]) for f in fs) or "-",
            " ".join(str(f["completed_lost"]) for f in fs) or "-",
            {True: "yes", False: "**no**", None: "?"}[r["weights_equal"]],
            str(r["attempts"]) + ("" if r["finished"] else " (not finished)"),
        ])  # fmt: skip
        for i, f in enumerate(fs):
            detail.append([
                policy, str(i), f["kind"], str(f["rank"]), f"{f['at'] - r['start']:.1f}",
                f["struck"], str(f["resumed"]), str(f["recomputed"]),
                "-" if f["jit_save"] is None else f"{f['jit_save']:.3f}",
                "-" if f["left_fit"] is None else f"{f['left_fit']:.2f}", f"{f['restart']:.1f}",
            ])  # fmt: skip
    title = (f"3 ranks, {args.steps} steps ({work:.1f} s of work), periodic save every "
             f"{args.interval:g} s, the same failures (seed {args.seed})")  # fmt: skip
    header = ["policy", "interval (s)", "wall (s)", "goodput", "kills + hangs",
              "steps recomputed", "(completed)", "weights = reference", "attempts"]  # fmt: skip
    print(f"\n{title}\n\n" + results.table(title, table(header, rows, left=1)), flush=True)
    title = "Each failure: seconds from the run's first step; the victim's last event"
    header = ["policy", "#", "kind", "rank", "at (s)", "struck", "resumed from",
              "recomputed", "JIT save (s)", "out of fit (s)", "restart (s)"]  # fmt: skip
    print(f"\n{title}\n\n" + results.table(title, table(header, detail, left=3)), flush=True)
    title = "Measured costs (for goodput_sim.py --measured)"
    costs = [[k, f"{v:.4f}" if isinstance(v, float) else str(v)] for k, v in measured.items()]
    print(f"\n{title}\n\n" + results.table(title, table(["cost", "value"], costs)), flush=True)
    for policy in ("periodic", "jit"):
        for line in runs[policy]["jit_trouble"]:
            results.notes.append(f"{policy}: {line.strip()}")
    print(load_line(), flush=True)
    results.data = {"measured": measured, "runs": contract, "work_seconds": work}
    results.write()
    if results.path:  # the contract of goodput_sim.py --measured/--check, at the top
        path = Path(results.path)
        payload = json.loads(path.read_text())
        payload.update(measured=measured, runs=contract)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(payload, indent=1) + "\n")
        partial.replace(path)


if __name__ == "__main__":
    main()
