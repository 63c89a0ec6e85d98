"""Plots and the generated section of RESULTS.md from the benchmarks' JSON results.

Each side-by-side benchmark writes ``bench_output/NAME.json`` (``--json``; see ``_common.Results``
for the layout). This script reads them, draws ``benchmarks/plots/*.png`` and rewrites the part
of ``benchmarks/RESULTS.md`` between the markers ``<!-- make bench: begin -->`` and
``<!-- make bench: end -->``; the hand-written analysis around them is left alone. A benchmark
whose JSON is missing (it failed, or was not run) is reported as such, and its old plot is
neither redrawn nor linked. ``make bench`` and ``make bench-quick`` run it last.

    .venv/bin/python benchmarks/report.py                      # after make bench / bench-quick
    .venv/bin/python benchmarks/report.py --failed "ddp_loader" # what make passes on a failure
    .venv/bin/python benchmarks/report.py --no-results-md      # plots only
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on the benchmark machines
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter
from PIL import Image  # a dependency of matplotlib

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BEGIN, END = "<!-- make bench: begin -->", "<!-- make bench: end -->"
DPI = 100  # ~800x450 px figures: legible on GitHub, a few tens of KB each

# (script name, section title), in the order make bench runs them and RESULTS.md numbers them.
BENCHMARKS: list[tuple[str, str]] = [
    ("overhead", "Training-loop overhead of the DataLoader"),
    ("resume_latency", "Resume latency: load_state_dict to the first batch"),
    ("trainer_overhead", "Trainer overhead vs a plain PyTorch loop"),
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
    ("ddp_reduction", "What exact_reduce costs a DDP step on 3 ranks"),
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

# One colour per library everywhere, so a reader learns it once: unbroken in blues (its
# variants lighter), torch grey, torchdata orange, the streaming peers green and purple.
COLORS = {
    "torch": "#8c8c8c",
    "unbroken": "#1f77b4",
    "unbroken torch-only": "#5fa2d6",
    "unbroken none": "#a6cbe8",
    "unbroken rngs=()": "#a6cbe8",
    "torchdata": "#ff7f0e",
    "control": "#d9d9d9",
    "streaming": "#2ca02c",
    "litdata": "#9467bd",
    "torch skip batches": "#8c8c8c",
    "torch skip indices": "#c7c7c7",
}


# --------------------------------------------------------------------------- figure helpers


def run_kind(payload: dict[str, Any]) -> str:
    return "quick run (--quick: numbers are noise)" if payload.get("quick") else "full run"


def new_figure(
    payload: dict[str, Any], title: str, ncols: int = 1, width: float = 8.0
) -> tuple[Figure, list[Axes]]:
    """A figure whose title says what it shows and whether it is a quick or a full run."""
    fig, axes = plt.subplots(1, ncols, figsize=(width, 5.0), squeeze=False)
    fig.suptitle(f"{title}\n{run_kind(payload)}", fontsize=11)
    return fig, list(axes[0])


def save(
    fig: Figure, payload: dict[str, Any], path: Path, legend: Axes | None = None, ncol: int = 3
) -> None:
    """Save with a footer naming the run (date, commit, machine, command), so a plot seen on
    its own, e.g. linked from the README, still says where its numbers come from; ``legend``:
    the axes whose legend goes below the plots (where it hides no bar or label)."""
    env = payload.get("environment", {})
    machine = str(env.get("machine", "")).split(",")[0]
    footer = (
        f"{run_kind(payload)} | {str(env.get('date', '?'))[:16].replace('T', ' ')} | git "
        f"{env.get('git', '?')} | {machine}\n{payload.get('command', '?')}"
    )
    height = fig.get_figheight()
    bottom = 0.36 / height  # the footer's two lines, in figure coordinates
    fig.text(0.01, 0.01, footer, fontsize=6.5, color="#555555", ha="left", va="bottom")
    if legend is not None:
        handles, labels = legend.get_legend_handles_labels()
        fig.legend(
            handles,
            labels,
            loc="lower center",
            bbox_to_anchor=(0.5, bottom),
            ncol=ncol,
            fontsize=7.5,
            frameon=False,
        )
        bottom += (0.1 + 0.2 * -(-len(labels) // ncol)) / height
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    plt.close(fig)
    # An adaptive palette: a plot has a few flat colours and their anti-aliasing, so 128 colours
    # look the same and the file is ~3x smaller (the plots are committed). PIL also drops
    # matplotlib's version stamp, so an unchanged plot is an unchanged file.
    image = Image.open(buffer).convert("RGB")
    image = image.quantize(colors=128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    image.save(path, optimize=True)


# One bar series: label, colour key, a value per group (None: no bar), a (low, high) interval
# per group (None or a shorter list: no error bar).
Series = tuple[str, str, list[float | None], list[tuple[float, float] | None]]


def bars(
    ax: Axes,
    groups: Sequence[str],
    series: Sequence[Series],
    fmt: Callable[[float], str],
    log: bool = False,
) -> None:
    """Grouped vertical bars: ``series`` is (label, colour key, one value per group, one
    (low, high) error interval or None per group); each bar is annotated with ``fmt(value)``."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, color, values, errors) in enumerate(series):
        labelled = False  # one legend entry per series, on its first bar
        for g, value in enumerate(values):
            if value is None:
                continue
            x = g - 0.4 + width * (i + 0.5)
            ax.bar(
                x,
                value,
                width,
                color=COLORS.get(color, color),
                edgecolor="#333333",
                linewidth=0.5,
                label=None if labelled else label,
            )
            labelled = True
            err = errors[g] if g < len(errors) else None
            top = value
            if err is not None:
                low, high = err
                yerr = [[max(0.0, value - low)], [max(0.0, high - value)]]
                ax.errorbar(x, value, yerr=yerr, fmt="none", ecolor="#222222", elinewidth=0.8)
                top = max(value, high) if value >= 0 else min(value, low)
            ax.annotate(
                fmt(value),
                (x, top),
                xytext=(0, 2 if value >= 0 else -2),
                textcoords="offset points",
                ha="center",
                va="bottom" if value >= 0 else "top",
                fontsize=6.5,
                rotation=90 if n > 3 else 0,  # narrow bars: upright labels would overlap
                bbox=LABEL_BOX,
            )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


# Value labels on a white ground: an error bar crossing one must not make it unreadable.
LABEL_BOX = {"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8}


def pct(ratio: float) -> float:
    """A time ratio against a baseline as percent slower (+) or faster (-)."""
    return (ratio - 1.0) * 100.0


def pct_interval(interval: Sequence[float] | None) -> tuple[float, float] | None:
    return None if interval is None else (pct(interval[0]), pct(interval[1]))


def headroom(ax: Axes, factor: float = 1.25) -> None:
    """Room above the bars for their labels, and below negative ones for theirs."""
    low, high = ax.get_ylim()
    span = high - low
    ax.set_ylim(low - (span * (factor - 1) if low < 0 else 0), high + span * (factor - 1))


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


# --------------------------------------------------------------------------- one plot each


def ratio_series(rows: list[dict], workers: list, interval: str) -> tuple[list[str], list]:
    """Bar groups (one per num_workers) and series (one per loader other than torch's) of the
    time per step over torch's DataLoader, in %, with the rows' ``interval`` as error bars."""
    torch_us = {r["workers"]: r["us_per_step"] for r in rows if r["loader"] == "torch"}
    groups = [f"num_workers={w}\n(torch: {torch_us.get(w, 0):,.0f} us/step)" for w in workers]
    series = []
    for name in [n for n in dict.fromkeys(r["loader"] for r in rows) if n != "torch"]:
        by_w = {r["workers"]: r for r in rows if r["loader"] == name}
        label = next(r["label"] for r in rows if r["loader"] == name)
        ratios = [pct(by_w[w]["ratio"]) if w in by_w else None for w in workers]
        spread = [pct_interval(by_w[w][interval]) if w in by_w else None for w in workers]
        series.append((label, name, ratios, spread))
    return groups, series


def plot_overhead(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    rows = payload["data"]["rows"]
    loops = [loop for loop in ("tiny", "realistic") if any(r["loop"] == loop for r in rows)]
    fig, axes = new_figure(
        payload,
        "Training-loop overhead per loader: time per step vs torch's DataLoader",
        ncols=len(loops),
        width=11,
    )
    setup = payload["data"].get("setup", {})
    titles = {
        "tiny": f"tiny loop: Linear(32, 2), batch {setup.get('tiny_batch', 2)}",
        "realistic": f"realistic loop: 2-conv CNN, batch {setup.get('image_batch', 32)}, crop+flip",
    }
    for ax, loop in zip(axes, loops):
        mine = [r for r in rows if r["loop"] == loop]
        workers = sorted({r["workers"] for r in mine})
        groups, series = ratio_series(mine, workers, "ratio_ci95")
        bars(ax, groups, series, lambda v: f"{v:+.1f}%")
        ax.axhline(0, color="#333333", linewidth=0.8)
        ax.set_title(titles.get(loop, loop), fontsize=9)
        ax.set_ylabel("time per step vs torch DataLoader (%)\n+ = slower; bars: 95% CI")
        headroom(ax, 1.2)
    save(fig, payload, out / "overhead.png", legend=axes[0])
    return [("overhead.png", "Training-loop overhead per loader, % vs torch's DataLoader")]


def plot_resume_latency(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    data = payload["data"]
    labels = ["fresh start\n(no state)"] + [f"{p:.0%}" for p in data["positions"][1:]]
    fig, (ax,) = new_figure(
        payload,
        f"Resume latency vs position in the epoch ({data['samples']:,}-sample epoch, "
        f"batch {data['batch_size']}, num_workers 0)",
    )
    x = list(range(len(labels)))
    for name, lib in data["libraries"].items():
        med = lib["median_s"]
        below = [(m - lo) * 1e3 for m, lo in zip(med, lib["min_s"])]
        above = [(hi - m) * 1e3 for m, hi in zip(med, lib["max_s"])]
        label = {"unbroken": "unbroken.DataLoader", "torchdata": "torchdata StatefulDataLoader"}
        ax.errorbar(
            x,
            [m * 1e3 for m in med],
            yerr=[below, above],
            marker="o",
            capsize=3,
            color=COLORS.get(name),
            label=label.get(name, name),
        )
        for xi, m in zip(x, med):
            slowest = m >= max(lib_["median_s"][xi] for lib_ in data["libraries"].values())
            ax.annotate(
                ms(m),
                (xi, m * 1e3),
                xytext=(0, 9 if slowest else -10),  # off the line: above the top one, else below
                textcoords="offset points",
                ha="center",
                va="bottom" if slowest else "top",
                fontsize=7.5,
                color=COLORS.get(name, "#333333"),
                bbox=LABEL_BOX,
            )
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlabel("position in the epoch where the state was saved")
    ax.set_ylabel("load_state_dict + iter + next (ms, log scale)\nmedian, bars: min-max")
    ax.grid(alpha=0.3, which="both")
    ax.set_xlim(-0.3, len(labels) - 0.5)
    low, high = ax.get_ylim()
    ax.set_ylim(low / 2, high * 3)  # log scale: room for the labels above and below the lines
    ax.legend(fontsize=8, loc="upper left")
    save(fig, payload, out / "resume_latency.png")
    return [("resume_latency.png", "Resume latency vs position in the epoch, per library")]


def plot_trainer_overhead(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    rows = payload["data"]["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = new_figure(
        payload,
        "unbroken.Trainer vs a plain PyTorch loop over the same loader: time per step",
        ncols=len(workloads),
        width=11,
    )
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != "plain loop"]
    short = [
        v.removeprefix("Trainer, ")
        .replace("checkpoint_every_steps=None", "no periodic checkpoint")
        .replace("checkpoint_every_steps=", "checkpoint every ")
        .replace(", async_save", " steps, async_save")
        for v in variants
    ]
    short = [v + " steps" if v[-1].isdigit() else v for v in short]
    describe = {"boring": "boring: Linear(32, 2), batch 2", "cnn": "cnn: 2-conv CNN, batch 32"}
    for i, (ax, work) in enumerate(zip(axes, workloads)):
        by_v = {r["variant"]: r for r in rows if r["workload"] == work}
        plain_us = by_v["plain loop"]["us_per_step"] if "plain loop" in by_v else 0.0
        y = list(range(len(variants)))
        values = [pct(by_v[v]["ratio"]) if v in by_v else 0.0 for v in variants]
        errors = [by_v[v].get("ratio_min_max") if v in by_v else None for v in variants]
        xerr = [
            [max(0.0, val - pct(e[0])) if e else 0.0 for val, e in zip(values, errors)],
            [max(0.0, pct(e[1]) - val) if e else 0.0 for val, e in zip(values, errors)],
        ]
        ax.barh(
            y,
            values,
            xerr=xerr,
            color=COLORS["unbroken"],
            edgecolor="#333333",
            linewidth=0.5,
            error_kw={"elinewidth": 0.8, "capsize": 2},
        )
        for yi, v in zip(y, variants):
            if v in by_v:
                extra = by_v[v].get("extra_us_per_step")
                text = f"{pct(by_v[v]['ratio']):+.1f}%" + (
                    f" ({extra:+.0f} us)" if extra is not None else ""
                )
                error = errors[yi]
                right = max(values[yi], 0, pct(error[1]) if error else 0)
                ax.annotate(
                    text,
                    (right, yi),
                    xytext=(4, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=7,
                )
        ax.axvline(0, color="#333333", linewidth=0.8)
        ax.set_yticks(y)
        ax.set_yticklabels(short if i == 0 else [""] * len(y), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(
            f"{describe.get(work, work)} (plain loop: {plain_us:,.0f} us/step)", fontsize=9
        )
        ax.set_xlabel("time per step vs the plain loop (%)\nbars: min-max over rounds")
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        low, high = ax.get_xlim()
        ax.set_xlim(min(low, 0), high + (high - min(low, 0)) * 0.35)
    save(fig, payload, out / "trainer_overhead.png")
    return [("trainer_overhead.png", "Trainer overhead per step vs a plain loop")]


def plot_lightning_resume(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    data = payload["data"]
    rows = data["rows"]
    workers = list(dict.fromkeys(r["workers"] for r in rows))
    default_every = data.get("checkpoint_every_steps", 5)

    def cut_of(r: dict) -> tuple[int, int]:  # a cut: the kill's step and the checkpoint interval
        return r["cut"], r.get("every", default_every)

    most = max(len({cut_of(r) for r in rows if r["workers"] == w}) for w in workers)
    fig, axes = new_figure(
        payload,
        f"Lightning {data.get('lightning', '2.x')}: SIGKILLed and resumed from last.ckpt, "
        "per loader",
        ncols=len(workers),
        width=max(8.0, 2.4 * most) * (1.5 if len(workers) > 1 else 1.0),
    )
    labels = {
        "torch": "torch DataLoader (plain Lightning)",
        "unbroken": "unbroken.DataLoader + ExactResume",
    }
    for ax, w in zip(axes, workers):
        mine = [r for r in rows if r["workers"] == w]
        cuts = list(dict.fromkeys(cut_of(r) for r in mine))
        loaders = list(dict.fromkeys(r["loader"] for r in mine))
        by = {(r["loader"], cut_of(r)): r for r in mine}
        groups = []
        for c in cuts:
            r = next(r for r in mine if cut_of(r) == c)
            start = "scratch" if r["resumed_from"] is None else r["resumed_from"]
            kind = r.get("kind", "mid-epoch")
            groups.append(
                f"step {c[0]} ({kind})\nresumed from {start}\n(epoch {r['epoch']}, "
                f"ckpt every {c[1]})"
            )
        series: list[Series] = [
            (
                labels.get(name, name),
                name,
                [
                    by[name, c]["repeated"] + by[name, c]["skipped"] if (name, c) in by else None
                    for c in cuts
                ],
                [],
            )
            for name in loaders
        ]
        bars(ax, groups, series, lambda v: f"{v:.0f}")
        ax.tick_params(axis="x", labelsize=7)
        width = 0.8 / max(1, len(loaders))
        for i, name in enumerate(loaders):
            for g, c in enumerate(cuts):
                r = by.get((name, c))
                if r is None:
                    continue
                total = r["repeated"] + r["skipped"]
                split = f"{r['repeated']} rep.\n+ {r['skipped']} skip.\n" if total else ""
                others = sum(
                    sum(d) for e, d in enumerate(r.get("per_epoch", [])) if e != r["epoch"]
                )
                if others:  # killed at an epoch's start, resumed from a checkpoint in another
                    split += f"(+ {others} in\nother epochs)\n"
                once = r.get("batches_once", True)
                equal = r["weights_equal"] and once
                ax.annotate(
                    f"{split}weights\nequal: {'yes' if r['weights_equal'] else 'no'}"
                    + ("" if once else "\nbatches\nnot once"),
                    (g - 0.4 + width * (i + 0.5), total),
                    xytext=(0, 12),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="#2ca02c" if equal else "#d62728",
                    fontweight="bold",
                    bbox=LABEL_BOX,
                )
        whole = {r["loader"]: r["whole_s"] for r in mine}
        ax.set_title(
            f"num_workers={w} (uninterrupted run: "
            + ", ".join(f"{name} {whole[name]:.1f} s" for name in loaders if name in whole)
            + ")",
            fontsize=9,
        )
        ax.set_xlabel(
            f"{data['epochs']} epochs of {data['steps_per_epoch']} steps; SIGKILL at the end of "
            "the step, resumed from the last checkpoint before it",
            fontsize=8,
        )
        ax.set_ylabel(
            f"samples repeated + skipped in the epoch\nof the kill (of {data['samples']})"
        )
        low, high = ax.get_ylim()
        ax.set_ylim(low, max(high, 1.0) * 1.6)  # room for the labels above the bars
    save(fig, payload, out / "lightning_resume.png", legend=axes[0], ncol=2)
    return [
        (
            "lightning_resume.png",
            "Lightning resumed mid-epoch and at epoch boundaries: samples repeated and skipped, "
            "torch vs unbroken",
        )
    ]


def plot_hf_resume(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    data = payload["data"]
    fig, (left, right) = new_figure(
        payload,
        "transformers and Accelerate SIGKILLed mid-epoch and resumed: stock vs unbroken.hf",
        ncols=2,
        width=12.0,
    )
    found = data["exactness"]
    systems = list(dict.fromkeys(key.split("|")[0] for key in found))
    workers = list(dict.fromkeys(key.split("|")[1] for key in found))
    colors = ["torch", "torch skip indices", "torchdata", "unbroken"]
    series: list[Series] = [
        (
            name,
            colors[i % len(colors)],
            [found[f"{name}|{w}"]["same_augmentations"] for w in workers],
            [],
        )
        for i, name in enumerate(systems)
    ]
    bars(left, [f"num_workers={w}" for w in workers], series, lambda v: f"{v:.0f}")
    places = next(iter(found.values()))["places"]
    left.axhline(places, color="#333333", linewidth=0.8, linestyle="--")
    left.set_ylabel(
        f"resumed samples whose augmentation equals\nthe uninterrupted run's (of {places})"
    )
    equal = [n for n in systems if all(found[f"{n}|{w}"]["weights_equal"] for w in workers)]
    left.set_title(
        f"final weights bit-equal after the resume: {', '.join(equal) or 'none'}", fontsize=9
    )
    headroom(left)
    timed = data["first_step_s"]
    groups = [f"{key.split('|')[0]}\n{float(key.split('|')[1]):.0%}" for key in timed]
    series = [
        (label, color, [timed[key][name] for key in timed], [])
        for name, label, color in (
            ("stock", "transformers.Trainer", "torch"),
            ("unbroken", "unbroken.hf.Trainer", "unbroken"),
        )
    ]
    bars(right, groups, series, lambda v: f"{v:.2f}")
    right.set_ylabel("seconds from train() to the first step")
    right.set_xlabel("dataset, and where in the epoch its checkpoint was saved", fontsize=8)
    right.set_title(
        f"{payload['args']['n']:,} samples an epoch, {payload['args']['cost_us']:g} us a sample",
        fontsize=9,
    )
    headroom(right)
    save(fig, payload, out / "hf_resume.png", legend=left, ncol=4)
    return [
        (
            "hf_resume.png",
            "transformers and Accelerate resumed: augmentations equal, and the time to the first step",
        )
    ]


def plot_checkpoint_blocking(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    data = payload["data"]
    med = data["median_s"]
    fig, (ax,) = new_figure(
        payload,
        f"Checkpointer.save of {data['megabytes']:.0f} MB (model + Adam), every file fsynced: "
        "how long the loop waits",
    )
    groups = [
        "save returns\n(the loop is blocked)",
        "checkpoint committed\n(on disk, fsynced)",
        f"save + {data['steps']} training steps,\ncommitted",
    ]
    bars(
        ax,
        groups,
        [
            ("blocking=True", "torch", [med["sync"], med["sync"], med["sync_steps"]], []),
            (
                "blocking=False (background write)",
                "unbroken",
                [med["async"], med["async_done"], med["async_steps"]],
                [],
            ),
        ],
        lambda v: f"{v:.3f} s",
    )
    ax.set_ylabel(f"seconds (median of {data['reps']} rounds)")
    headroom(ax, 1.15)
    save(fig, payload, out / "checkpoint_blocking.png", legend=ax, ncol=2)
    return [("checkpoint_blocking.png", "Checkpoint blocking time, sync vs async")]


def plot_stream_overhead(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    data = payload["data"]
    rows = data["rows"]
    workers = list(dict.fromkeys(r["workers"] for r in rows))
    fig, (ax,) = new_figure(
        payload,
        "Iterable dataset, batch 2: time per step vs torch's DataLoader (worker start-up included)",
    )
    groups, series = ratio_series(rows, workers, "ratio_min_max")
    bars(ax, groups, series, lambda v: f"{v:+.1f}%")
    ax.axhline(0, color="#333333", linewidth=0.8)
    target = pct(data.get("target_ratio", 1.03))
    ax.axhline(
        target,
        color="#d62728",
        linestyle="--",
        linewidth=0.8,
        label=f"target: unbroken within {target:.0f}%",
    )
    ax.set_ylabel("time per step vs torch DataLoader (%)\n(+ = slower; bars: min-max)")
    headroom(ax, 1.2)
    save(fig, payload, out / "stream_overhead.png", legend=ax, ncol=2)
    return [("stream_overhead.png", "Iterable dataset state shipping overhead vs torch")]


def plot_ddp_loader(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    data = payload["data"]
    panels = [p for p in ("epochs", "resume") if p in data]
    if not panels:
        return []
    fig, axes = new_figure(
        payload,
        "Data-parallel training, 2 ranks (torchrun, gloo, CPU)",
        ncols=len(panels),
        width=11,
    )
    for ax, part in zip(axes, panels):
        if part == "epochs":
            rows = data["epochs"]["rows"]
            keys = list(dict.fromkeys((r["dataset"], r["workers"]) for r in rows))
            groups = [f"{d} dataset\nnum_workers={w}" for d, w in keys]
            series = []
            for name in [n for n in dict.fromkeys(r["loader"] for r in rows) if n != "torch"]:
                by_k = {(r["dataset"], r["workers"]): r for r in rows if r["loader"] == name}
                label = next(r["label"] for r in rows if r["loader"] == name)
                series.append(
                    (
                        label,
                        name,
                        [pct(by_k[k]["ratio"]) if k in by_k else None for k in keys],
                        [pct_interval(by_k[k]["ratio_ci95"]) if k in by_k else None for k in keys],
                    )
                )
            bars(ax, groups, series, lambda v: f"{v:+.1f}%")
            ax.axhline(0, color="#333333", linewidth=0.8)
            ax.set_title("DDP training epoch vs torch DataLoader + DistributedSampler", fontsize=9)
            ax.set_ylabel("epoch time vs torch (%)\n(+ = slower; 95% CI)")
            headroom(ax)
            ax.legend(fontsize=7, loc="upper left")
        else:
            rows = data["resume"]["rows"]
            positions = list(dict.fromkeys(r["position"] for r in rows))
            methods = list(dict.fromkeys(r["method"] for r in rows))
            series = []
            for method in methods:
                by_p = {r["position"]: r for r in rows if r["method"] == method}
                series.append(
                    (
                        method,
                        method,
                        [by_p[p]["median_ms"] if p in by_p else None for p in positions],
                        [
                            (by_p[p]["min_ms"], by_p[p]["max_ms"]) if p in by_p else None
                            for p in positions
                        ],
                    )
                )
            bars(
                ax,
                [f"resume at {p:.0%}" for p in positions],
                series,
                lambda v: f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms",
                log=True,
            )
            ax.set_title(
                f"resume to the first batch ({data['resume']['samples']:,} rows, num_workers 0)",
                fontsize=9,
            )
            ax.set_ylabel("construct + resume + first batch\n(ms, log scale; bars: min-max)")
            low, high = ax.get_ylim()
            ax.set_ylim(low, high * 4)
            ax.legend(fontsize=7, loc="upper left")
    save(fig, payload, out / "ddp_loader.png")
    return [("ddp_loader.png", "DDP: epoch time vs torch, and resume latency")]


def plot_ddp_checkpoint(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    data = payload["data"]
    med = data["median_ms"]
    keys = ["sync", "async returns", "async committed", "load"]
    groups = [
        "save(blocking=True)",
        "save(blocking=False):\nloop blocked",
        "save(blocking=False):\ncommitted",
        "load_latest",
    ]
    fig, (ax,) = new_figure(
        payload,
        f"Checkpoints of a 2-rank job ({data['megabytes']:.0f} MB: model + AdamW), "
        "torchrun + gloo on CPU",
    )
    colors = {"DDP (rank 0 writes)": "torch", "FSDP2 through DCP (Sharded)": "unbroken"}
    bars(
        ax,
        groups,
        [(name, colors.get(name, "unbroken"), [m[k] for k in keys], []) for name, m in med.items()],
        lambda v: f"{v:.0f} ms",
    )
    ax.set_ylabel(f"ms (median of {data['reps']} rounds)")
    headroom(ax, 1.15)
    save(fig, payload, out / "ddp_checkpoint.png", legend=ax, ncol=2)
    return [("ddp_checkpoint.png", "DDP vs FSDP2 checkpoint save and load times")]


def plot_stream_peers(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    data = payload["data"]
    results = {k: v for k, v in data["results"].items() if "error" not in v}
    if not results:
        return []
    libs = [lib for lib in ("streaming", "litdata", "unbroken") if lib in results]
    names = {"streaming": "MosaicML Streaming", "litdata": "LitData", "unbroken": "unbroken"}
    fig, axes = new_figure(
        payload,
        f"Streaming {data['samples']:,} samples of 1 KiB from a local S3 server (moto), batch 64",
        ncols=3,
        width=13,
    )
    keys = [
        ("w0_cold", "0 workers\ncold"),
        ("w0_warm", "0 workers\nwarm"),
        ("w2_cold", "2 workers\ncold"),
        ("w2_warm", "2 workers\nwarm"),
    ]
    bars(
        axes[0],
        [label for _, label in keys],
        [
            (names[lib], lib, [results[lib].get("throughput", {}).get(k) for k, _ in keys], [])
            for lib in libs
        ],
        lambda v: f"{v / 1000:.0f}k",
    )
    axes[0].set_title("throughput of a shuffled epoch (cold: empty cache)", fontsize=9)
    axes[0].set_ylabel("samples/s (higher is better)")
    axes[0].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:.0f}k"))
    headroom(axes[0], 1.15)
    positions = ["1%", "50%", "99%"]

    def resume(lib: str, pos: str, field: str, run: str = "cold") -> float | None:
        value = results[lib].get("resume", {}).get(pos, {}).get(run, {}).get(field)
        return value if isinstance(value, (int, float)) else None

    # A restarted process on a warm cache, timed from its spawn (every import inside), with 0
    # and 2 workers; runs of before this field existed had only the time from building.
    runs = [(p, run, w) for p in positions for run, w in (("warm", 0), ("warm_w2", 2))]
    bars(
        axes[1],
        [f"{p}\n{w} wkr" for p, _, w in runs],
        [
            (names[lib], lib, [resume(lib, p, "process_seconds", run) for p, run, _ in runs], [])
            for lib in libs
        ],
        lambda v: f"{v:.2f} s",
    )
    axes[1].set_title(
        "resume in a new process, warm cache:\nfrom its spawn to the first batch", fontsize=9
    )
    axes[1].set_ylabel("seconds, imports included (lower is better)")
    headroom(axes[1], 1.15)
    mb: list[Series] = [
        (
            names[lib],
            lib,
            [None if (v := resume(lib, p, "cache_bytes")) is None else v / 1e6 for p in positions],
            [],
        )
        for lib in libs
    ]
    bars(axes[2], [f"at {p}" for p in positions], mb, lambda v: f"{v:.0f}")
    axes[2].set_title("resume with an empty cache: downloaded by then", fontsize=9)
    axes[2].set_ylabel("MB in the local cache (lower is better)")
    headroom(axes[2], 1.15)
    save(fig, payload, out / "stream_peers.png", legend=axes[0])
    return [
        (
            "stream_peers.png",
            "Streaming throughput and resume cost vs MosaicML Streaming and LitData",
        )
    ]


def _drawn_by_script(
    payload: dict[str, Any], out: Path, name: str, caption: str
) -> list[tuple[str, str]]:
    """The figure benchmark ``name`` draws itself on a full run (its ``draw``, with this
    module's helpers), here from the JSON, so that the two are one drawing."""
    import importlib
    from types import SimpleNamespace

    # draw() imports "report": let that be this module, not a second copy of it when this
    # script runs as __main__.
    sys.modules.setdefault("report", sys.modules[__name__])
    sys.path.insert(0, str(HERE))
    draw = importlib.import_module(name).draw  # imports torch: only when there are results

    results = SimpleNamespace(
        data=payload["data"],
        quick=payload.get("quick", False),
        command=payload.get("command", "?"),
        environment=payload.get("environment", {}),
    )
    draw(results, str(out / f"{name}.png"))
    return [(f"{name}.png", caption)]


def plot_remote_checkpoint(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    return _drawn_by_script(
        payload,
        out,
        "remote_checkpoint",
        "Checkpoints in object storage: save, loop stall, load and fresh-process resume vs "
        "torch.save+fsspec and DCP FsspecWriter",
    )


def plot_goodput(payload: dict[str, Any], out: Path) -> list[tuple[str, str]]:
    return _drawn_by_script(
        payload,
        out,
        "goodput",
        "Goodput against the mean time between failures: plain PyTorch, Lightning, "
        "Lightning + unbroken and unbroken's Trainer",
    )


PLOTS: dict[str, Callable[[dict[str, Any], Path], list[tuple[str, str]]]] = {
    "overhead": plot_overhead,
    "resume_latency": plot_resume_latency,
    "trainer_overhead": plot_trainer_overhead,
    "lightning_resume": plot_lightning_resume,
    "hf_resume": plot_hf_resume,
    "checkpoint_blocking": plot_checkpoint_blocking,
    "stream_overhead": plot_stream_overhead,
    "ddp_loader": plot_ddp_loader,
    "ddp_checkpoint": plot_ddp_checkpoint,
    "ddp_reduction": lambda payload, out: [],  # a table only
    "stream_peers": plot_stream_peers,
    "remote_checkpoint": plot_remote_checkpoint,
    "goodput": plot_goodput,
}


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


def git(*args: str) -> str:
    sys.path.insert(0, str(HERE))
    from _common import _git  # the benchmarks' own helper: the same commit they record

    return _git(*args)


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
                plots = PLOTS[name](payload, args.plots)
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
