"""Plots and the generated section of RESULTS.md from the benchmarks' JSON results.

Each side-by-side benchmark writes ``bench_output/NAME.json`` (``--json``; see
``harness.results.Results`` for the layout). This script reads them, draws
``benchmarks/plots/*.png`` and rewrites the part of ``benchmarks/RESULTS.md`` between the markers
``<!-- make bench: begin -->`` and ``<!-- make bench: end -->``; the hand-written analysis around
them is left alone. Every figure is ``harness.plot.draw`` of a small spec in ``figures.py``
(which metric, grouped by what, under which title). A benchmark whose JSON is missing (it failed, or was not
run) is reported as such, and its old plot is neither redrawn nor linked. ``make bench`` and
``make bench-quick`` run it last.

    .venv/bin/python benchmarks/report.py                      # after make bench / bench-quick
    .venv/bin/python benchmarks/report.py --failed "ddp_loader" # what make passes on a failure
    .venv/bin/python benchmarks/report.py --no-results-md      # plots only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from figures import plot  # noqa: E402
from harness.env import REPO, git  # noqa: E402
from harness.plot import run_kind  # noqa: E402

BEGIN, END = "<!-- make bench: begin -->", "<!-- make bench: end -->"

# (script name, section title), in the order make bench runs them and RESULTS.md numbers them.
BENCHMARKS: list[tuple[str, str]] = [
    ("overhead", "Training-loop overhead of the DataLoader"),
    ("resume_latency", "Resume latency: load_state_dict to the first batch"),
    ("trainer_overhead", "Trainer overhead vs a plain PyTorch loop"),
    ("trainer_ddp", "The Trainer against a hand-written DDP loop at 2, 3 and 4 ranks"),
    ("loader_tiny", "unbroken.DataLoader against torch's on the tiny loop"),
    (
        "lightning_resume",
        "Lightning 2.6 resumed mid-epoch and at epoch boundaries: plain (torch's DataLoader) vs "
        "unbroken",
    ),
    ("hf_resume", "transformers and Accelerate resumed after a SIGKILL: stock vs unbroken.hf"),
    ("checkpoint_blocking", "Checkpoint blocking time, sync vs async"),
    ("stream_overhead", "Iterable dataset: state shipping overhead"),
    ("ddp_loader", "Data-parallel training: loaders, preemption agreement, resume"),
    ("ddp_checkpoint", "Checkpoints of a 2-rank job: DDP vs FSDP2 through DCP"),
    ("ddp_reduction", "What exact_reduce costs a DDP step on 3 to 5 ranks"),
    ("stream_peers", "Streaming from object storage: unbroken vs MosaicML Streaming and LitData"),
    (
        "remote_checkpoint",
        "Checkpoints in object storage vs torch.save+fsspec and DCP FsspecWriter",
    ),
    (
        "goodput",
        "Goodput under random kills and preemptions: plain PyTorch, Lightning, Lightning + "
        "unbroken, unbroken's Trainer",
    ),
]

# --------------------------------------------------------------------------- markdown


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def load(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the results, None) or (None, why there are none)."""
    if not path.exists():
        return None, "is missing: the benchmark was not run, or failed before writing it"
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"is unreadable ({e})"
    if not isinstance(payload, dict) or payload.get("schema") != 1:
        return None, "has another layout (written before --json existed?): re-run the benchmark"
    return payload, None


def shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (as the Makefile names it)."""
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def section(
    number: int,
    name: str,
    title: str,
    payload: dict[str, Any] | None,
    why: str | None,
    failed: bool,
    plots: list[tuple[str, str]],
    plot_error: str | None,
    plots_rel: str,
    header_env: dict[str, Any],
    source: str,
) -> list[str]:
    lines = [f"### {number}. {title} (`benchmarks/{name}.py`)", ""]
    if payload is None:
        if failed:
            lines.append(
                "**Failed**: the command exited with an error (see `make bench`'s output), "
                "no results."
            )
        else:
            lines.append(f"**No results**: `{source}` {why}.")
        return lines + [""]
    env = payload.get("environment", {})
    facts = [
        f"**{run_kind(payload)}**",
        f"wall time {duration(payload.get('wall_s'))}",
        f"started {str(env.get('date', '?')).replace('T', ' ')}",
        f"load average at start {env.get('load_start', '?')}, at end {env.get('load_end', '?')}",
    ]
    for key in ("machine", "software", "git"):  # only where it differs from the header's
        if env.get(key) and env.get(key) != header_env.get(key):
            facts.append(f"{key}: {env[key]}")
    if failed:
        facts.append("**the command exited with an error after writing these results**")
    lines += ["; ".join(facts) + ".", "", "    " + str(payload.get("command", "?")), ""]
    for file, alt in plots:
        lines += [f"![{alt}]({plots_rel}/{file})", ""]
    if plot_error:
        lines += [f"Plot failed: `{plot_error}`", ""]
    for t in payload.get("tables", []):
        lines += [f"**{t['title']}**", "", t["markdown"], ""]
    notes = payload.get("notes", [])
    if notes:
        lines += [f"- {n}" for n in notes] + [""]
    return lines


def render(sections: list[list[str]], payloads: dict[str, dict[str, Any]], flags: str) -> str:
    first = next(iter(payloads.values()), {})
    env = first.get("environment", {})
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "src")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    quick = [n for n, p in payloads.items() if p.get("quick")]
    head = [
        "<!-- Generated by benchmarks/report.py from bench_output/*.json (make bench): edits "
        "between these markers are overwritten. -->",
        "",
        f"Generated {now}{flags} at git {commit}"
        + (" (src/ has uncommitted changes)" if dirty else " (src/ clean)")
        + ".",
        "",
    ]
    if env:
        head += [f"- machine: {env.get('machine')}", f"- {env.get('software')}", ""]
    if quick:
        head += [
            f"**Quick runs** ({', '.join(f'`{n}`' for n in quick)}): `--quick`, small data and "
            "few rounds, to check the pipeline; their numbers are noise. `make bench` replaces "
            "them with full runs.",
            "",
        ]
    summary = [["benchmark", "run", "wall time", "started"]]
    for name, _ in BENCHMARKS:
        p = payloads.get(name)
        summary.append(
            [f"`{name}.py`", "-", "-", "no results"]
            if p is None
            else [
                f"`{name}.py`",
                "quick" if p.get("quick") else "full",
                duration(p.get("wall_s")),
                str(p.get("environment", {}).get("date", "?")).replace("T", " "),
            ]
        )
    head += ["| " + " | ".join(r) + " |" for r in summary[:1]]
    head += ["|" + "---|" * len(summary[0])]
    head += ["| " + " | ".join(r) + " |" for r in summary[1:]]
    total = sum(p.get("wall_s") or 0 for p in payloads.values())
    head += ["", f"Total wall time of the runs above: {duration(total)}.", ""]
    body = [line for s in sections for line in s]
    return "\n".join([*head, *body]).rstrip() + "\n"


def replace_generated(text: str, generated: str) -> str:
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise SystemExit(
            f"RESULTS.md lacks the markers {BEGIN} ... {END}: add them where the generated "
            "section belongs"
        )
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    return f"{before}{BEGIN}\n{generated}{END}{after}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, default=REPO / "bench_output", help="JSON results")
    parser.add_argument("--plots", type=Path, default=HERE / "plots", help="where PNGs go")
    parser.add_argument("--results-md", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument(
        "--no-results-md", action="store_true", help="draw the plots, leave RESULTS.md alone"
    )
    parser.add_argument(
        "--failed", default="", help="space-separated benchmarks whose command failed (from make)"
    )
    parser.add_argument(
        "--flags", default="", help="the flags make passed to every benchmark, e.g. --quick"
    )
    args = parser.parse_args()
    failed = set(args.failed.split())

    payloads: dict[str, dict[str, Any]] = {}
    sections, problems = [], []
    # Image links are relative to RESULTS.md, so they work on GitHub and in a checkout.
    plots_rel = Path(os.path.relpath(args.plots.resolve(), args.results_md.resolve().parent))
    plots_rel_text = plots_rel.as_posix()
    loaded = {name: load(args.input / f"{name}.json") for name, _ in BENCHMARKS}
    header_env: dict[str, Any] = next((p["environment"] for p, _ in loaded.values() if p), {})
    for number, (name, title) in enumerate(BENCHMARKS, start=1):
        payload, why = loaded[name]
        plots: list[tuple[str, str]] = []
        plot_error = None
        if payload is not None:
            payloads[name] = payload
            try:
                plots = plot(name, payload, args.plots)
            except Exception as e:  # one benchmark's bad data must not cost the others' plots
                traceback.print_exc()
                plot_error = f"{type(e).__name__}: {e}"
                problems.append(f"{name}: plot failed ({plot_error})")
            for file, _ in plots:
                size = (args.plots / file).stat().st_size
                print(f"[plot {args.plots / file}: {size / 1024:.0f} KiB]", file=sys.stderr)
        elif name not in failed:
            print(
                f"[{name}: no results: {shown(args.input / f'{name}.json')} {why}]", file=sys.stderr
            )
        sections.append(
            section(
                number,
                name,
                title,
                payload,
                why,
                name in failed,
                plots,
                plot_error,
                plots_rel_text,
                header_env,
                shown(args.input / f"{name}.json"),
            )
        )
    flags = f" (flags make passed to every benchmark: `{args.flags}`)" if args.flags else ""
    if not args.no_results_md:
        generated = render(sections, payloads, flags)
        text = args.results_md.read_text()
        args.results_md.write_text(replace_generated(text, generated))
        print(f"[rewrote the generated section of {args.results_md}]", file=sys.stderr)
    for problem in problems:
        print(f"report: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
