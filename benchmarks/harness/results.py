"""What one benchmark run measured, written as ``bench_output/NAME.json`` for ``report.py``.

Costs a JSON file of a few KB, written atomically at the end of the run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .env import REPO, command_line, environment_info, load_average, load_line, process_age, table

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


def parser(doc: str | None, name: str, quick: str) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first paragraph, with ``--quick`` (a smoke run:
    ``quick`` says what it shrinks) and ``--json``."""
    out = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    out.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    add_json_option(out, name)
    return out


def add_options(parser: argparse.ArgumentParser, spec: dict[str, tuple[Any, str | None]]) -> None:
    """One ``--name`` per ``name: (default, help)`` of ``spec`` (underscores become dashes), typed
    as its default: ``False`` makes a switch, ``None`` a string that defaults to None."""
    for name, (default, text) in spec.items():
        flag = "--" + name.replace("_", "-")
        if default is False:
            parser.add_argument(flag, action="store_true", help=text)
        else:
            kind = str if default is None else type(default)
            parser.add_argument(flag, type=kind, default=default, help=text)


def add_round_options(parser: argparse.ArgumentParser, most: int) -> None:
    """``--max-rounds`` and ``--max-foreign``: how rounds disturbed by other processes are set
    aside (``harness.stats.probed_rounds``)."""
    parser.add_argument(
        "--max-rounds", type=int, default=most, help="rounds at most, disturbed ones included"
    )
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.2,
        help="a round in which other processes used more cores than this is set aside",
    )


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


class Results:
    """What one benchmark run measured, written as JSON at its end for ``report.py``.

    The scripts print their tables; this keeps, beside them, the markdown tables as printed
    (``table``), the notes, and the numbers in structured form (``data``, one layout per
    benchmark, which report.py's figure spec for it reads). Written atomically, so a run killed
    midway leaves no file rather than half of one, and report.py then says it is missing.
    """

    def __init__(self, benchmark: str, path: str | None, args: argparse.Namespace) -> None:
        self.benchmark, self.path = benchmark, path or None
        self.quick = bool(getattr(args, "quick", False))
        self.args = dict(vars(args))
        self.args.pop("json", None)
        self.environment = environment_info()
        self.command = command_line()
        self._start = time.perf_counter() - process_age()  # the wall time counts the imports
        self.tables: list[dict[str, str]] = []
        self.notes: list[str] = []
        self.data: dict[str, Any] = {}

    def table(self, title: str, markdown: str) -> str:
        """Keep a printed table for the report; returns it so that ``print`` is unchanged."""
        self.tables.append({"title": title, "markdown": markdown})
        return markdown

    def show(
        self, title: str, header: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1
    ) -> None:
        """Print ``rows`` under ``header`` as a markdown table (``harness.table``) and keep it."""
        print(self.table(title, table(header, rows, left)), flush=True)

    def finish(self, notes: list[str], data: dict[str, Any]) -> None:
        """Print ``notes`` as a list and the load average at the end, then write the JSON."""
        print("\n" + "\n".join(f"- {note}" for note in notes) + "\n")
        print(load_line())
        self.notes, self.data = notes, data
        self.write()

    def write(self, wall_s: float | None = None) -> None:
        if self.path is None:
            return
        payload = {
            "schema": SCHEMA,
            "benchmark": self.benchmark,
            "quick": self.quick,
            "command": self.command,
            "wall_s": time.perf_counter() - self._start if wall_s is None else wall_s,
            "environment": {**self.environment, "load_end": load_average()},
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
