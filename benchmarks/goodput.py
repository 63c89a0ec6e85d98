"""Goodput under failures: the share of wall-clock time that becomes training progress when the
machine running a job is killed or preempted at random, for a plain PyTorch loop, Lightning,
Lightning with unbroken, and unbroken's Trainer.

How it measures, and what the numbers mean: ``docs/benchmarks/goodput.md``.

    .venv/bin/python benchmarks/goodput.py             # 4 traces x 9 configurations: 45-50 min
    .venv/bin/python benchmarks/goodput.py --quick     # 1 short trace, every system: 3-4 min
    .venv/bin/python benchmarks/goodput.py --mtbf 60 --intervals 5 10
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from goodput_job import PER_EPOCH, SAMPLES, UNSUPPORTED  # noqa: E402  (stdlib and torch only)
from harness.jobs import kill_group  # noqa: E402
from harness.workloads import weights_equal  # noqa: E402

JOB = HERE / "goodput_job.py"
BUCKET = "goodput"  # on the S3 server this script starts, for the runs in S3
MOTO_KEYS = {"key": "testing", "secret": "testing"}
PEERS = ("plain", "lightning", "lightning-unbroken")
CRASH_LOOP = 3  # sessions in a row failing on their own before any step: the run is given up


# --------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Config:
    """One system with one checkpoint setting: ``every_steps`` for the peers (0: never),
    ``interval`` (``"default"``, ``"auto"`` or seconds) for the Trainer."""

    system: str
    every_steps: int = 0
    interval: str = ""
    store: str = ""  # "s3": the Trainer's run directory on the local S3 server

    @property
    def key(self) -> str:
        if self.system != "trainer":
            return self.system
        return f"trainer-{self.interval}" + ("-s3" if self.store else "")

    @property
    def label(self) -> str:
        if self.store:
            return Config("trainer", interval=self.interval).label + ", run directory in S3"
        if self.system == "trainer":
            if self.interval == "default":
                return f"unbroken Trainer, no option (default: {DEFAULT})"
            if self.interval == "auto":
                return f'unbroken Trainer, "auto"{" (the default)" * (DEFAULT == "auto")}'
            if self.interval == PREVIOUS_DEFAULT:
                return f"unbroken Trainer, every {self.interval} s (the default before auto)"
            return f"unbroken Trainer, every {self.interval} s"
        name = {
            "plain": "plain loop + torch.save",
            "lightning": "Lightning",
            "lightning-unbroken": "Lightning + unbroken",
        }[self.system]
        return name if self.every_steps else f"{name}, no checkpoint"

    @property
    def checkpoint(self) -> str:
        """How often it saves, in words."""
        if self.system != "trainer":
            return f"{self.every_steps} steps" if self.every_steps else "never"
        return {"default": "default", "auto": "auto"}.get(self.interval, f"{self.interval} s")

    def command(self, run_dir: Path, args: argparse.Namespace, probe: bool = False) -> list[str]:
        cmd = [sys.executable, str(JOB), "--system", self.system, "--run-dir", str(run_dir)]
        cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
        if self.system == "trainer":
            cmd += ["--interval", self.interval]
            if self.store:
                cmd += ["--url", store_url(run_dir), "--endpoint", args.s3_endpoint]
        else:
            cmd += ["--every-steps", str(self.every_steps)]
        return cmd + (["--probe"] if probe else [])

    def env(self, run_dir: Path) -> dict[str, str] | None:
        """The job's environment: a run in S3 gets a cache of its own for its local copies."""
        return {**os.environ, "XDG_CACHE_HOME": str(run_dir / "cache")} if self.store else None


def store_url(run_dir: Path) -> str:
    """The run directory in S3 of the run whose local directory is ``run_dir``."""
    return f"s3://{BUCKET}/{hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]}/run"


def forget(config: Config, run_dir: Path, args: argparse.Namespace) -> None:
    """Delete a run's objects in S3 (the server keeps them in memory)."""
    if config.store:
        import s3fs

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": args.s3_endpoint}, **MOTO_KEYS)
        try:
            fs.rm(store_url(run_dir), recursive=True)
        except FileNotFoundError:
            pass


def interval_text(seconds: float) -> str:
    return f"{seconds:g}"


def trainer_default() -> str:
    """What ``Trainer()`` does with no checkpoint option, in words (``"auto"``, ``"600 s"``)."""
    import dataclasses

    from unbroken.train import TrainerOptions

    value = next(
        f.default
        for f in dataclasses.fields(TrainerOptions)
        if f.name == "checkpoint_every_seconds"
    )
    return "never" if value is None else str(value) if isinstance(value, str) else f"{value:g} s"


DEFAULT = trainer_default()
# The user who sets nothing got "auto" from this version on; before it, every 600 s. With the
# default "auto", the "no option" run would repeat the "auto" one: the old default runs instead.
PREVIOUS_DEFAULT = "600"
SECOND = "default" if DEFAULT != "auto" else PREVIOUS_DEFAULT
IN_S3 = Config("trainer", interval="auto", store="s3")


# --------------------------------------------------------------------------- failure traces


def make_trace(mtbf: float, seed: int, horizon: float) -> list[tuple[float, str]]:
    """Failure times (seconds from the run's start) up to ``horizon``, each ``"kill"`` or
    ``"preempt"``; a longer horizon only adds events at the end."""
    rng = random.Random(seed + mtbf)
    events, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf)
        if t > horizon:
            return events
        events.append((t, "preempt" if rng.random() < 0.25 else "kill"))


def quick_trace(
    mtbf: float, seed: int, within: float, settle: float
) -> tuple[int, list[tuple[float, str]]]:
    """``--quick``'s trace: from the first seed from ``seed`` whose trace has a kill and a
    preemption before ``within`` seconds, each ``settle`` seconds or more after the event
    before it (or the start), so that it lands in training rather than in a restart's imports,
    the events up to the later of those two: every system meets both, and nothing after."""
    for candidate in range(seed, seed + 100_000):
        events = make_trace(mtbf, candidate, within)
        times = [0.0] + [t for t, _ in events]
        first: dict[str, int] = {}
        for i, ((t, kind), before) in enumerate(zip(events, times)):
            if t - before >= settle:
                first.setdefault(kind, i)
        if len(first) == 2:
            return candidate, events[: max(first.values()) + 1]
    raise SystemExit(f"no seed from {seed} gives a trace with both kinds within {within:.0f} s")


# --------------------------------------------------------------------------- running a job


@dataclass
class Session:
    pid: int
    spawn: float  # time.time() just before Popen
    exit: float = math.nan
    status: int | None = None


@dataclass
class RunLog:
    """What the supervisor saw of one run."""

    sessions: list[Session] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    kills: int = 0
    preemptions: int = 0
    stopped: str = ""  # why a run did not finish: "" when it did


def run_job(
    config: Config,
    run_dir: Path,
    args: argparse.Namespace,
    trace: list[tuple[float, str]],
    cap: float,
) -> RunLog:
    """Run ``config`` in ``run_dir`` until it writes ``done``, applying ``trace`` (times from
    the first spawn) and restarting it at once whenever it stops; stop it at ``cap`` seconds."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = RunLog()
    pending: list[tuple[float, subprocess.Popen]] = []  # preemptions' SIGKILLs to come
    failures_in_a_row = 0
    log.start = time.time()
    next_event = 0

    def spawn() -> subprocess.Popen:
        out = open(run_dir / f"session-{len(log.sessions)}.out", "wb")
        spawned = time.time()
        proc = subprocess.Popen(
            config.command(run_dir, args),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=HERE.parent,
            env=config.env(run_dir),
        )
        out.close()  # the child has its own descriptor
        log.sessions.append(Session(proc.pid, spawned))
        return proc

    proc = spawn()
    while True:
        now = time.time() - log.start
        deadlines = [cap]
        if next_event < len(trace):
            deadlines.append(trace[next_event][0])
        deadlines += [d for d, _ in pending]
        wait = min(deadlines) - now
        try:
            status = proc.wait(timeout=None if math.isinf(wait) else max(0.0, wait))
        except subprocess.TimeoutExpired:
            status = None
        if status is not None:
            session = log.sessions[-1]
            session.exit, session.status = time.time(), status
            if done(run_dir, session.pid):
                log.end = session.exit
                return log
            if status == UNSUPPORTED:
                log.end, log.stopped = session.exit, "unsupported"
                return log
            started = steps_of_session(run_dir, session.pid) > 0
            failed_alone = status not in (0, 75, -signal.SIGKILL, -signal.SIGTERM)
            failures_in_a_row = 0 if started or not failed_alone else failures_in_a_row + 1
            if failures_in_a_row >= CRASH_LOOP:
                log.end, log.stopped = session.exit, "crash loop"
                return log
            proc = spawn()
            continue
        now = time.time() - log.start
        if now >= cap:
            kill_group(proc, signal.SIGKILL)
            proc.wait()
            session = log.sessions[-1]
            session.exit, session.status = time.time(), proc.returncode
            log.end, log.stopped = session.exit, "cap"
            return log
        for deadline, target in list(pending):
            if deadline <= now:
                pending.remove((deadline, target))
                if target.poll() is None:  # the preempted process outlived its grace
                    kill_group(target, signal.SIGKILL)
        while next_event < len(trace) and trace[next_event][0] <= now:
            _, kind = trace[next_event]
            next_event += 1
            if kind == "kill":
                kill_group(proc, signal.SIGKILL)
                log.kills += 1
            else:
                kill_group(proc, signal.SIGTERM)
                pending.append((now + args.grace, proc))
                log.preemptions += 1


def probe(config: Config, run_dir: Path, args: argparse.Namespace) -> int:
    """The step a restart of a stopped run would resume from (0 if it cannot resume)."""
    with open(run_dir / "probe.out", "wb") as out:
        proc = subprocess.run(
            config.command(run_dir, args, probe=True),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=HERE.parent,
            env=config.env(run_dir),
            timeout=600,
            check=False,
        )
    found = [int(line.split()[1]) for line in read_events(run_dir) if line.startswith("probe ")]
    return found[-1] if proc.returncode == 0 and found else 0


# --------------------------------------------------------------------------- what a run did


def read_events(run_dir: Path) -> list[str]:
    path = run_dir / "events.log"
    return path.read_text().splitlines() if path.exists() else []


@dataclass
class JobSession:
    """One process's lines of ``events.log``."""

    pid: int
    started: float
    resume: int | None = None
    first: float | None = None
    steps: list[tuple[int, list[int]]] = field(default_factory=list)
    saves: list[float] = field(default_factory=list)
    done: float | None = None


def parse_events(run_dir: Path) -> list[JobSession]:
    sessions: list[JobSession] = []
    for line in read_events(run_dir):
        kind, _, rest = line.partition(" ")
        fields = rest.split()
        if kind == "start":
            sessions.append(JobSession(int(fields[1]), float(fields[0])))
        elif not sessions:
            continue
        elif kind == "resume":
            sessions[-1].resume = int(fields[0])
        elif kind == "first":
            sessions[-1].first = float(fields[0])
        elif kind == "step" and len(fields) == 2:
            sessions[-1].steps.append((int(fields[0]), [int(i) for i in fields[1].split(",")]))
        elif kind == "saved":
            sessions[-1].saves.append(float(fields[1]))
        elif kind == "done":
            sessions[-1].done = float(fields[0])
    return sessions


def done(run_dir: Path, pid: int) -> bool:
    return any(s.pid == pid and s.done is not None for s in parse_events(run_dir))


def steps_of_session(run_dir: Path, pid: int) -> int:
    return sum(len(s.steps) for s in parse_events(run_dir) if s.pid == pid)


def kept_steps(sessions: list[JobSession]) -> dict[int, list[int]]:
    """The steps the final model contains, and their sample ids: the last session's steps after
    the step it resumed from; that step's state came from the most recent earlier session that
    trained it, whose steps after its own resume point up to there are kept; and so on back to
    a fresh start (with checkpoints that only move forward, a session resumed from r followed
    by one resumed from r' keeps its steps in (r, r'])."""
    trained = [s for s in sessions if s.resume is not None]
    kept: dict[int, list[int]] = {}
    if not trained:
        return kept
    index, upper = len(trained) - 1, math.inf
    while True:
        session = trained[index]
        assert session.resume is not None
        for step, ids in session.steps:
            if session.resume < step <= upper:
                kept[step] = ids
        if session.resume == 0:
            return kept
        target, upper = session.resume, session.resume
        index = next(
            (j for j in range(index - 1, -1, -1) if any(s == target for s, _ in trained[j].steps)),
            -1,
        )
        if index < 0:
            raise RuntimeError(f"a session resumed from step {target}, which no session trained")


def sample_damage(kept: dict[int, list[int]], epochs: int) -> tuple[int, int]:
    """(trained more than ``epochs`` times, summed; trained fewer times, summed) over the data."""
    counts = Counter(i for ids in kept.values() for i in ids)
    twice = sum(max(0, counts[i] - epochs) for i in range(SAMPLES))
    never = sum(max(0, epochs - counts[i]) for i in range(SAMPLES))
    return twice, never


def output_lines(run_dir: Path) -> list[str]:
    """The Trainer's lines about its start (``first step after``, ``restart to first step``)
    and its checkpoint interval (``checkpoint interval ... s``, with ``"auto"``), from every
    session's output, in order."""
    lines = []
    for k in range(10_000):
        path = run_dir / f"session-{k}.out"
        if not path.exists():
            break
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("unbroken:") and any(
                words in line
                for words in (
                    "first step after",
                    "restart to first step",
                    "checkpoint interval",
                    "took the lease",
                )
            ):
                lines.append(f"session {k}: {line}")
    return lines


def chosen_intervals(lines: list[str]) -> list[float]:
    """The intervals the Trainer said it chose (``checkpoint interval 12.5 s``), in order."""
    found = (re.search(r"checkpoint interval ([0-9.]+) s", line) for line in lines)
    return [float(m.group(1)) for m in found if m]


def last_error(run_dir: Path, log: RunLog) -> str:
    """The last line of the last session's output (an error's message, usually)."""
    path = run_dir / f"session-{len(log.sessions) - 1}.out"
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1].strip() if lines else "(no output)"


def analyze(
    config: Config,
    run_dir: Path,
    log: RunLog,
    args: argparse.Namespace,
    reference_s: float,
    reference_final: Path | None,
) -> dict[str, Any]:
    sessions = parse_events(run_dir)
    by_pid = {s.pid: s for s in sessions}
    finished = not log.stopped
    wall = log.end - log.start
    result: dict[str, Any] = {
        "key": config.key,
        "label": config.label,
        "system": config.system,
        "checkpoint": config.checkpoint,
        "every_steps": config.every_steps,
        "interval": config.interval,
        "finished": finished,
        "stopped": log.stopped,
        "wall_s": wall,
        "kills": log.kills,
        "preemptions": log.preemptions,
        "sessions": len(log.sessions),
        "statuses": [s.status for s in log.sessions],
        "exit0_unfinished": sum(
            1
            for s in log.sessions
            if s.status == 0 and (by_pid.get(s.pid) is None or by_pid[s.pid].done is None)
        ),
        "crashed": sum(
            1 for s in log.sessions if s.status not in (0, 75, -signal.SIGKILL, -signal.SIGTERM)
        ),
        "steps_trained": sum(len(s.steps) for s in sessions),
        "startup_lines": (lines := output_lines(run_dir)),
        "chosen_intervals_s": chosen_intervals(lines),
        "save_s": [x for s in sessions for x in s.saves],
    }
    # Spawn to the first optimizer step, per session that got there.
    to_first = []
    for k, session in enumerate(log.sessions):
        job = by_pid.get(session.pid)
        if job is not None and job.first is not None:
            to_first.append((k, job.first - session.spawn))
    result["fresh_to_first_step_s"] = next((s for k, s in to_first if k == 0), None)
    restarts = [s for k, s in to_first if k > 0]
    result["restart_to_first_step_s"] = restarts
    result["restart_to_first_step_median_s"] = statistics.median(restarts) if restarts else None
    if log.stopped == "unsupported":
        result["error"] = last_error(run_dir, log)
        return result
    if finished:
        try:
            kept = kept_steps(sessions)
        except RuntimeError as error:
            kept, result["history_error"] = {}, str(error)
        if sorted(kept) != list(range(1, args.steps + 1)):
            missing = sorted(set(range(1, args.steps + 1)) - set(kept))
            result.setdefault(
                "history_error",
                f"the kept history is not steps 1..{args.steps} ({len(kept)} kept, missing "
                f"{missing[:10]}...)",
            )
            result["twice"] = result["never"] = None
        else:
            result["twice"], result["never"] = sample_damage(kept, args.steps // PER_EPOCH)
        result["kept_steps"] = args.steps
        result["goodput"] = reference_s / wall
        result["goodput_after_first_failure"] = after_first_failure(
            log, by_pid, args.steps, reference_s
        )
        result["final_equal"] = (
            weights_equal(run_dir / "final.pt", reference_final)
            if reference_final is not None
            else None
        )
    else:
        if log.stopped == "crash loop":
            result["error"] = last_error(run_dir, log)
        result["kept_steps"] = probe(config, run_dir, args)
        result["goodput"] = reference_s / wall * result["kept_steps"] / args.steps
        result["twice"] = result["never"] = result["final_equal"] = None
    result["steps_redone"] = result["steps_trained"] - result["kept_steps"]
    return result


def after_first_failure(
    log: RunLog, by_pid: dict[int, JobSession], steps: int, reference_s: float
) -> float | None:
    """Goodput from the first restart that resumed on: the reference time of the steps left
    after its resume point over the wall time from its spawn to the end. Every configuration
    meets the same failures from there on (the trace's times are the run's), and the first
    failure, which no interval chooser can see coming, is left out: this is how well a way of
    checkpointing does once it has seen one."""
    for session in log.sessions[1:]:
        job = by_pid.get(session.pid)
        if job is not None and job.resume is not None:
            return (steps - job.resume) / steps * reference_s / (log.end - session.spawn)
    return None


# --------------------------------------------------------------------------- printing


def fmt(value: Any, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def equal_text(value: Any) -> str:
    return {True: "yes", False: "**no**", None: "-"}[value]


def goodput_text(row: dict[str, Any]) -> str:
    if row.get("unavailable"):
        return "unavailable"
    text = f"{row['goodput']:.2f}"
    return text if row["finished"] else f"{text}*"


def trace_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in runs:
        if r.get("unavailable"):
            rows.append([r["label"], r["checkpoint"], *["unavailable"] + ["-"] * 11])
            continue
        wall = f"{r['wall_s']:.1f}" + ("" if r["finished"] else f" ({r['stopped']})")
        rows.append(
            [
                r["label"],
                r["checkpoint"],
                wall,
                goodput_text(r),
                fmt(r.get("goodput_after_first_failure")),
                str(r["kills"]),
                str(r["preemptions"]),
                f"{r['exit0_unfinished']} / {r['crashed']}",
                str(r["steps_redone"]),
                fmt(r["twice"], "d"),
                fmt(r["never"], "d"),
                fmt(r["restart_to_first_step_median_s"]),
                fmt(r["fresh_to_first_step_s"]),
                equal_text(r["final_equal"]),
            ]
        )
    return rows


TRACE_HEADER = [
    "system",
    "checkpoint every",
    "wall s",
    "goodput",
    "goodput from the 1st restart on",
    "kills",
    "preemptions",
    "exit 0 unfinished / crashed",
    "steps redone",
    "samples trained twice",
    "samples never trained",
    "restart to 1st step s (median)",
    "fresh start to 1st step s",
    "weights = uninterrupted",
]


# --------------------------------------------------------------------------- the benchmark


QUICK = (
    "2 epochs, one trace (MTBF 5 s, the first seed from --seed whose trace kills and "
    "preempts the job while it trains, cut after those two), one fixed interval (2 s), --cap 4"
)


def main() -> None:
    from harness import add_options
    from harness import parser as harness_parser

    parser = harness_parser(__doc__, "goodput", QUICK)
    add_options(parser, {
        "steps": (10 * PER_EPOCH, f"optimizer steps, a multiple of {PER_EPOCH} (default "
                  "%(default)s: 10 epochs, ~45 s without failures here)"),
    })  # fmt: skip
    parser.add_argument(
        "--mtbf",
        type=float,
        nargs="+",
        default=[30, 60, 120, 300],
        help="mean times between failures, seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--intervals",
        type=float,
        nargs="+",
        default=[2, 5, 10, 20],
        help="the Trainer's fixed checkpoint_every_seconds to sweep (default: %(default)s)",
    )
    add_options(parser, {
        "grace": (5.0, "SIGTERM to SIGKILL, seconds"), "seed": (0, "failure traces' seed"),
        "cap": (6.0, "stop a run at this many reference times"),
        "threads": (1, "the job's torch.set_num_threads"), "keep": (False, "keep the runs' directories"),
    })  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.steps, args.mtbf, args.intervals, args.cap = 2 * PER_EPOCH, [5.0], [2.0], 4.0
    if args.steps % PER_EPOCH or args.steps <= 0:
        parser.error(f"--steps must be a positive multiple of {PER_EPOCH}, got {args.steps}")
    root = Path(tempfile.mkdtemp(prefix="unbroken-goodput-"))
    from unbroken.testing import S3Server

    try:
        with S3Server() as server:  # the Trainer's run directory in S3: a local moto server
            server.make_bucket(BUCKET)
            args.s3_endpoint = server.endpoint
            run(args, root)
    finally:
        if args.keep:
            print(f"[runs kept in {root}]", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def say(text: str) -> None:
    print(f"[{text}]", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, root: Path) -> None:
    from harness import ForeignLoad, Results, environment

    results = Results("goodput", args.json, args)
    probe = ForeignLoad(waited=True)  # every job has exited by the end
    load_start = probe.snapshot()
    epochs = args.steps // PER_EPOCH
    errors: list[str] = []

    # -- references: no failures
    refs_dir = root / "references"
    base = Config("plain")
    say(f"reference: {base.label}, {args.steps} steps")
    log = run_job(base, refs_dir / "plain-none", args, [], cap=math.inf)
    reference = analyze(base, refs_dir / "plain-none", log, args, math.nan, None)
    reference_s = reference["wall_s"]
    job = next(s for s in parse_events(refs_dir / "plain-none") if s.done is not None)
    assert job.first is not None and job.done is not None
    step_s = (job.done - job.first) / (args.steps - 1)
    reference["goodput"] = 1.0
    if reference["twice"] != 0 or reference["never"] != 0:
        raise RuntimeError(f"the plain reference trained samples unevenly: {reference}")
    say(f"reference: {reference_s:.1f} s, {step_s * 1e3:.1f} ms a step")

    def steps_for(seconds: float) -> int:
        return max(1, round(seconds / step_s))

    median_interval = sorted(args.intervals)[len(args.intervals) // 2]
    configs: list[Config] = [Config("trainer", interval=interval_text(i)) for i in args.intervals]
    configs += [Config("trainer", interval="auto"), IN_S3, Config("trainer", interval=SECOND)]
    configs += [Config(p, every_steps=steps_for(median_interval)) for p in PEERS]
    references: dict[str, dict[str, Any]] = {}
    finals: dict[str, Path] = {}
    unavailable: dict[str, str] = {}
    checkpoint_mb = None

    def final_of(key: str) -> Path:
        return refs_dir / key / "final.pt"

    for config in configs:
        run_dir = refs_dir / config.key
        say(f"reference: {config.label} (checkpoint every {config.checkpoint})")
        log = run_job(config, run_dir, args, [], cap=math.inf)
        if log.stopped:
            why = last_error(run_dir, log)
            unavailable[config.key] = why
            say(f"{config.label}: {log.stopped}: {why}")
            if log.stopped != "unsupported":
                errors.append(f"{config.label}: its run without failures failed: {why}")
            references[config.key] = {"label": config.label, "stopped": log.stopped, "error": why}
            continue
        row = analyze(config, run_dir, log, args, reference_s, None)
        if row["twice"] != 0 or row["never"] != 0 or row["sessions"] != 1:
            raise RuntimeError(
                f"{config.label}, uninterrupted: {row['sessions']} session(s), trained twice "
                f"{row['twice']}, never {row['never']} ({row.get('history_error', '')}): "
                f"the benchmark's bookkeeping is wrong ({run_dir}/events.log)"
            )
        references[config.key] = row
        finals[config.key] = run_dir / "final.pt"
        if config.system == "plain" and (run_dir / "checkpoint.pt").exists():
            checkpoint_mb = (run_dir / "checkpoint.pt").stat().st_size / 1e6
        for name in ("ckpt", "run", "cache"):  # final.pt stays; the checkpoints' disk is freed
            shutil.rmtree(run_dir / name, ignore_errors=True)
        forget(config, run_dir, args)
        (run_dir / "checkpoint.pt").unlink(missing_ok=True)
        say(f"{config.label}: {row['wall_s']:.1f} s")

    # Which uninterrupted runs ended with the same weights: a checkpoint must not change the
    # math, so every configuration of a system (and plain with or without checkpoints) agrees.
    same: list[list[str]] = []
    for key, path in [("plain-none", refs_dir / "plain-none" / "final.pt"), *finals.items()]:
        group = next((g for g in same if weights_equal(path, final_of(g[0]))), None)
        if group is None:
            same.append([key])
        else:
            group.append(key)

    # -- traces
    cap = args.cap * reference_s
    traces: list[dict[str, Any]] = []
    for mtbf in args.mtbf:
        if args.quick:
            first = reference["fresh_to_first_step_s"]
            # Each event after 3 s of training or more, both before the run could have ended.
            seed, trace = quick_trace(mtbf, args.seed, reference_s + first, first + 3.0)
        else:
            seed = args.seed
            trace = make_trace(mtbf, seed, cap)
        mtbf_dir = root / f"mtbf-{mtbf:g}"
        runs: dict[str, dict[str, Any]] = {}

        def measure(config: Config, trace=trace, mtbf_dir=mtbf_dir, mtbf=mtbf) -> dict[str, Any]:
            if config.key in unavailable:
                return {
                    "key": config.key,
                    "label": config.label,
                    "checkpoint": config.checkpoint,
                    "unavailable": unavailable[config.key],
                    "finished": False,
                    "goodput": None,
                }
            run_dir = mtbf_dir / config.key
            log = run_job(config, run_dir, args, trace, cap)
            row = analyze(config, run_dir, log, args, reference_s, finals.get(config.key))
            if "history_error" in row:  # the benchmark's own bookkeeping: say so, go on
                errors.append(f"MTBF {mtbf:g} s, {config.label}: {row['history_error']}")
            if not args.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
                forget(config, run_dir, args)
            say(
                f"MTBF {mtbf:g} s: {config.label} (every {config.checkpoint}): "
                f"{row['wall_s']:.1f} s, goodput {goodput_text(row)}, {row['kills']} kills, "
                f"{row['preemptions']} preemptions"
            )
            return row

        fixed = [Config("trainer", interval=interval_text(i)) for i in args.intervals]
        for config in fixed:
            runs[config.key] = measure(config)
        best = max(
            fixed, key=lambda c: (runs[c.key]["goodput"] or 0.0, -runs[c.key].get("wall_s", 0.0))
        )
        best_interval = float(best.interval)
        every = steps_for(best_interval)
        for config in (
            Config("trainer", interval="auto"),
            IN_S3,
            Config("trainer", interval=SECOND),
        ):
            runs[config.key] = measure(config)
        for peer in PEERS:
            runs[peer] = measure(Config(peer, every_steps=every))
        traces.append(
            {
                "mtbf_s": mtbf,
                "seed": seed,
                "events": [[round(t, 3), k] for t, k in trace],
                "best_interval_s": best_interval,
                "best_key": best.key,
                "every_steps": every,
                "runs": runs,
            }
        )
    # The reference once more, to see how far the machine's speed drifted (not used).
    reference_end_s = None
    if not args.quick:
        say(f"reference again: {base.label}")
        log = run_job(base, root / "reference-end", args, [], cap=math.inf)
        reference_end_s = log.end - log.start if not log.stopped else None
    foreign_cores = ForeignLoad.cores(load_start, probe.snapshot())

    # -- printing
    print("# Goodput under failures: plain PyTorch, Lightning, Lightning + unbroken, Trainer\n")
    print("\n".join(environment()))
    print(
        f"- job: MLP 3072-1536-1536-10 + Adam, {args.steps} optimizer steps ({epochs} epochs of "
        f"{PER_EPOCH} batches of 64 of {SAMPLES} samples), 1 process, num_workers 0, "
        f"torch.set_num_threads({args.threads}); a checkpoint of "
        f"{fmt(checkpoint_mb, '.0f', '?')} MB (plain's torch.save file)"
    )
    print(
        f"- reference (goodput 1.0): the plain loop without checkpoints and failures, spawn to "
        f"exit: {reference_s:.1f} s"
        + (
            ""
            if reference_end_s is None
            else f" (again at the end, unused: {reference_end_s:.1f} s)"
        )
        + f"; {step_s * 1e3:.1f} ms an optimizer step; fresh start to the first step "
        f"{reference['fresh_to_first_step_s']:.2f} s"
    )
    print(
        f"- failures: SIGKILL (75%) or SIGTERM + SIGKILL after {args.grace:g} s (25%) to the "
        f"process group, exponential gaps; runs stopped at {args.cap:g}x the reference "
        f"({cap:.0f} s); other processes kept {foreign_cores:.2f} cores busy on average "
        f"(this machine has {len(os.sched_getaffinity(0))})\n"
    )
    ref_rows = [
        [
            "plain loop, no checkpoint",
            "never",
            f"{reference_s:.1f}",
            "1.00",
            fmt(reference["fresh_to_first_step_s"]),
            "0 / 0",
            "-",
        ]
    ]
    for config in configs:
        r = references[config.key]
        if r.get("stopped"):
            ref_rows.append([config.label, config.checkpoint, r["stopped"], "-", "-", "-", "-"])
            continue
        ref_rows.append(
            [
                config.label,
                config.checkpoint,
                f"{r['wall_s']:.1f}",
                f"{r['goodput']:.2f}",
                fmt(r["fresh_to_first_step_s"]),
                f"{r['twice']} / {r['never']}",
                fmt(statistics.median(r["save_s"]), ".3f") if r["save_s"] else "-",
            ]
        )
    results.show("Without failures: each configuration's reference run", [
        "system", "checkpoint every", "wall s", "goodput", "fresh start to 1st step s",
        "trained twice / never", "torch.save s (median)",
    ], ref_rows)  # fmt: skip
    for t in traces:
        print()
        title = (
            f"MTBF {t['mtbf_s']:g} s ({len(t['events'])} failures in the {cap:.0f} s trace, "
            f"seed {t['seed']}): best fixed interval {t['best_interval_s']:g} s = "
            f"{t['every_steps']} steps for the peers"
        )
        print(f"**{title}**\n")
        results.show(title, TRACE_HEADER, trace_rows(list(t["runs"].values())))
    # Summary: goodput by configuration against MTBF.
    labels = {c.key: c.label for c in configs}
    order = [*PEERS, "trainer-best", "trainer-auto", IN_S3.key, f"trainer-{SECOND}"]
    order += [c.key for c in configs if c.key not in order]  # the fixed intervals
    summary = []
    for key in order:
        if key == "trainer-best":
            cells = []
            for t in traces:
                best_row = t["runs"][t["best_key"]]
                cells.append(f"{goodput_text(best_row)} ({t['best_interval_s']:g} s)")
            summary.append(["unbroken Trainer, best fixed interval", "-", *cells])
            continue
        r = references[key]
        none = "-" if r.get("stopped") else f"{r['goodput']:.2f}"
        summary.append([labels[key], none, *[goodput_text(t["runs"][key]) for t in traces]])
    print()
    title = ("Goodput by MTBF (reference time / wall time; * not finished at the cap: times the "
             "share of steps kept)")  # fmt: skip
    results.show(
        title, ["system", "no failures", *[f"MTBF {t['mtbf_s']:g} s" for t in traces]], summary
    )
    notes = [
        "goodput = the plain loop's failure-free time (no checkpoints) / the run's wall time, "
        "first spawn to the exit of the session that finished; restarts are immediate",
        "the peers (plain, Lightning, Lightning + unbroken) checkpoint every N optimizer steps, "
        "N = the trace's best fixed Trainer interval at the failure-free step rate "
        f"({step_s * 1e3:.1f} ms); their failure-free references use the N of "
        f"{median_interval:g} s ({steps_for(median_interval)} steps)",
        "samples trained twice / never: over the steps the final model contains (from "
        f"events.log), each sample's count against {epochs} (the epochs), summed; a finished "
        "run keeps exactly its steps' batches, so the two are equal",
        "weights = uninterrupted: final.pt torch.equal to the configuration's failure-free run",
        "Lightning without unbroken exits 0 after a SIGTERM without saving "
        "(SIGTERMException is a SystemExit): counted in 'exit 0 unfinished / crashed' and "
        "restarted here; a scheduler trusting the exit status would have ended the run there",
        f"{IN_S3.label}: on a local S3 server (moto, 127.0.0.1); its restart to the first step "
        "includes the run's lease, taken at once from the killed process before it (known dead "
        "on this machine), and the checkpoint's reading back from the store and local copies",
    ]
    for key, why in unavailable.items():
        notes.append(f"{references[key]['label']}: unavailable: {why}")
    example = next(
        (
            line
            for t in traces
            for r in t["runs"].values()
            for line in r.get("startup_lines", [])
            if not line.startswith("session 0:") and "took the lease" not in line
        ),
        None,
    )
    if example:
        notes.append(f"the Trainer on a restart says: `{example}`")
    taken = next(
        (
            line
            for t in traces
            for line in t["runs"].get(IN_S3.key, {}).get("startup_lines", [])
            if "took the lease" in line
        ),
        None,
    )
    if taken:
        notes.append(f"{IN_S3.label}, on a restart: `{taken}`")
    for t in traces:
        for key in ("trainer-auto", f"trainer-{SECOND}"):
            chosen = t["runs"].get(key, {}).get("chosen_intervals_s") or []
            steps = [x for i, x in enumerate(chosen) if i == 0 or x != chosen[i - 1]]
            if steps:
                notes.append(
                    f"MTBF {t['mtbf_s']:g} s, {labels[key]}: the intervals it chose, in order "
                    f"(its 'checkpoint interval' lines): {', '.join(f'{x:g}' for x in steps)} s"
                )
    names = {"plain-none": "plain loop, no checkpoint", **labels}
    notes.append(
        "uninterrupted runs with bit-identical final weights: "
        + "; ".join(" = ".join(names[k] for k in group) for group in same)
    )
    notes += errors
    results.finish(
        notes,
        {
            "steps": args.steps,
            "epochs": epochs,
            "per_epoch": PER_EPOCH,
            "samples": SAMPLES,
            "step_s": step_s,
            "reference_s": reference_s,
            "reference_end_s": reference_end_s,
            "reference": reference,
            "checkpoint_mb": checkpoint_mb,
            "cap_s": cap,
            "grace_s": args.grace,
            "foreign_cores": foreign_cores,
            "intervals_s": args.intervals,
            "references": references,
            "unavailable": unavailable,
            "traces": traces,
            "identical_uninterrupted_weights": same,
            "errors": errors,
            # report.py's figure: (run key, label, colour, line style, marker) per line
            "lines": [
                ("plain", "plain loop + torch.save (every N steps)", "torch", "-", "o"),
                ("lightning", "Lightning (every N steps)", "lightning", "-", "s"),
                (
                    "lightning-unbroken",
                    "Lightning + unbroken (every N steps)",
                    "lightning-unbroken",
                    "--",
                    "s",
                ),
                (
                    "trainer-best",
                    "Trainer, best fixed interval (= N)",
                    "unbroken torch-only",
                    ":",
                    "D",
                ),
                ("trainer-auto", 'Trainer, checkpoint_every_seconds="auto"', "unbroken", "-", "^"),
                (IN_S3.key, 'Trainer, "auto", run directory in S3 (local)', "unbroken", ":", "^"),
                (
                    f"trainer-{SECOND}",
                    Config("trainer", interval=SECOND).label.removeprefix("unbroken "),
                    "unbroken none",
                    "-",
                    "v",
                ),
            ],
        },
    )
    if errors:
        raise SystemExit("goodput: " + "; ".join(errors))


if __name__ == "__main__":
    main()
