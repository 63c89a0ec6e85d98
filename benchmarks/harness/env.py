"""Where and on what a benchmark runs, and how busy other processes kept the machine.

Machine metadata (cores, CPU, torch and unbroken versions, git commit, load average), the command
line, markdown tables, and ``ForeignLoad``: the cores other processes used during an interval,
from ``/proc`` (this VM is shared with other work). Reading ``/proc`` costs a few milliseconds a
snapshot, so probe intervals of a second or more.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git(*args: str) -> str:
    """``git -C REPO args``' output, or '' where git is missing or fails."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10, check=False
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def environment_info() -> dict[str, str]:
    """Where and on what the benchmark runs, one entry per fact (report.py reads these)."""
    import numpy as np
    import torch

    import unbroken

    try:
        import torchdata

        torchdata_version = torchdata.__version__
    except ImportError:
        torchdata_version = "not installed"
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "src")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{cores} cores usable ({_cpu_model()}), {platform.system()} "
        f"{platform.release()}, no GPU used",
        "software": f"python {platform.python_version()}, torch {torch.__version__}, numpy "
        f"{np.__version__}, torchdata {torchdata_version}, unbroken {unbroken.__version__}",
        "git": commit + (", src/ has uncommitted changes" if dirty else ""),
        "load_start": load_average(),
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


def load_line() -> str:
    return f"- load average (1/5/15 min) at end: {load_average()}"


def command_line() -> str:
    """The command that is running, with the interpreter's path relative when inside the repo."""
    python = sys.executable
    try:
        relative = os.path.relpath(python)
        python = relative if not relative.startswith("..") else python
    except ValueError:
        pass
    return shlex.join([python, *sys.argv])


def table(header: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[object]) -> str:
        out = [
            str(c).ljust(widths[i]) if i < left else str(c).rjust(widths[i])
            for i, c in enumerate(cells)
        ]
        return "| " + " | ".join(out) + " |"

    sep = "|".join(" " + "-" * w + (" " if i < left else ":") for i, w in enumerate(widths))
    return "\n".join([line(header), f"|{sep}|", *(line(r) for r in rows)])


# --------------------------------------------------------------------------- foreign load


def system_busy() -> float:
    """CPU-seconds the whole machine spent busy (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _proc_cpu(pid: int) -> tuple[int, float]:
    """(parent pid, CPU-seconds) of a process, from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    rest = text[text.rindex(")") + 2 :].split()  # the command name may contain spaces
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def tree_cpu(root: int, depth: int | None = None) -> float:
    """CPU-seconds of ``root`` and its live descendants (``depth`` 1: its children only)."""
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)], cpu[int(entry)] = _proc_cpu(int(entry))
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [(root, 0)]
    while todo:
        pid, level = todo.pop()
        total += cpu.get(pid, 0.0)
        if depth is None or level < depth:
            todo += [(child, level + 1) for child in children.get(pid, [])]
    return total


class ForeignLoad:
    """How busy *other* processes kept the machine during an interval, in cores.

    Machine busy time (``/proc/stat``) minus this process tree's CPU time (``/proc/<pid>/stat``),
    over the wall time. ``root``: the tree counted as our own (default: this process and its live
    children, e.g. DataLoader workers; a launcher's pid counts every rank and worker below it).
    ``waited``: count this process and the children it has waited for instead (``os.times``),
    for jobs that have exited by the interval's end. Resolution is the kernel tick (10 ms per
    process). Only on Linux; elsewhere it reports 0.
    """

    def __init__(self, root: int | None = None, waited: bool = False) -> None:
        self.available, self.waited = Path("/proc/stat").exists(), waited
        self.root = os.getpid() if root is None else root
        self.depth: int | None = 1 if root is None else None  # our live children, or all below

    def snapshot(self) -> tuple[float, float, float]:
        if not self.available:
            return (time.perf_counter(), 0.0, 0.0)
        own = sum(os.times()[:4]) if self.waited else tree_cpu(self.root, self.depth)
        return (time.perf_counter(), system_busy(), own)

    @staticmethod
    def cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
        wall = end[0] - start[0]
        foreign = (end[1] - start[1]) - (end[2] - start[2])
        return max(0.0, foreign / wall) if wall > 0 else 0.0


def process_age() -> float:
    """Seconds since this process started, imports included (``/proc``; 0 elsewhere)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / _TICK)
    except (OSError, ValueError, IndexError):
        return 0.0
