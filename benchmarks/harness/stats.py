"""Medians with intervals, and interleaved rounds: how every benchmark summarises its timings.

Rounds are interleaved so that a drift in the machine's speed (this VM is shared) hits every
system alike: each round runs every system once, from the same moment, in an order rotated
every round, and a system's time is compared with the baseline's in the same round (a paired
ratio). Pure Python and numpy: microseconds per call, the bootstrap ~1 ms.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from .env import ForeignLoad

T = TypeVar("T")


def median_ci(xs: Sequence[float], resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap 95% confidence interval of the median (percentile method, fixed seed)."""
    values = np.asarray(xs, dtype=float)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(values, size=(resamples, len(values))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def median(xs: Sequence[float]) -> float:
    """The median, NaN for no values (a system that never ran)."""
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> str:
    """``median (min-max)`` to 3 decimals, ``-`` for no values."""
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def rotated(names: Sequence[T], index: int) -> list[T]:
    """``names`` rotated by ``index``: round ``index``'s running order."""
    shift = index % len(names)
    return [*names[shift:], *names[:shift]]


def interleaved(
    names: Sequence[str],
    run_one: Callable[[str], Any],
    rounds: int,
    after: Callable[[int, dict[str, Any]], None] = lambda index, this: None,
) -> tuple[list[dict[str, Any]], list[float]]:
    """``rounds`` rounds of ``run_one(name)`` for every name, the order rotated every round;
    ``after(index, round)`` at each round's end. Returns the rounds and, per round, the cores
    other processes used meanwhile."""
    monitor, out, foreign = ForeignLoad(), [], []
    for index in range(rounds):
        before = monitor.snapshot()
        out.append({name: run_one(name) for name in rotated(names, index)})
        foreign.append(ForeignLoad.cores(before, monitor.snapshot()))
        after(index, out[-1])
    return out, foreign


def probed_rounds(
    names: Sequence[str],
    run_one: Callable[[str], Any],
    want: int,
    most: int,
    max_foreign: float,
    monitor: ForeignLoad | None = None,
    more: Callable[[bool], bool] = lambda wanted: wanted,
    peak: bool = False,
) -> tuple[list[dict[str, Any]], list[float], int]:
    """Interleaved rounds until ``want`` were clean of other processes' load (at most
    ``max_foreign`` cores) or ``most`` ran. Returns (rounds used, every round's foreign load,
    the number of clean rounds); with fewer than min(3, ``want``) clean rounds, all are used.
    ``monitor`` None: no probe (load 0; a rank other than 0); ``more``: how every rank agrees
    on going on (identity in one process); ``peak``: a round's load is the highest of its
    systems' runs, each probed alone, instead of the mean over the round."""
    rounds: list[tuple[float, dict[str, Any]]] = []
    clean: list[dict[str, Any]] = []
    loads: list[float] = []

    def probed(name: str) -> Any:
        before = monitor.snapshot() if monitor else None
        value = run_one(name)
        loads.append(ForeignLoad.cores(before, monitor.snapshot()) if monitor and before else 0.0)
        return value

    while True:
        loads.clear()
        before = monitor.snapshot() if monitor and not peak else None
        this = {name: (probed if peak else run_one)(name) for name in rotated(names, len(rounds))}
        if peak:
            foreign = max(loads, default=0.0)
        else:
            foreign = ForeignLoad.cores(before, monitor.snapshot()) if monitor and before else 0.0
        rounds.append((foreign, this))
        if foreign <= max_foreign:
            clean.append(this)
        if not more(len(clean) < want and len(rounds) < max(most, want)):
            break
    used = clean if len(clean) >= min(3, want) else [r for _, r in rounds]
    return used, [f for f, _ in rounds], len(clean)


def probe_note(what: str, foreign: Sequence[float], n_clean: int, want: int) -> str:
    """A line on how clean ``probed_rounds``' rounds were."""
    disturbed = n_clean < min(3, want)
    return (
        f"{what}: {n_clean} clean of {len(foreign)} rounds (other processes: max "
        f"{max(foreign):.2f} cores, median {statistics.median(foreign):.2f})"
        + ("; TOO FEW CLEAN ROUNDS, all used: disturbed" if disturbed else "")
    )
