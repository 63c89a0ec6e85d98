"""Shared helpers for the benchmarks: environment description and markdown tables."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                             timeout=10, check=False)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def environment() -> list[str]:
    """Markdown bullet lines describing where and on what the benchmark ran."""
    import numpy as np
    import torch

    try:
        import torchdata
        torchdata_version = torchdata.__version__
    except ImportError:
        torchdata_version = "not installed"
    import unbroken

    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--", "src")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
        f"- machine: {cores} cores usable ({_cpu_model()}), {platform.system()} "
        f"{platform.release()}, no GPU used",
        f"- python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"torchdata {torchdata_version}, unbroken {unbroken.__version__} "
        f"(git {commit}{', src/ has uncommitted changes' if dirty else ''})",
        f"- load average (1/5/15 min) at start: {_load()}",
    ]


def load_line() -> str:
    return f"- load average (1/5/15 min) at end: {_load()}"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        out = []
        for i, cell in enumerate(cells):
            cell = str(cell)
            out.append(cell.ljust(widths[i]) if i < left else cell.rjust(widths[i]))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(
        (" " + "-" * w + " " if i < left else " " + "-" * w + ":")
        for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])
