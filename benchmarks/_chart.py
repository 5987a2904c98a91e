"""Draw the result tables the benchmark scripts print: each contender's ratio to raw PyTorch, with the noise band.

The scripts print tables (see `_common.print_table`); this module reads them back from that text, so a chart
can be drawn from a run just made or from a file written earlier with `run_all.py --tee`. matplotlib is
imported only inside `draw`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SCRIPT_HEADER = re.compile(r"^=== python benchmarks/(\S+)")
_TABLE_HEADER = re.compile(r"^contender\s+median (\S+)")
_NUMBER = r"(-?[\d.]+|nan)"
_ROW = re.compile(rf"^(?P<label>.+?)\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s+(?P<n>\d+)(?P<rest>.*)$")
_RATIO = re.compile(r"([\d.]+)x \([+-][\d.]+%\)")
_LOAD = re.compile(r"^machine: .*load avg ([\d.]+)")
_PEER = " (peer)"
# A line printed by _common.print_ratio: the median of the per-round ratios and their p25-p75 band.
_RATIO_LINE = re.compile(
    r"^ratio (?P<label>.+?): (?P<med>[\d.]+)x \(p25-p75 (?P<low>[\d.]+)-(?P<high>[\d.]+)x, n=(?P<n>\d+)\)"
)
_COLOURS = {"fabric": "#1f77b4", "lightning": "#7b3fa0", "accelerate": "#e07b00", "raw": "#7f7f7f"}


@dataclass
class Row:
    """One printed row: its statistics and, for a contender, its ratios to its baseline."""

    label: str
    median: float
    iqr: float
    p10: float
    n: int
    median_ratio: float | None = None
    p10_ratio: float | None = None


@dataclass
class Table:
    """One printed table (one measure), the script that printed it, and the peers that script skipped."""

    script: str
    title: str
    unit: str
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    load: str = ""  # the 1-minute load average when the script started, from its machine: line
    # Per-round ratio lines (print_ratio) of the script, drawn as their own panel: (label, median, p25, p75).
    ratios: list[tuple[str, float, float, float]] = field(default_factory=list)


def parse_tables(text: str) -> list[Table]:
    """Every result table in the output of one or more benchmark scripts, in the order printed."""
    tables: list[Table] = []
    script, previous, load = "", "", ""
    skipped: list[str] = []
    current: Table | None = None
    ratio_panel: Table | None = None
    for line in text.splitlines():
        if match := _SCRIPT_HEADER.match(line):
            script, skipped, current, ratio_panel = match.group(1), [], None, None
        elif match := _RATIO_LINE.match(line):
            if ratio_panel is None:
                ratio_panel = Table(script, "per-round ratios, p25-p75 band", "x", skipped=skipped, load=load)
                tables.append(ratio_panel)
            ratio_panel.ratios.append(
                (match.group("label"), *(float(match.group(k)) for k in ("med", "low", "high")))  # type: ignore[arg-type]
            )
            current = None
        elif match := _LOAD.match(line):
            load = match.group(1)
        elif line.startswith("skipped: "):
            skipped.append(line.removeprefix("skipped: "))
        elif match := _TABLE_HEADER.match(line):
            current = Table(script, previous.strip(), match.group(1), skipped=skipped, load=load)
            tables.append(current)
        elif current is not None and not line.startswith("---"):
            row = _parse_row(line)
            if row is None:
                current = None  # a blank line or any other text ends the table
            else:
                current.rows.append(row)
        previous = line
    return [table for table in tables if table.rows or table.ratios]


def _parse_row(line: str) -> Row | None:
    match = _ROW.match(line)
    if match is None:
        return None
    ratios = [float(r) for r in _RATIO.findall(match.group("rest"))]
    median, iqr, p10 = (float(match.group(i)) for i in (2, 3, 4))
    return Row(
        match.group("label").strip(), median, iqr, p10, int(match.group("n")),
        ratios[0] if ratios else None, ratios[1] if len(ratios) > 1 else None,
    )  # fmt: skip


@dataclass
class Point:
    """What one contender's line on a chart shows."""

    label: str
    ratio: float
    low: float  # the contender's quartiles, divided by its baseline's median
    high: float
    p10_ratio: float | None
    colour: str


def _colour(label: str) -> str:
    name = label.removeprefix("import ").lower()
    return next((colour for key, colour in _COLOURS.items() if name.startswith(key)), _COLOURS["raw"])


def _baseline_of(row: Row, rows: list[Row]) -> Row | None:
    """The baseline row a contender's printed ratio refers to: same interpreter, median = median / ratio."""
    assert row.median_ratio is not None
    target = row.median / row.median_ratio if row.median_ratio else math.nan
    peer = row.label.endswith(_PEER)
    candidates = [r for r in rows if r.median_ratio is None and r.label.endswith(_PEER) == peer and r.median > 0]
    return min(candidates, key=lambda r: abs(r.median - target), default=None)


def chart_points(table: Table) -> tuple[list[Point], tuple[float, float] | None]:
    """The contenders' points, plus raw PyTorch's noise band (its quartiles over its median), if measurable.

    A table of per-round ratios has no separate band: each point's bar is the p25-p75 of its paired ratios, and a
    bar that crosses 1.0 means that difference is inside the noise (drawn hollow).
    """
    if table.ratios:
        return [Point(label, med, low, high, None, _colour(label)) for label, med, low, high in table.ratios], None
    points: list[Point] = []
    for row in table.rows:
        base = _baseline_of(row, table.rows) if row.median_ratio is not None else None
        if base is None or row.median_ratio is None:
            continue
        half = row.iqr / 2 / base.median
        points.append(Point(row.label, row.median_ratio, row.median_ratio - half, row.median_ratio + half,
                            row.p10_ratio, _colour(row.label)))  # fmt: skip
    baselines = [r for r in table.rows if r.median_ratio is None and r.median > 0]
    ours = [r for r in baselines if not r.label.endswith(_PEER)]
    peers = [r for r in baselines if r.label.endswith(_PEER)]
    if ours and peers and peers[0].label.removesuffix(_PEER) == ours[0].label:
        # The same torch and code run by two interpreters: whatever separates them is noise.
        ratio = peers[0].median / ours[0].median
        half = peers[0].iqr / 2 / ours[0].median
        points.append(Point(f"{peers[0].label} vs {ours[0].label}", ratio, ratio - half, ratio + half, None,
                            _COLOURS["raw"]))  # fmt: skip
    band = None
    if ours and ours[0].iqr > 0:
        half = ours[0].iqr / 2 / ours[0].median
        band = (1 - half, 1 + half)
    return points, band


def draw(tables: list[Table], path: Path, subtitle: str = "") -> Path:
    """Draw one panel per table into the image `path` (its suffix picks the format); return the path."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "run_all.py: drawing the charts needs matplotlib, which is not installed. "
            "Run pip install matplotlib (or torchfabric[bench]), or pass --no-chart."
        ) from None
    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    drawn = [table for table in tables if chart_points(table)[0]]
    if not drawn:
        raise ValueError("no table with a ratio to raw PyTorch was found in the output; nothing to draw")
    columns = 2 if len(drawn) > 1 else 1
    rows = math.ceil(len(drawn) / columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(7.5 * columns, 0.8 + 2.9 * rows), squeeze=False, layout="constrained"
    )
    for ax, table in zip(axes.flat, drawn, strict=False):
        _draw_panel(ax, table)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.set_visible(False)
    title = (
        "Ratio to raw PyTorch run by the same interpreter (1.0 = equal; lower = faster or smaller). "
        "Grey band: raw PyTorch's own inter-quartile range over its median, i.e. the noise."
    )
    fig.suptitle(_wrap(title, 60 * columns) + (f"\n{_wrap(subtitle, 60 * columns)}" if subtitle else ""), fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _draw_panel(ax: Any, table: Table) -> None:
    points, band = chart_points(table)
    positions = list(range(len(points)))[::-1]
    if band is not None:
        ax.axvspan(*band, color="#dddddd")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for y, point in zip(positions, points, strict=True):
        noise = bool(table.ratios) and point.low <= 1.0 <= point.high
        ax.errorbar(
            point.ratio, y, xerr=[[point.ratio - point.low], [point.high - point.ratio]], fmt="o",
            color=point.colour, capsize=3, markerfacecolor="white" if noise else point.colour,
        )  # fmt: skip
        if point.p10_ratio is not None:
            ax.plot(point.p10_ratio, y, marker="|", markersize=12, color=point.colour)
    ax.set_yticks(positions, [p.label for p in points], fontsize=8)
    _set_x_range(ax, points, band)
    load = f" (load avg {table.load} at start)" if table.load else ""
    ax.set_title(_wrap(f"{table.script}{load}: {table.title}", 80), fontsize=9)
    if table.ratios:
        ax.set_xlabel("median of per-round ratios to raw (bar: p25-p75; hollow: inside the noise)", fontsize=8)
    else:
        ax.set_xlabel("ratio to raw PyTorch (dot: median, bar: IQR, tick: p10)", fontsize=8)
    if table.skipped:  # e.g. "accelerate: not importable by ..." from the script's own skipped: lines
        note = "\n".join("not measured: " + _wrap(reason, 70) for reason in table.skipped)
        ax.text(0.99, 0.02, note, transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="#b00000")


def _set_x_range(ax: Any, points: list[Point], band: tuple[float, float] | None) -> None:
    """Fit the medians and p10s (and the band, when it is narrower); IQR bars may run off the edge."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    values = [v for p in points for v in (p.ratio, p.p10_ratio) if v is not None and v > 0] + [1.0]
    low, high = min(values), max(values)
    if high / low > 8:  # e.g. a peer that needs a second copy of the checkpoint in memory
        ax.set_xscale("log")
        ax.set_xlim(low / 1.5, high * 1.5)
        if high / low < 100:  # few decades: 1-2-5 steps; more would crowd the axis
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%gx"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        return
    if band is not None:  # a band wider than the points would squeeze them together: it may be clipped
        low, high = min(low, max(band[0], low - (high - low))), max(high, min(band[1], high + (high - low)))
    margin = (high - low) * 0.15 or 0.05
    ax.set_xlim(max(0.0, low - margin), high + margin)
    ax.xaxis.set_major_formatter(FormatStrFormatter("%.2fx"))


def _wrap(text: str, width: int = 90) -> str:
    if len(text) <= width:
        return text
    cut = text.rfind(" ", 0, width)
    return text[:cut] + "\n" + _wrap(text[cut + 1 :], width)
