"""Sizes for people: one formatter, so the CLI and the disk-space error say sizes alike."""

from __future__ import annotations


def human(size: float) -> str:
    """``size`` bytes, readable, in binary units: ``"512 B"``, ``"1.5 KiB"``, ``"2.0 GiB"``."""
    if size < 1024:
        return f"{int(size)} B"
    value, units = float(size) / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while value >= 1024 and len(units) > 1:
        value, units = value / 1024, units[1:]
    return f"{value:.1f} {units[0]}"
