"""Goodput of a 3-rank torchrun job under failures of one rank at a time: periodic background
saves alone against the same with just-in-time saves (``Trainer(just_in_time=True)``). The
failures: SIGKILLs in training, SIGKILLs while a background save is written, and one hang
(SIGSTOP), each of a rank drawn at random, rank 0 included.

How it measures, and what the numbers mean: ``docs/benchmarks/goodput-ranks.md``.

    .venv/bin/python benchmarks/goodput_ranks.py               # 6 failures: ~6 min on 2 cores
    .venv/bin/python benchmarks/goodput_ranks.py --quick       # 3 failures: ~4 min
    .venv/bin/python benchmarks/goodput_ranks.py --failures 21 # ~20 min on 2 idle cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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

import unbroken

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput_ranks_job import RANKS, STEPS_PER_EPOCH
from harness import Results, environment, load_line, table
from harness import parser as harness_parser

JOB = Path(__file__).resolve().parent / "goodput_ranks_job.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
JIT_LINE = re.compile(r"just in time: \S+/step-(\d+), ([\d.]+) s after")
JIT_TROUBLE = ("no just-in-time save", "just-in-time save failed", "did not (")


KINDS = ("kill", "save", "hang")  # the order of the tables' columns
WATCHDOG_FLOOR = 60.0  # seconds: the least hang limit the Trainer derives by default


@dataclass
class Failure:
    kind: str  # "kill" (SIGKILL in training), "save" (SIGKILL in a background save), "hang"
    rank: int
    gap: float  # seconds after every rank of the attempt began its first step
    attempt: int = -1  # the attempt it struck
    at: float = 0.0  # time.time() of the signal
    struck: str = ""  # what the victim was doing
    in_save: bool = False  # a background save was being written (its sb, no sw yet)
    resumed: int = -1  # the step the next attempt resumed from
    recomputed: int = -1  # steps begun before it that the next attempt began again
    completed_lost: int = -1  # steps completed before it that the next attempt trained again
    jit_save: float | None = None  # seconds, when a survivor saved for it
    restart: float = 0.0  # seconds from it to the next attempt's first step, less the JIT save
    left_fit: float | None = None  # seconds from it until the last survivor left fit
    noticed: float | None = None  # seconds from it until a survivor left fit or ended


def failure_trace(seed: int, failures: int, saves: int, work: float) -> list[Failure]:
    """``failures`` failures: ``saves`` kills in a background save and the rest kills, in a
    seeded order, then the hang (last: see the docs); each of a random rank. Rank 0 is the
    victim of at least a sixth of them (one at least) and of the first kill in a save, which
    it commits: drawn ranks are moved to 0 where the draw gave it fewer."""
    rng = random.Random(seed)
    kinds = ["kill"] * (failures - 1 - saves) + ["save"] * saves
    rng.shuffle(kinds)
    kinds.append("hang")
    ranks = [rng.randrange(RANKS) for _ in kinds]
    others = [i for i, r in enumerate(ranks) if r != 0]
    rng.shuffle(others)
    for i in others[: max(0, max(1, len(kinds) // 6) - ranks.count(0))]:
        ranks[i] = 0
    in_save = [i for i, k in enumerate(kinds) if k == "save"]
    if in_save and all(ranks[i] != 0 for i in in_save):
        ranks[in_save[0]] = 0
    weights = [rng.uniform(0.3, 1.0) for _ in kinds]
    scale = 0.8 * work / sum(weights)
    return [Failure(k, r, w * scale) for k, r, w in zip(kinds, ranks, weights)]


def has_watchdog() -> bool:
    """Whether this unbroken notices a hung rank by default (a ``hang_timeout`` option)."""
    options = getattr(unbroken.train.options, "TrainerOptions", None)
    return options is not None and any(
        f.name == "hang_timeout" for f in dataclasses.fields(options)
    )


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


def run_job(
    run: Path, options: dict[str, Any], trace: list[Failure], cap: float, hang_in_save: bool = False
) -> tuple[int, dict[tuple[int, int], float]]:
    """torchrun the job, applying ``trace`` (failures struck: ``attempt >= 0``); the exit
    status, and when each rank's process of each attempt was first seen ended. The hang waits
    until the victim has no save under way, or with ``hang_in_save`` until it writes one."""
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
    ended: dict[tuple[int, int], float] = {}  # (attempt, rank): first seen not running

    def poll(seconds: float) -> None:
        time.sleep(seconds)
        events.read()
        for r in range(RANKS):
            for e in events.of(r, "pid"):
                if (int(e[1]), r) not in ended and not alive(int(e[2])):
                    ended[int(e[1]), r] = time.time()

    try:
        for attempt, failure in enumerate(trace):
            started = None
            while started is None and job.poll() is None and time.monotonic() < deadline:
                poll(0.05)
                started = events.first_step(attempt)
            if started is None:
                break  # the job ended (or the cap came) before this failure
            while time.time() < started + failure.gap and job.poll() is None:
                poll(min(0.05, max(0.0, started + failure.gap - time.time())))
            aim = failure.kind == "save" or (failure.kind == "hang" and hang_in_save)
            if aim and not in_a_save(events, failure.rank, attempt, job, deadline):
                break  # the job ended before a background save began
            if failure.kind == "hang" and not hang_in_save:
                while saving(events, failure.rank, attempt) and job.poll() is None:
                    if time.monotonic() > deadline:
                        break
                    poll(0.005)
            pid = int(events.of(failure.rank, "pid", attempt)[0][2])
            events.read()
            if job.poll() is not None or (
                failure.kind == "hang"
                and last_begun(events, failure.rank, attempt) >= options["steps"]
            ):
                break  # a rank stopped in or after the last step can leave its peers done
            os.kill(pid, signal.SIGSTOP if failure.kind == "hang" else signal.SIGKILL)
            failure.attempt, failure.at = attempt, time.time()
            if failure.kind == "hang":
                stopped.append((pid, failure.rank, attempt))
        while job.poll() is None and time.monotonic() < deadline:
            poll(0.05)
            for pid, rank, attempt in stopped:
                if peers_finished(events, rank, attempt):
                    resume(pid)  # torchrun would wait on the stopped rank until the cap
        return job.wait(timeout=max(1.0, deadline - time.monotonic())), ended
    except subprocess.TimeoutExpired:
        return -1, ended
    finally:
        for pid, _, _ in stopped:
            resume(pid)  # never leave a process stopped
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # the cap: every rank, stopped ones included
            job.wait()
        log.close()
        # What only the supervisor knows, kept beside the events (--keep) for a later look.
        kept = {"trace": [asdict(f) for f in trace], "ended": [[*k, v] for k, v in ended.items()]}
        (run / "trace.json").write_text(json.dumps(kept))


def in_a_save(
    events: Events, rank: int, attempt: int, job: subprocess.Popen, deadline: float
) -> bool:
    """Wait until ``rank``'s next background save of ``attempt`` is being written (its ``sb``
    event, polled every 5 ms: a write takes ~0.1 s); False if the job ended first."""
    seen = len(events.of(rank, "sb", attempt))
    while job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
        events.read()
        if len(events.of(rank, "sb", attempt)) > seen:
            return True
    return False


def saving(events: Events, rank: int, attempt: int) -> bool:
    """Whether ``rank`` has a save under way in ``attempt``: its last ``s``, ``sb`` or ``sw``
    event is not an ``sw`` (a hang there waits out the checkpoint's own timeout: see the docs)."""
    moments = [e for e in events.lines[rank] if e[0] in ("s", "sb", "sw") and int(e[1]) == attempt]
    return bool(moments) and moments[-1][0] != "sw"


def last_begun(events: Events, rank: int, attempt: int) -> int:
    """The last step ``rank`` began in ``attempt`` (0: none yet)."""
    return max((int(e[2]) for e in events.of(rank, "b", attempt)), default=0)


def peers_finished(events: Events, rank: int, attempt: int) -> bool:
    """Whether every rank of ``attempt`` but ``rank`` returned from ``fit`` (its ``end``
    event) and exited: the stopped rank then hangs nobody's collective, and torchrun waits on it
    alone. Peers that failed or saved for the hung rank and exited did the hang's work: torchrun
    ends the attempt after its stop grace."""
    peers = [events.of(r, "pid", attempt)[:1] for r in range(RANKS) if r != rank]
    if not all(events.of(r, "end", attempt) for r in range(RANKS) if r != rank):
        return False
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


def analyse(
    run: Path,
    trace: list[Failure],
    rc: int,
    reference: Path | None,
    ended: dict[tuple[int, int], float] | None = None,
) -> dict[str, Any]:
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
        before = [e for e in events.lines[f.rank] if int(e[1]) == a and float(e[-1]) < f.at]
        moments = [e for e in before if e[0] in ("b", "d", "s")]
        f.struck = describe(moments[-1] if moments else None)
        writing = background_save(before, events, a, f.at)
        if writing is not None:
            f.in_save = True
            f.struck += f", its background save of step {writing} in flight"
        match = next((j for j in jits if j[0] == ticks), None)
        if match is not None:
            jits.remove(match)
            f.jit_save = match[1]
        left = [float(e[-1]) for r in range(RANKS) if r != f.rank for e in events.of(r, "x", a)]
        f.left_fit = max(left) - f.at if left else None
        gone = [
            min(
                [float(e[-1]) for e in events.of(r, "x", a)] + [(ended or {}).get((a, r), math.inf)]
            )
            for r in range(RANKS)
            if r != f.rank
        ]
        if min(gone, default=math.inf) < math.inf:
            f.noticed = max(0.0, min(gone) - f.at - (f.jit_save or 0.0))
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


def background_save(before: list[list[str]], events: Events, attempt: int, at: float) -> int | None:
    """The step of the background save the victim was writing at ``at``: its last ``sb``
    before it, with no ``sw`` of that step on any rank before it."""
    begun = [e for e in before if e[0] == "sb"]
    if not begun:
        return None
    step = begun[-1][2]
    written = [
        e for r in range(RANKS) for e in events.of(r, "sw", attempt)
        if e[2] == step and float(e[-1]) < at
    ]  # fmt: skip
    return None if written else int(step)


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
    """The costs ``goodput_sim.py --measured`` reads: the step's and the periodic save's, and
    each kind of failure's (``by_kind``: per policy, then pooled under ``all``)."""
    step = statistics.median(g for r in runs.values() for g in r["step_gaps"])
    around = [g for r in runs.values() for g in r["save_gaps"]]
    failures = [f for name in ("periodic", "jit") for f in runs[name]["failures"]]
    jit_saves = [f["jit_save"] for f in failures if f["jit_save"] is not None]
    kills = [f["restart"] for f in failures if f["kind"] == "kill" and f["restart"] == f["restart"]]
    hangs = [f["restart"] for f in failures if f["kind"] == "hang" and f["restart"] == f["restart"]]
    by_kind = {name: kind_costs(runs[name]["failures"]) for name in ("periodic", "jit")}
    by_kind["all"] = kind_costs(failures)
    return {
        "step_seconds": step,
        "save_seconds": max(0.0, statistics.median(around) - step) if around else 0.0,
        "jit_save_seconds": statistics.median(jit_saves) if jit_saves else 0.0,
        "restart_seconds": statistics.median(kills) if kills else 0.0,
        "saves_timed": len(around),
        "jit_saves_timed": len(jit_saves),
        "kills_timed": len(kills),
        "restart_seconds_hang": statistics.median(hangs) if hangs else None,
        "by_kind": by_kind,
    }


def kind_costs(failures: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of failure: how many, and the medians of the restart (the failure to the next
    first step, less the JIT save), the JIT save and the time until a survivor noticed."""

    def median(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None and v == v]
        return statistics.median(values) if values else None

    out = {}
    for kind in KINDS:
        fs = [f for f in failures if f["kind"] == kind]
        if fs:
            out[kind] = {
                "count": len(fs),
                "restart_seconds": median([f["restart"] for f in fs]),
                "jit_save_seconds": median([f["jit_save"] for f in fs]),
                "noticed_seconds": median([f["noticed"] for f in fs]),
                "steps_recomputed": [f["recomputed"] for f in fs],
                "steps_completed_lost": [f["completed_lost"] for f in fs],
            }
    return out


QUICK = "400 steps, 3 failures: a kill, a kill in a background save (rank 0's), the hang"


def main() -> None:
    parser = harness_parser(__doc__, "goodput_ranks", QUICK)
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps, ~33 ms each (default 1200, 150 a failure above 8)")  # fmt: skip
    parser.add_argument("--interval", type=float, default=5.0, help="periodic save, seconds")
    parser.add_argument("--failures", type=int, default=6,
                        help="failures in all: kills, kills in a background save, one hang")  # fmt: skip
    parser.add_argument("--save-kills", type=int, default=None,
                        help="of them, kills in a background save (default: a fifth, >= 1)")  # fmt: skip
    parser.add_argument("--hang", choices=["auto", "default", "timeout"], default="auto",
                        help="default: the Trainer's and torch's default settings notice the "
                        "hang (needs hang_timeout, the watchdog); timeout: a --pg-timeout "
                        "process group; auto: default where the watchdog is")  # fmt: skip
    parser.add_argument("--hang-in-save", action="store_true",
                        help="the hang strikes while its victim writes a background save "
                        "(default: while it has none under way)")  # fmt: skip
    parser.add_argument("--pg-timeout", type=float, default=5.0,
                        help="--hang timeout's process-group timeout, seconds")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the failure trace's seed")
    parser.add_argument("--cap", type=float, default=None,
                        help="a run's most seconds (default 300 + 30 a failure, +120 for "
                        "a default hang)")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.failures = 400, 3
    if args.steps is None:
        args.steps = max(1200, 150 * args.failures)
    if args.save_kills is None:
        args.save_kills = min(args.failures - 1, max(1, args.failures // 5))
    if args.failures < 1 or not 0 <= args.save_kills <= args.failures - 1:
        parser.error("--failures must be >= 1 (the hang) and --save-kills in [0, failures - 1]")
    if args.hang == "auto":
        args.hang = "default" if has_watchdog() else "timeout"
    elif args.hang == "default" and not has_watchdog():
        parser.error("--hang default: this unbroken has no hang_timeout option, so a hang "
                     "would wait the process group's default 30 minutes; use --hang timeout")  # fmt: skip
    if args.cap is None:
        args.cap = 300.0 + 30.0 * args.failures + (120.0 if args.hang == "default" else 0.0)
    results = Results("goodput_ranks", args.json, args)
    print("\n".join(environment()), flush=True)
    root = Path(tempfile.mkdtemp(prefix="goodput_ranks-"))
    base = {"steps": args.steps, "interval": args.interval, "pg_timeout": args.pg_timeout}
    runs: dict[str, dict[str, Any]] = {}
    print(f"[reference: {args.steps} steps, no failure, no save]", file=sys.stderr, flush=True)
    rc, _ = run_job(root / "none", {**base, "policy": "none"}, [], args.cap)
    runs["none"] = analyse(root / "none", [], rc, None)
    work = runs["none"]["span"]
    if rc != 0 or not work == work:
        raise SystemExit(f"the reference run failed (exit {rc}): see {root / 'none'}/torchrun.log")
    for policy in ("periodic", "jit"):
        trace = failure_trace(args.seed, args.failures, args.save_kills, work)
        options = {**base, "policy": policy, "async_save": True, **hang_options(args, policy)}
        print(f"[{policy}: {len(trace)} failures]", file=sys.stderr, flush=True)
        rc, ended = run_job(root / policy, options, trace, args.cap, args.hang_in_save)
        runs[policy] = analyse(root / policy, trace, rc, root / "none", ended)
        runs[policy]["hang"] = hang_setting(args, policy)
    measured = measured_costs(runs)
    report(results, args, runs, work, measured)
    if args.keep:
        print(f"[runs kept in {root}]", file=sys.stderr)
    else:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def hang_options(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """The job's options for the hang. ``default``: the jit run keeps every default (the
    watchdog notices the hang); the periodic run has no watchdog (it comes with just-in-time
    saves), and torch's default process-group timeout would hold it 30 minutes, so it gets
    the watchdog's floor as its timeout: both notice the hang about as late."""
    if args.hang == "timeout":
        return {"pg_timeout": args.pg_timeout}
    if policy == "jit":
        return {"hang_default": True}
    return {"pg_timeout": WATCHDOG_FLOOR}


def hang_setting(args: argparse.Namespace, policy: str) -> str:
    options = hang_options(args, policy)
    if options.get("hang_default"):
        return "default settings"
    return f"process-group timeout {options['pg_timeout']:g} s"


def report(
    results: Results, args: argparse.Namespace, runs: dict, work: float, measured: dict
) -> None:
    contract = []
    rows, detail = [], []
    for policy in ("periodic", "jit"):
        r = runs[policy]
        fs = r["failures"]
        goodput = work / r["span"] if r["span"] == r["span"] else 0.0
        recomputed = [f["recomputed"] for f in fs]
        contract.append({
            "policy": policy, "ranks": RANKS, "interval_seconds": args.interval,
            "work_seconds": work, "failure_times": [f["at"] - r["start"] for f in fs],
            "failure_kinds": [f["kind"] for f in fs],
            "goodput": goodput, "steps_recomputed": recomputed,
            "steps_completed_lost": [f["completed_lost"] for f in fs],
            "max_recomputed": max(recomputed, default=None), "hang": r["hang"],
            "weights_equal": r["weights_equal"], "finished": r["finished"],
            "attempts": r["attempts"], "wall_seconds": r["span"], "exit_status": r["rc"],
            "step_seconds": statistics.median(r["step_gaps"]) if r["step_gaps"] else None,
            "failures": fs, "jit_trouble": r["jit_trouble"],
        })  # fmt: skip
        rows.append([
            policy, f"{r['span']:.1f}", f"{goodput:.3f}",
            " + ".join(str(sum(f["kind"] == k for f in fs)) for k in KINDS),
            str(sum(f["rank"] == 0 for f in fs)),
            str(sum(f["in_save"] for f in fs)),
            " ".join(map(str, recomputed)) or "-",
            str(max(recomputed, default="-")),
            str(max((f["completed_lost"] for f in fs), default="-")),
            {True: "yes", False: "**no**", None: "?"}[r["weights_equal"]],
            str(r["attempts"]) + ("" if r["finished"] else " (not finished)"),
        ])  # fmt: skip
        for i, f in enumerate(fs):
            detail.append([
                policy, str(i), f["kind"], str(f["rank"]), f"{f['at'] - r['start']:.1f}",
                f["struck"], str(f["resumed"]), str(f["recomputed"]), str(f["completed_lost"]),
                "-" if f["jit_save"] is None else f"{f['jit_save']:.3f}",
                "-" if f["noticed"] is None else f"{f['noticed']:.2f}", f"{f['restart']:.1f}",
            ])  # fmt: skip
    title = (f"3 ranks, {args.steps} steps ({work:.1f} s of work), a background save every "
             f"{args.interval:g} s, the same {args.failures} failures (seed {args.seed}); the "
             f"hang: {runs['jit']['hang']} (jit), {runs['periodic']['hang']} (periodic)")  # fmt: skip
    header = ["policy", "wall (s)", "goodput", "kills + in save + hangs", "rank 0's",
              "struck a save", "steps recomputed", "max recomputed per failure",
              "max completed lost", "weights = reference", "attempts"]  # fmt: skip
    print(f"\n{title}\n\n" + results.table(title, table(header, rows, left=1)), flush=True)
    title = "Each failure: seconds from the run's first step; what the victim was doing"
    header = ["policy", "#", "kind", "rank", "at (s)", "struck", "resumed from", "recomputed",
              "completed lost", "JIT save (s)", "noticed (s)", "restart (s)"]  # fmt: skip
    print(f"\n{title}\n\n" + results.table(title, table(header, detail, left=3)), flush=True)
    title = "Each kind's measured cost (medians; for goodput_sim.py --measured)"
    body = []
    for policy in ("periodic", "jit"):
        for kind, c in measured["by_kind"][policy].items():
            body.append([policy, kind, str(c["count"])] + [
                "-" if c[k] is None else f"{c[k]:.3f}"
                for k in ("noticed_seconds", "jit_save_seconds", "restart_seconds")
            ] + [str(max(c["steps_recomputed"]))])  # fmt: skip
    header = ["policy", "kind", "failures", "noticed (s)", "JIT save (s)", "restart (s)",
              "max recomputed"]  # fmt: skip
    print(f"\n{title}\n\n" + results.table(title, table(header, body, left=2)), flush=True)
    title = "Measured costs (for goodput_sim.py --measured)"
    plain = {k: v for k, v in measured.items() if k != "by_kind"}
    costs = [[k, f"{v:.4f}" if isinstance(v, float) else str(v)] for k, v in plain.items()]
    print(f"\n{title}\n\n" + results.table(title, table(["cost", "value"], costs)), flush=True)
    jit = runs["jit"]
    equal = all(runs[p]["weights_equal"] is True for p in ("periodic", "jit"))
    held = all(f["recomputed"] <= 1 for f in jit["failures"]) and equal
    verdict = (f"jit: {len(jit['failures'])} of {args.failures} failures struck, each recomputed "
               f"at most the step in flight, and both runs' final weights equal the "
               f"reference's: {'yes' if held else 'NO'}")  # fmt: skip
    print(f"\n{verdict}", flush=True)
    results.notes.append(verdict)
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
