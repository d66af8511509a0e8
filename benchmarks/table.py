"""The bench's rows: each figure's ratio over its repeats (median, minimum, maximum), and the table that prints them.

A row's ratio is taken in each repeat from that repeat's own pair of measurements (the two sides of a
figure run interleaved, so drift on the machine falls on both), then summarised over the repeats.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypedDict

FIGURE_W, MEASURED_W = 34, 62


class Spread(TypedDict):
    """A value over the repeats: their median, minimum and maximum, and each repeat's value in order."""

    median: float
    min: float
    max: float
    values: list[float]


class Row(TypedDict):
    """One line of the table: what it compares, the measurements, its ratio over the repeats (None: a note)."""

    key: str
    figure: str
    measured: str
    ratio: Spread | None
    target: str


def spread(values: Sequence[float]) -> Spread:
    """The median, minimum and maximum of one value measured in each repeat."""
    xs = [float(x) for x in values]
    if not xs:
        raise ValueError("a spread needs at least one value")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Each repeat's ``a / b``, the two sides taken from the same repeat."""
    if len(a) != len(b):
        raise ValueError(f"ratios of unpaired repeats: {len(a)} against {len(b)}")
    return [float(x) / float(y) for x, y in zip(a, b, strict=True)]


def over(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    """``median [min..max]`` of ``values`` times ``scale``, for a row's measured column."""
    s = spread([x * scale for x in values])
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}..{s['max']:.{digits}f}]"


def row(key: str, figure: str, measured: str, values: Sequence[float], target: str) -> Row:
    """A row whose ratio was measured once per repeat (``values``)."""
    return {"key": key, "figure": figure, "measured": measured, "ratio": spread(values), "target": target}


def note(key: str, figure: str, text: str) -> Row:
    """A row with no ratio: a breakdown, a figure not measured and why."""
    return {"key": key, "figure": figure, "measured": text, "ratio": None, "target": ""}


def find(rows: Sequence[Row], key: str) -> Row:
    """The row named ``key``; KeyError naming the keys there are if none is."""
    for r in rows:
        if r["key"] == key:
            return r
    raise KeyError(f"no row {key!r}; rows: {', '.join(r['key'] for r in rows)}")


def ratio_text(s: Spread) -> str:
    """The ratio column: the median, then the repeats' range."""
    return f"{s['median']:7.3f} [{s['min']:.3f}..{s['max']:.3f}]"


def format_row(r: Row) -> str:
    """One line of the table."""
    if r["ratio"] is None:
        return f"{r['figure']:<{FIGURE_W}} {r['measured']}"
    return f"{r['figure']:<{FIGURE_W}} {r['measured']:<{MEASURED_W}} {ratio_text(r['ratio'])}  {r['target']}"


def format_rows(repeats: int, rows: Sequence[Row], steal: dict[str, float | None] | None = None) -> str:
    """The table: a heading, the CPU steal while each figure was measured (where known), then every row."""
    lines = [
        f"repeats: {repeats} (measured: median [min..max]; ratio: median of each repeat's ratio [min..max])",
        f"{'figure':<{FIGURE_W}} {'measured':<{MEASURED_W}} {'ratio':>7}  target",
    ]
    known = {k: v for k, v in (steal or {}).items() if v is not None}
    if known:
        lines.insert(
            1,
            "host CPU steal while measured (a VM's host serving others): "
            + ", ".join(f"{name} {v:.0%}" for name, v in known.items()),
        )
    lines.extend(format_row(r) for r in rows)
    return "\n".join(lines)
