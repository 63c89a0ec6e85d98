"""Shared helpers for the benchmarks: environment description, markdown tables, and a probe of
how busy other processes kept the machine (this VM is shared with other work)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

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
        out = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10, check=False
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def environment_info() -> dict[str, str]:
    """Where and on what the benchmark runs, one entry per fact (report.py reads these)."""
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
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{cores} cores usable ({_cpu_model()}), {platform.system()} "
        f"{platform.release()}, no GPU used",
        "software": f"python {platform.python_version()}, torch {torch.__version__}, numpy "
        f"{np.__version__}, torchdata {torchdata_version}, unbroken {unbroken.__version__}",
        "git": commit + (", src/ has uncommitted changes" if dirty else ""),
        "load_start": _load(),
    }


def environment() -> list[str]:
    """Markdown bullet lines describing where and on what the benchmark ran."""
    info = environment_info()
    return [
        f"- date: {info['date']}",
        f"- command: `{info['command']}`",
        f"- machine: {info['machine']}",
        f"- {info['software']} (git {info['git']})",
        f"- load average (1/5/15 min) at start: {info['load_start']}",
    ]


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _system_busy() -> float:
    """CPU-seconds the whole machine spent busy (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _proc_cpu(pid: int) -> tuple[int, float]:
    """(parent pid, CPU-seconds) of a process, from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    rest = text[text.rindex(")") + 2 :].split()  # the command name may contain spaces
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def _own_tree_cpu() -> float:
    """CPU-seconds of this process and its live children (DataLoader workers)."""
    me = os.getpid()
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid, cpu = _proc_cpu(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if int(entry) == me or ppid == me:
            total += cpu
    return total


class ForeignLoad:
    """How busy *other* processes kept the machine during an interval, in cores.

    Machine busy time (``/proc/stat``) minus this process tree's CPU time (``/proc/<pid>/stat``),
    over the wall time. Resolution is the kernel tick (10 ms per process), so measure intervals
    of a second or more. Only on Linux; elsewhere it reports 0.
    """

    def __init__(self) -> None:
        self.available = Path("/proc/stat").exists()

    def snapshot(self) -> tuple[float, float, float]:
        if not self.available:
            return (time.perf_counter(), 0.0, 0.0)
        return (time.perf_counter(), _system_busy(), _own_tree_cpu())

    @staticmethod
    def cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
        wall = end[0] - start[0]
        foreign = (end[1] - start[1]) - (end[2] - start[2])
        return max(0.0, foreign / wall) if wall > 0 else 0.0


def load_line() -> str:
    return f"- load average (1/5/15 min) at end: {_load()}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        out = []
        for i, cell in enumerate(cells):
            cell = str(cell)
            out.append(cell.ljust(widths[i]) if i < left else cell.rjust(widths[i]))
        return "| " + " | ".join(out) + " |"

    sep = (
        "|"
        + "|".join(
            (" " + "-" * w + " " if i < left else " " + "-" * w + ":") for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


class RowDataset(torch.utils.data.Dataset):
    """BoringModel's RandomDataset: a precomputed tensor of random rows."""

    def __init__(self, rows: int, size: int = 32) -> None:
        self.data = torch.randn(rows, size, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def command_line() -> str:
    """The command that is running, with the interpreter's path relative when inside the repo."""
    python = sys.executable
    try:
        relative = os.path.relpath(python)
        python = relative if not relative.startswith("..") else python
    except ValueError:
        pass
    return shlex.join([python, *sys.argv])


# --------------------------------------------------------------------------- results as JSON

BENCH_OUTPUT = REPO / "bench_output"
SCHEMA = 1  # bump when report.py must tell an old file's layout from a new one


def add_json_option(parser: argparse.ArgumentParser, name: str) -> None:
    """``--json PATH``: where the run's numbers go for ``benchmarks/report.py``."""
    parser.add_argument(
        "--json",
        default=str(BENCH_OUTPUT / f"{name}.json"),
        metavar="PATH",
        help="write the measured numbers here as JSON, read by benchmarks/report.py "
        "('' for none; default: %(default)s)",
    )


def write_plot(given: str | None, quick: bool, name: str, draw: Any, results: Results) -> None:
    """``draw(results, path)`` at ``--plot``'s path (``given``; ``''``: none; by default
    ``benchmarks/plots/NAME.png`` on a full run, none with ``--quick``). A plot that fails is
    reported, not raised: the numbers are already printed and saved."""
    path = (
        given
        if given is not None
        else ("" if quick else str(REPO / "benchmarks" / "plots" / f"{name}.png"))
    )
    if not path:
        return
    try:
        draw(results, path)
        print(f"[plot written to {path}]", file=sys.stderr, flush=True)
    except Exception as error:  # the numbers are printed and saved: a plot is extra
        print(f"[no plot: {type(error).__name__}: {error}]", file=sys.stderr, flush=True)


def jsonable(value: Any) -> Any:
    """``value`` with what JSON cannot hold made plain: tuples and sets become lists, paths
    strings, and non-finite floats strings (``--quick`` sets ``max_foreign`` to inf, which
    ``json`` would write as the non-standard ``Infinity``)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _process_age() -> float:
    """Seconds since this process started, imports included (``/proc``; 0 elsewhere)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / _TICK)
    except (OSError, ValueError, IndexError):
        return 0.0


class Results:
    """What one benchmark run measured, written as JSON at its end for ``report.py``.

    The scripts print what they printed before; this only keeps, beside it, the markdown tables
    as printed (``table``), the notes, and the numbers in structured form (``data``, one layout
    per benchmark, which report.py's plot for it reads). Written atomically, so a run killed
    midway leaves no file rather than half of one, and report.py then says it is missing.
    """

    def __init__(self, benchmark: str, path: str | None, args: argparse.Namespace) -> None:
        self.benchmark, self.path = benchmark, path or None
        self.quick = bool(getattr(args, "quick", False))
        self.args = dict(vars(args))
        self.args.pop("json", None)
        self.environment = environment_info()
        self.command = command_line()
        self._start = time.perf_counter() - _process_age()  # the wall time counts the imports
        self.tables: list[dict[str, str]] = []
        self.notes: list[str] = []
        self.data: dict[str, Any] = {}

    def table(self, title: str, markdown: str) -> str:
        """Keep a printed table for the report; returns it so that ``print`` is unchanged."""
        self.tables.append({"title": title, "markdown": markdown})
        return markdown

    def write(self, wall_s: float | None = None) -> None:
        if self.path is None:
            return
        payload = {
            "schema": SCHEMA,
            "benchmark": self.benchmark,
            "quick": self.quick,
            "command": self.command,
            "wall_s": time.perf_counter() - self._start if wall_s is None else wall_s,
            "environment": {**self.environment, "load_end": _load()},
            "args": self.args,
            "tables": self.tables,
            "notes": self.notes,
            "data": self.data,
        }
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(jsonable(payload), indent=1, allow_nan=False) + "\n")
        partial.replace(path)
        print(f"[results written to {self.path}]", file=sys.stderr, flush=True)
