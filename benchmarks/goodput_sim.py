"""Goodput at scale, simulated: a data-parallel job under failures with three checkpoint policies,
fed with save, restart and step costs (assumed defaults, or measured by ``--measured FILE``).
Each failure is of a kind (a kill, a kill in a background save, a hang) drawn from a mix, and
costs that kind's restart and just-in-time save.

How it measures, and what the numbers mean: ``docs/benchmarks/goodput-sim.md``.

    .venv/bin/python benchmarks/goodput_sim.py
    .venv/bin/python benchmarks/goodput_sim.py --quick
    .venv/bin/python benchmarks/goodput_sim.py --measured bench_output/goodput_ranks.json \
        --check bench_output/goodput_ranks.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, table
from harness import parser as harness_parser

from unbroken.train import schedule  # daly_interval, looked up at each call

LLAMA3_GPU_MTBF = 16384 * 54 * 86400 / 419  # seconds: Llama 3 405B, 419 failures, 54 days
DAY = 86400.0
PARTS = ("train", "saves", "jit", "restart")  # where wall time goes; train includes lost work
EPS = 1e-9
# The kinds of failure: a process killed in training, a process killed while the newest
# periodic save is still being written in the background (that save is lost too), and a
# process that stops running (noticed by a timeout: its restart is longer).
KINDS = ("kill", "save", "hang")


@dataclass(frozen=True)
class KindCost:
    restart: float  # seconds from the failure (after its JIT save) to the next first step
    jit_save: float | None = None  # seconds of its JIT save; None: the Costs' jit_save


@dataclass(frozen=True)
class Costs:
    step: float  # seconds of one optimizer step
    save: float  # seconds a periodic save stalls training
    jit_save: float  # seconds the survivors take to write the state after a failure
    restart: float  # seconds from a failure's end to the first step trained again
    kinds: Mapping[str, KindCost] = field(default_factory=dict)  # a kind's own costs

    def restart_of(self, kind: str) -> float:
        cost = self.kinds.get(kind)
        return self.restart if cost is None else cost.restart

    def jit_save_of(self, kind: str) -> float:
        cost = self.kinds.get(kind)
        return self.jit_save if cost is None or cost.jit_save is None else cost.jit_save

    def single(self) -> Costs:
        """The same costs with every failure a kill's (the model before failures had kinds)."""
        return Costs(self.step, self.save, self.jit_save, self.restart)


@dataclass(frozen=True)
class Policy:
    name: str
    interval: float | None  # from a periodic save's start to the next's; None: no periodic save
    jit: bool = False
    p_jit_fail: float = 0.0


@dataclass(frozen=True)
class Failure:
    time: float  # seconds of wall clock since the job's start
    phase: str  # what it struck: "train", "save", "jit" or "restart"
    lost: float  # seconds of training it lost (0 outside training and saves)
    steps: int  # steps trained again because of it (the step in flight counts)
    kind: str = "kill"  # one of KINDS


@dataclass
class Outcome:
    work: float
    wall: float = 0.0
    spent: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    failures: list[Failure] = field(default_factory=list)
    saves: int = 0  # periodic saves committed
    ignored: int = 0  # failure times after the job ended (a replayed trace)

    @property
    def goodput(self) -> float:
        return self.work / self.wall


class Poisson:
    """Failure times with exponential gaps of mean ``1 / rate``, drawn in blocks; each one's
    kind drawn from ``mix`` (kind: weight; default every one a kill) by a generator of its own,
    so the times do not depend on the mix."""

    def __init__(
        self,
        rate: float,
        rng: np.random.Generator,
        mix: Mapping[str, float] | None = None,
        kinds: np.random.Generator | None = None,
    ) -> None:
        self.rate, self.rng, self.last = rate, rng, 0.0
        self.times: list[float] = []
        mix = {k: w for k, w in (mix or {"kill": 1.0}).items() if w > 0}
        self.names = list(mix)
        total = sum(mix.values())
        self.weights = [w / total for w in mix.values()]
        self.draw = kinds if kinds is not None else np.random.default_rng(0)
        self.kind = "kill"  # the last popped failure's

    def peek(self) -> float:
        if self.rate <= 0:
            return math.inf
        if not self.times:
            gaps = self.rng.exponential(1.0 / self.rate, 64)
            self.times = list(reversed((self.last + np.cumsum(gaps)).tolist()))
        return self.times[-1]

    def pop(self) -> float:
        self.last = self.peek()
        self.times.pop()
        if len(self.names) == 1:
            self.kind = self.names[0]
        else:
            self.kind = self.names[int(self.draw.choice(len(self.names), p=self.weights))]
        return self.last


class Trace:
    """Given failure times (a real run's), in order, with their kinds (default: kills)."""

    def __init__(self, times: list[float], kinds: list[str] | None = None) -> None:
        order = sorted(range(len(times)), key=lambda i: times[i])
        self.times = [times[i] for i in order]
        self.kinds = [kinds[i] if kinds else "kill" for i in order]
        self.next, self.kind = 0, "kill"

    def peek(self) -> float:
        return self.times[self.next] if self.next < len(self.times) else math.inf

    def pop(self) -> float:
        self.next += 1
        self.kind = self.kinds[self.next - 1]
        return self.times[self.next - 1]


def simulate(
    work: float, costs: Costs, policy: Policy, failures: Poisson | Trace, coin: np.random.Generator
) -> Outcome:
    """One job of ``work`` seconds (rounded to whole steps) under ``failures``; ``coin`` decides
    which JIT saves fail. Each failure's kind sets its restart and JIT save (``Costs.kinds``);
    a ``save`` one also loses the newest periodic save, still being written. Returns where the
    wall time went and what each failure lost."""
    step, n = costs.step, max(1, round(work / costs.step))
    out = Outcome(work=n * step)
    seg = (
        n
        if policy.interval is None
        else max(1, math.ceil((policy.interval - costs.save) / step - EPS))
    )
    t, committed = 0.0, 0  # committed: steps in the last committed checkpoint
    while True:
        # A session from `committed`: `seg` steps, a save, ..., the last steps (no save after).
        remaining = n - committed
        cycles = math.ceil(remaining / seg) - 1  # periodic saves before the end
        train_s, cycle_s = seg * step, seg * step + costs.save
        duration = remaining * step + cycles * costs.save
        f = failures.peek()
        if f >= t + duration:
            out.spent["train"] += remaining * step
            out.spent["saves"] += cycles * costs.save
            out.saves += cycles
            out.wall = t + duration
            if isinstance(failures, Trace):
                out.ignored = len(failures.times) - failures.next
            return out
        failures.pop()
        kind = struck = failures.kind
        d = f - t
        i = min(int(d // cycle_s), cycles)  # the cycle struck; its saves before it committed
        r = d - i * cycle_s
        start = committed + i * seg
        in_save = r >= train_s and i < cycles
        # A kill in a background save: the newest save started (the one that ended the cycle
        # before) was still being written, and is lost with the process.
        unsaved = struck == "save" and not in_save and i >= 1
        out.spent["train"] += i * train_s + min(r, train_s)
        out.spent["saves"] += i * costs.save + (r - train_s if in_save else 0.0)
        out.saves += i - unsaved
        done = start + seg if in_save else start + int((r + EPS) // step)  # steps completed
        progress = (start + seg) * step if in_save else start * step + r  # training reached
        t, committed, later = f, start - (seg if unsaved else 0), None
        if policy.jit and done > committed:  # the survivors write the last completed step's
            g, jit_save = failures.peek(), costs.jit_save_of(kind)
            if g < t + jit_save:  # a second failure kills the JIT save
                out.spent["jit"] += g - t
                t = failures.pop()
                later = Failure(t, "jit", 0.0, 0, failures.kind)
                kind = failures.kind  # its restart is the one that follows
            else:
                out.spent["jit"] += jit_save
                t += jit_save
                if coin.random() >= policy.p_jit_fail:
                    committed = done
        lost = max(0.0, progress - committed * step)
        phase = "save" if in_save else "train"
        out.failures.append(Failure(f, phase, lost, math.ceil(lost / step - EPS), struck))
        if later is not None:
            out.failures.append(later)
        while True:  # the restart, started again by each failure that strikes it
            g, restart = failures.peek(), costs.restart_of(kind)
            if g >= t + restart:
                out.spent["restart"] += restart
                t += restart
                break
            out.spent["restart"] += g - t
            t = failures.pop()
            kind = failures.kind
            out.failures.append(Failure(t, "restart", 0.0, 0, kind))
        if len(out.failures) > 10**6:
            raise RuntimeError(
                f"{policy.name}: over a million failures before {work:.0f} s of work finished "
                f"(restart {costs.restart} s against failures this frequent): lower the rate"
            )


def policies(
    intervals: list[float], costs: Costs, job_mtbf: float, p_jit_fail: float
) -> list[Policy]:
    """``fixed`` at each interval, ``auto`` (the library's Daly interval) and ``jit``."""
    auto = schedule.daly_interval(costs.save, job_mtbf)
    fixed = [Policy(f"fixed {t:g} s", t) for t in intervals]
    return [*fixed, Policy("auto", auto), Policy("jit", auto, jit=True, p_jit_fail=p_jit_fail)]


def replicate(
    work: float,
    costs: Costs,
    policy: Policy,
    rate: float,
    replicas: int,
    seed: int,
    mix: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """``replicas`` seeded jobs: goodput's mean, the 95% interval of the mean and of the jobs,
    and the hours per job of each part of the wall time."""
    goodput, failures = np.empty(replicas), np.empty(replicas)
    hours = dict.fromkeys([*PARTS, "lost"], 0.0)
    for k in range(replicas):
        # The failure times and kinds depend on (seed, k) only: every policy sees the same.
        kinds = np.random.default_rng([seed, k, 2])
        trace = Poisson(rate, np.random.default_rng([seed, k, 0]), mix, kinds)
        out = simulate(work, costs, policy, trace, np.random.default_rng([seed, k, 1]))
        goodput[k], failures[k] = out.goodput, len(out.failures)
        for part in PARTS:
            hours[part] += out.spent[part] / 3600 / replicas
        hours["lost"] += sum(x.lost for x in out.failures) / 3600 / replicas
    half = 1.96 * goodput.std(ddof=1) / math.sqrt(replicas) if replicas > 1 else math.nan
    return {
        "policy": policy.name,
        "interval_s": policy.interval,
        "failures": float(failures.mean()),
        "goodput": float(goodput.mean()),
        "mean_ci95": [float(goodput.mean() - half), float(goodput.mean() + half)],
        "jobs_95": [float(x) for x in np.percentile(goodput, [2.5, 97.5])],
        "hours": hours,
    }


def scenario_rows(
    args: argparse.Namespace,
    costs: Costs,
    label: str,
    mix: Mapping[str, float] | None = None,
    jit_costs: Costs | None = None,
) -> list[dict[str, Any]]:
    """The scenario's rows: ``costs`` for the periodic policies, ``jit_costs`` (default the
    same) for ``jit``, each failure's kind drawn from ``mix``."""
    rows = []
    for gpus in args.gpus:
        job_mtbf = args.gpu_mtbf / gpus
        for policy in policies(args.intervals, costs, job_mtbf, args.p_jit_fail):
            own = jit_costs if policy.jit and jit_costs is not None else costs
            row = replicate(
                args.work_days * DAY, own, policy, 1 / job_mtbf, args.replicas, args.seed, mix
            )
            rows.append({"costs": label, "gpus": gpus, "job_mtbf_h": job_mtbf / 3600, **row})
    return rows


def scenario_table(rows: list[dict[str, Any]]) -> str:
    header = ["GPUs", "MTBF (h)", "policy", "interval (s)", "failures", "goodput",
              "95% CI", "95% of jobs", "saves (h)", "lost (h)", "JIT (h)", "restarts (h)"]  # fmt: skip
    body = []
    for r in rows:
        h = r["hours"]
        body.append([
            f"{r['gpus']:,}", f"{r['job_mtbf_h']:.1f}", r["policy"], f"{r['interval_s']:.0f}",
            f"{r['failures']:.1f}", f"{r['goodput']:.4f}",
            "{:.4f}-{:.4f}".format(*r["mean_ci95"]), "{:.4f}-{:.4f}".format(*r["jobs_95"]),
            f"{h['saves']:.1f}", f"{h['lost']:.1f}", f"{h['jit']:.1f}", f"{h['restart']:.1f}",
        ])  # fmt: skip
    return table(header, body, left=3)


def read_ranks(path: Path) -> tuple[Costs, list[dict[str, Any]]]:
    """The measured costs and runs of ``path`` (the 3-rank benchmark's JSON), checked field by
    field: a wrong one is named with what was found and what is expected."""
    where = f"{path} (written by the 3-rank torchrun goodput benchmark)"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"cannot read {where}: {error}; run that benchmark first") from None

    def number(value: Any, name: str, allow_none: bool = False) -> Any:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        if ok or (allow_none and value is None):
            return value
        raise SystemExit(f"{where}: {name} is {value!r}; expected a number >= 0")

    measured = data.get("measured") if isinstance(data, dict) else None
    if not isinstance(measured, dict):
        raise SystemExit(f"{where}: no 'measured' object; expected step/save/jit_save/restart")
    costs = Costs(*(number(measured.get(f"{k}_seconds"), f"measured.{k}_seconds")
                    for k in ("step", "save", "jit_save", "restart")))  # fmt: skip
    if costs.step <= 0:
        raise SystemExit(f"{where}: measured.step_seconds is 0; expected a step's seconds")
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs:
        raise SystemExit(f"{where}: 'runs' is {runs!r}; expected a non-empty list of runs")
    for i, run in enumerate(runs):
        if not isinstance(run, dict) or run.get("policy") not in ("periodic", "jit"):
            found = run.get("policy") if isinstance(run, dict) else run
            raise SystemExit(
                f"{where}: runs[{i}].policy is {found!r}; expected 'periodic' or 'jit'"
            )
        number(run.get("interval_seconds"), f"runs[{i}].interval_seconds", allow_none=True)
        number(run.get("work_seconds"), f"runs[{i}].work_seconds")
        number(run.get("goodput"), f"runs[{i}].goodput")
        times = run.get("failure_times")
        if not isinstance(times, list):
            raise SystemExit(f"{where}: runs[{i}].failure_times is {times!r}; expected a list")
        for j, t in enumerate(times):
            number(t, f"runs[{i}].failure_times[{j}]")
        kinds = run_kinds(run)
        if any(k not in KINDS for k in kinds):
            found = next(k for k in kinds if k not in KINDS)
            raise SystemExit(f"{where}: runs[{i}] has a failure of kind {found!r}; expected one "
                             f"of {', '.join(KINDS)}")  # fmt: skip
    return costs, runs


def run_kinds(run: dict[str, Any]) -> list[str]:
    """Each replayed failure's kind: ``failure_kinds``, else the kinds of ``failures`` (files
    written before ``failure_kinds``), else kills."""
    times = run.get("failure_times") or []
    kinds = run.get("failure_kinds")
    if not isinstance(kinds, list):
        failures = run.get("failures")
        kinds = [f.get("kind") for f in failures] if isinstance(failures, list) else None
    return list(kinds) if kinds is not None and len(kinds) == len(times) else ["kill"] * len(times)


def kind_costs(costs: Costs, runs: list[dict[str, Any]]) -> Costs:
    """``costs`` with each kind's own restart and JIT save: the medians over ``runs``'
    failures of that kind (those a next attempt followed)."""

    def median(values: list[Any]) -> float | None:
        values = [v for v in values if isinstance(v, (int, float)) and v == v and v >= 0]
        return statistics.median(values) if values else None

    failures = [f for run in runs for f in run.get("failures") or [] if isinstance(f, dict)]
    kinds = {}
    for kind in KINDS:
        restart = median([f.get("restart") for f in failures if f.get("kind") == kind])
        if restart is not None:
            jit_save = median([f.get("jit_save") for f in failures if f.get("kind") == kind])
            kinds[kind] = KindCost(restart, jit_save)
    return Costs(costs.step, costs.save, costs.jit_save, costs.restart, kinds)


def measured_model(path: Path) -> tuple[Costs, Costs, dict[str, float]]:
    """From the 3-rank benchmark's file: the periodic run's costs by kind (for the periodic
    policies), the jit run's (for ``jit``), and the mix of kinds of their failures."""
    costs, runs = read_ranks(path)
    periodic = kind_costs(costs, [r for r in runs if r["policy"] == "periodic"])
    jit = kind_costs(costs, [r for r in runs if r["policy"] == "jit"])
    kinds = [k for r in runs for k in run_kinds(r)]
    mix = {k: kinds.count(k) / len(kinds) for k in KINDS if k in kinds} if kinds else {}
    return periodic, jit, mix or {"kill": 1.0}


def check(path: Path) -> tuple[list[dict[str, Any]], str, Costs]:
    """Each real run's failures replayed through the model with the measured costs: at their
    times, each with its kind's cost; and, beside it, with one restart cost for every failure
    (every failure a kill: the model before failures had kinds)."""
    costs, runs = read_ranks(path)
    rows = []
    for i, run in enumerate(runs):
        policy = Policy(run["policy"], run["interval_seconds"], jit=run["policy"] == "jit")
        own = kind_costs(costs, [r for r in runs if r["policy"] == run["policy"]])
        kinds = run_kinds(run)
        out = simulate(
            run["work_seconds"],
            own,
            policy,
            Trace(run["failure_times"], kinds),
            np.random.default_rng(0),
        )
        single = simulate(
            run["work_seconds"],
            costs.single(),
            policy,
            Trace(run["failure_times"]),
            np.random.default_rng(0),
        )
        rows.append({
            "run": i, "policy": run["policy"], "interval_s": run["interval_seconds"],
            "failures": len(run["failure_times"]), "replayed": len(out.failures),
            "kinds": kinds, "measured": run["goodput"], "predicted": out.goodput,
            "predicted_one_restart": single.goodput,
            "restarts": {k: c.restart for k, c in own.kinds.items()},
            "steps_measured": run.get("steps_recomputed"),
            "steps_predicted": [x.steps for x in out.failures],
        })  # fmt: skip
    header = ["run", "policy", "interval (s)", "failures (replayed)", "measured", "predicted",
              "predicted - measured", "steps recomputed (measured)", "(predicted)"]  # fmt: skip
    body = [[
        str(r["run"]), r["policy"], "none" if r["interval_s"] is None else f"{r['interval_s']:g}",
        f"{r['failures']} ({r['replayed']})", f"{r['measured']:.3f}", f"{r['predicted']:.3f}",
        f"{r['predicted'] - r['measured']:+.3f}",
        " ".join(map(str, r["steps_measured"] or [])) or "-",
        " ".join(map(str, r["steps_predicted"])) or "-",
    ] for r in rows]  # fmt: skip
    return rows, table(header, body, left=2), costs


QUICK = "50 replicas: seconds"


def main(argv: list[str] | None = None) -> None:
    parser = harness_parser(__doc__, "goodput_sim", QUICK)
    parser.add_argument("--scenario", choices=["llama3"], default="llama3")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1000, 16384])
    parser.add_argument("--gpu-mtbf", type=float, default=LLAMA3_GPU_MTBF,
                        help="seconds between failures of one GPU (default: Llama 3's, "
                        "16,384 GPUs x 54 days / 419 interruptions = %(default).4g)")  # fmt: skip
    parser.add_argument("--work-days", type=float, default=30.0, help="failure-free compute")
    parser.add_argument("--intervals", type=float, nargs="+", default=[300.0, 1800.0],
                        help="fixed policies' seconds from one save's start to the next's")  # fmt: skip
    # Assumed orders of magnitude, not measured: the Llama 3 report gives the failure rate, not
    # these. A blocking save of a replicated state to a shared file system takes seconds to a
    # minute; a restart (scheduler, process start, NCCL rendezvous, load, first step) minutes.
    parser.add_argument("--save", type=float, default=20.0, help="assumed: blocking save stall, s")
    parser.add_argument("--restart", type=float, default=300.0, help="assumed: restart, s")
    parser.add_argument("--step", type=float, default=2.0, help="assumed: one optimizer step, s")
    parser.add_argument("--jit-save", type=float, default=20.0,
                        help="assumed: the survivors' save after a failure, s (the periodic one's)")  # fmt: skip
    parser.add_argument("--hang-extra", type=float, default=90.0,
                        help="assumed: a hang's restart beyond a kill's, s (the hang watchdog's "
                        "60-s floor and torchrun's 30-s stop grace)")  # fmt: skip
    parser.add_argument("--mix", type=parse_mix, default=None,
                        help="each failure's kind drawn with these weights, e.g. "
                        "kill=0.8,save=0.1,hang=0.1 (default: every one a kill with the "
                        "assumed costs; the measured runs' mix with --measured)")  # fmt: skip
    parser.add_argument("--p-jit-fail", type=float, default=0.0, help="a JIT save's failure chance")
    parser.add_argument("--replicas", type=int, default=None, help="jobs per row (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measured", type=Path, help="also a table with FILE's measured costs")
    parser.add_argument("--check", type=Path, help="replay FILE's real runs (goodput_ranks.json)")
    args = parser.parse_args(argv)
    if args.replicas is None:
        args.replicas = 50 if args.quick else 1000
    if args.replicas < 2 or not 0 <= args.p_jit_fail <= 1:
        parser.error("--replicas must be >= 2 and --p-jit-fail in [0, 1]")
    results = Results("goodput_sim", args.json, args)
    results.notes.append("assumed costs are orders of magnitude, not measurements")
    kill = KindCost(args.restart)
    assumed = Costs(args.step, args.save, args.jit_save, args.restart,
                    {"kill": kill, "save": kill, "hang": KindCost(args.restart + args.hang_extra)})  # fmt: skip
    # (label, the periodic policies' costs, jit's where they differ, the mix of kinds)
    runs: list[tuple[str, Costs, Costs | None, Mapping[str, float]]]
    runs = [("assumed", assumed, None, args.mix or {"kill": 1.0})]
    if args.measured is not None:
        periodic, jit, measured_mix = measured_model(args.measured)
        runs.append(("measured", periodic, jit, args.mix or measured_mix))
    for label, costs, jit_costs, mix in runs:
        rows = scenario_rows(args, costs, label, mix, jit_costs)
        results.data.setdefault("scenario", []).extend(rows)
        results.data.setdefault("costs", {})[label] = {
            "periodic": costs_json(costs), "jit": costs_json(jit_costs or costs), "mix": mix,
        }  # fmt: skip
        title = (f"{args.work_days:g} days of work at Llama 3's failure rate, {label} costs: step "
                 f"{costs.step:.4g} s, save {costs.save:.4g} s, JIT save {costs.jit_save:.4g} s, "
                 f"restart {costs.restart:.4g} s; {describe_kinds(costs, jit_costs, mix)}; "
                 f"{args.replicas} jobs per row")  # fmt: skip
        print(f"\n{title}\n\n" + results.table(title, scenario_table(rows)), flush=True)
    if args.check is not None:
        rows, markdown, costs = check(args.check)
        results.data["check"] = {"costs": costs_json(costs), "runs": rows}
        title = f"Replayed real runs ({args.check}): goodput measured vs predicted"
        print(f"\n{title}\n\n" + results.table(title, markdown), flush=True)
        errors = [
            "{} {}: {:+.3f} with one restart for every failure, {:+.3f} with each kind's".format(
                r["run"], r["policy"], r["predicted_one_restart"] - r["measured"],
                r["predicted"] - r["measured"],
            )
            for r in rows
        ]  # fmt: skip
        line = "predicted - measured, run by run: " + "; ".join(errors)
        results.notes.append(line)
        print(f"\n{line}", flush=True)
    results.write()


def parse_mix(text: str) -> dict[str, float]:
    """``kill=0.8,save=0.1,hang=0.1`` as weights (normalised by ``Poisson``)."""
    mix = {}
    for part in text.split(","):
        kind, _, weight = part.partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if kind.strip() not in KINDS or value < 0:
            raise argparse.ArgumentTypeError(
                f"{part!r}: expected KIND=WEIGHT, KIND one of {', '.join(KINDS)}, WEIGHT >= 0"
            )
        mix[kind.strip()] = value
    if sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the weights add up to 0")
    return mix


def costs_json(costs: Costs) -> dict[str, Any]:
    return {
        "step": costs.step, "save": costs.save, "jit_save": costs.jit_save,
        "restart": costs.restart,
        "kinds": {k: {"restart": c.restart, "jit_save": c.jit_save} for k, c in costs.kinds.items()},
    }  # fmt: skip


def describe_kinds(costs: Costs, jit_costs: Costs | None, mix: Mapping[str, float]) -> str:
    """The mix, and each kind's restart (periodic policies / jit where they differ)."""
    total = sum(mix.values())
    parts = []
    for kind in KINDS:
        if mix.get(kind, 0) <= 0:
            continue
        restart = f"{costs.restart_of(kind):.3g} s"
        if jit_costs is not None and jit_costs.restart_of(kind) != costs.restart_of(kind):
            restart += f" / {jit_costs.restart_of(kind):.3g} s with JIT"
        parts.append(f"{mix[kind] / total:.0%} {kind} (restart {restart})")
    return "failures: " + ", ".join(parts)


if __name__ == "__main__":
    main()
