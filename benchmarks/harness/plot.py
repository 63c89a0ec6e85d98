"""One figure shape for every benchmark: panels of bars (or lines) of a metric per system.

A benchmark's figure is a small spec: a title and ``Panel``s, each a metric (``ylabel``) over
groups (the cases compared) with one ``Series`` per system: its value per group, optionally an
interval and a label. ``draw`` lays it out, with one colour per library everywhere, a legend
below the panels and a footer naming the run. matplotlib only; ~0.3 s and ~50 KB a figure.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on the benchmark machines
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from PIL import Image  # a dependency of matplotlib

DPI = 100  # ~800x450 px figures: legible on GitHub, a few tens of KB each

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
    "lightning": "#792ee5",
    "lightning-unbroken": "#c5a3f5",
    "torch skip batches": "#8c8c8c",
    "torch skip indices": "#c7c7c7",
    "dcp": "#4d4d4d",
}
# Value labels on a white ground: an error bar crossing one must not make it unreadable.
LABEL_BOX = {"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8}
Interval = tuple[float, float] | None
PCT = "{:+.1f}%"


@dataclass
class Series:
    """One system: its value per group (None: no bar), an interval per group (None or a shorter
    list: none), and a label per value (default: the panel's ``fmt``)."""

    label: str
    color: str  # a key of COLORS, or a colour
    values: Sequence[float | None]
    intervals: Sequence[Interval] = ()
    texts: Sequence[str] = ()
    style: str = "-"  # lines only: the line style and the marker
    marker: str = "o"
    hollow: Sequence[bool] = ()  # lines only: points drawn hollow (e.g. a run not finished)


@dataclass
class Panel:
    """One metric over groups, a series per system."""

    groups: Sequence[str]
    series: Sequence[Series]
    ylabel: str
    title: str = ""
    fmt: str = "{:.2f}"  # a value's label
    log: bool = False
    lines: bool = False  # lines over the groups instead of grouped bars
    refs: dict[float, str] = field(default_factory=dict)  # horizontal lines: y -> legend label
    xlabel: str = ""
    headroom: float = 1.2  # room above the bars for their labels
    legend: bool = False  # a legend inside this panel instead of below the figure


def _interval(series: Series, group: int) -> Interval:
    return series.intervals[group] if group < len(series.intervals) else None


def _bars(ax: Axes, panel: Panel) -> None:
    n = max(1, len(panel.series))
    width = 0.8 / n
    for i, s in enumerate(panel.series):
        labelled = False  # one legend entry per series, on its first bar
        for g, value in enumerate(s.values):
            if value is None:
                continue
            x = g - 0.4 + width * (i + 0.5)
            color = COLORS.get(s.color, s.color)
            label = None if labelled else s.label
            ax.bar(x, value, width, color=color, edgecolor="#333333", linewidth=0.5, label=label)
            labelled = True
            err = _interval(s, g)
            top = value
            if err is not None:
                low, high = err
                yerr = [[max(0.0, value - low)], [max(0.0, high - value)]]
                ax.errorbar(x, value, yerr=yerr, fmt="none", ecolor="#222222", elinewidth=0.8)
                top = max(value, high) if value >= 0 else min(value, low)
            text = s.texts[g] if g < len(s.texts) else panel.fmt.format(value)
            ax.annotate(
                text,
                (x, top),
                xytext=(0, 2 if value >= 0 else -2),
                textcoords="offset points",
                ha="center",
                va="bottom" if value >= 0 else "top",
                fontsize=6.5,
                rotation=90 if n > 3 and "\n" not in text else 0,  # narrow bars: upright overlap
                bbox=LABEL_BOX,
            )


def _lines(ax: Axes, panel: Panel) -> None:
    x = list(range(len(panel.groups)))
    for s in panel.series:
        points = [(xi, v, g) for g, (xi, v) in enumerate(zip(x, s.values)) if v is not None]
        if not points:
            continue
        color = COLORS.get(s.color, s.color)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        spans = [_interval(s, g) or (v, v) for _, v, g in points]
        yerr = [
            [v - lo for v, (lo, _) in zip(ys, spans)],
            [hi - v for v, (_, hi) in zip(ys, spans)],
        ]
        ax.errorbar(
            xs,
            ys,
            yerr=yerr,
            fmt=s.style,
            marker=s.marker,
            capsize=3,
            color=color,
            label=s.label,
            linewidth=1.6,
        )
        for xi, v, g in points:
            if g < len(s.hollow) and s.hollow[g]:
                ax.plot(xi, v, s.marker, markersize=11, markerfacecolor="white", color=color)
            text = s.texts[g] if g < len(s.texts) else panel.fmt.format(v)
            if text:
                ax.annotate(
                    text,
                    (xi, v),
                    xytext=(0, 6),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color=color,
                    bbox=LABEL_BOX,
                )


def _panel(ax: Axes, panel: Panel) -> None:
    (_lines if panel.lines else _bars)(ax, panel)
    ax.set_xticks(range(len(panel.groups)))
    ax.set_xticklabels(panel.groups, fontsize=8)
    if panel.log:
        ax.set_yscale("log")
    for y, label in panel.refs.items():
        dashed = bool(label)
        color, style = ("#d62728", "--") if dashed else ("#333333", "-")
        ax.axhline(y, color=color, linewidth=0.8, linestyle=style, label=label or None)
    ax.set_ylabel(panel.ylabel)
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel(panel.xlabel, fontsize=8)
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.set_axisbelow(True)
    low, high = ax.get_ylim()
    if panel.log:
        ax.set_ylim(low / 2, high * panel.headroom**4)
    else:
        span = (high - low) * (panel.headroom - 1)
        ax.set_ylim(low - (span if low < 0 else 0), high + span)
    if panel.lines:
        ax.set_xlim(-0.3, len(panel.groups) - 0.5)
    if panel.legend:
        ax.legend(fontsize=7, loc="upper left")


def run_kind(payload: dict[str, Any]) -> str:
    return "quick run (--quick: numbers are noise)" if payload.get("quick") else "full run"


def draw(
    payload: dict[str, Any], title: str, panels: Sequence[Panel], path: Path, ncol: int = 3
) -> None:
    """``panels`` side by side under ``title``, saved at ``path`` with a footer naming the run
    (date, commit, machine, command), so a plot seen on its own still says where its numbers
    come from; the legend of the first panel goes below them (where it hides no bar)."""
    # Wide enough for the group labels side by side (~0.07 inch a character at fontsize 8).
    chars = sum(max(map(len, g.split("\n"))) + 2 for p in panels for g in p.groups)
    width = max({1: 8.0, 2: 11.0}.get(len(panels), 13.0), 0.07 * chars + len(panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 5.0), squeeze=False)
    fig.suptitle(f"{title}\n{run_kind(payload)}", fontsize=11)
    for ax, panel in zip(axes[0], panels):
        _panel(ax, panel)
    env = payload.get("environment", {})
    machine = str(env.get("machine", "")).split(",")[0]
    footer = (
        f"{run_kind(payload)} | {str(env.get('date', '?'))[:16].replace('T', ' ')} | git "
        f"{env.get('git', '?')} | {machine}\n{payload.get('command', '?')}"
    )
    height = fig.get_figheight()
    bottom = 0.36 / height  # the footer's two lines, in figure coordinates
    fig.text(0.01, 0.01, footer, fontsize=6.5, color="#555555", ha="left", va="bottom")
    if not panels[0].legend:
        handles, labels = axes[0][0].get_legend_handles_labels()
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


# --------------------------------------------------------------------------- ratios to a baseline


def pct(ratio: float) -> float:
    """A time ratio against a baseline as percent slower (+) or faster (-)."""
    return (ratio - 1.0) * 100.0


def pct_interval(interval: Sequence[float] | None) -> tuple[float, float] | None:
    return None if interval is None else (pct(interval[0]), pct(interval[1]))


def ratio_series(rows: list[dict], key: Callable[[dict], Any], keys: list, ci: str) -> list[Series]:
    """One series per loader other than torch's: its time over torch's in %, per ``keys`` of
    ``key(row)``, with the rows' ``ci`` interval as error bars."""
    series = []
    for name in [n for n in dict.fromkeys(r["loader"] for r in rows) if n != "torch"]:
        mine = {key(r): r for r in rows if r["loader"] == name}
        values = [pct(mine[k]["ratio"]) if k in mine else None for k in keys]
        spread = [pct_interval(mine[k][ci]) if k in mine else None for k in keys]
        series.append(Series(next(iter(mine.values()))["label"], name, values, spread))
    return series


def per_worker_ratios(rows: list[dict], ci: str, ylabel: str, title: str = "") -> Panel:
    """A loader's time over torch's, grouped by num_workers."""
    workers = sorted({r["workers"] for r in rows})
    torch_us = {r["workers"]: r["us_per_step"] for r in rows if r["loader"] == "torch"}
    groups = [f"num_workers={w}\n(torch: {torch_us.get(w, 0):,.0f} us/step)" for w in workers]
    series = ratio_series(rows, lambda r: r["workers"], workers, ci)
    return Panel(groups, series, ylabel, title, PCT, refs={0.0: ""})
