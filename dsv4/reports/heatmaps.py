"""`summary.png`: one heatmap per metric over a sweep's pivot; cells without numbers are grey and say why.

The colour scale is the metric's (dsv4.reports.summary_metrics.Scale) and never narrower than its values'
meaning: a log scale spans at least a decade around the values, a linear one starts at zero, so two
near-equal values get near-equal colours instead of the two ends of the colour bar.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dsv4.reports.report import Status
from dsv4.reports.summary_metrics import Metric, Scale

MIN_DECADES = 1.0     # a log colour bar spans at least this many decades


def color_norm(metric: Metric, values: list[float]):
    """The matplotlib norm of `metric`'s heatmap over its cells' `values`."""
    from matplotlib.colors import LogNorm, Normalize

    positive = [v for v in values if v > 0]
    if metric.scale is Scale.LOG and positive:
        lo, hi = math.log10(min(positive)), math.log10(max(positive))
        pad = max(0.0, MIN_DECADES - (hi - lo)) / 2
        return LogNorm(vmin=10 ** (lo - pad), vmax=10 ** (hi + pad), clip=True)
    lo, hi = min([0.0, *values]), max([0.0, *values])
    return Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1.0)


def write_png(pivot, metrics: tuple[Metric, ...], path: Path, title: str) -> Path | None:
    """The heatmaps of `metrics` side by side, saved; None when matplotlib is not installed or there are
    none. `pivot`: dsv4.reports.sweep_summary.Pivot."""
    fig = figure(pivot, metrics, title)
    if fig is None:
        return None
    fig.savefig(path, dpi=120)
    return path


def figure(pivot, metrics: tuple[Metric, ...], title: str):
    """The matplotlib Figure of `write_png` (one image per metric), or None."""
    try:
        import matplotlib
        import numpy as np
        from matplotlib import patheffects
        from matplotlib.figure import Figure  # no pyplot: no global backend state
    except ImportError:
        return None
    if not metrics:
        return None
    nr, nc = len(pivot.row_labels), len(pivot.col_labels)
    halo = [patheffects.withStroke(linewidth=2.5, foreground="white")]    # text readable on every colour
    fig = Figure(figsize=(max(6.0, 1.6 * nc + 2.5) * len(metrics), max(3.0, 0.6 * nr + 2.0)), layout="constrained")
    fig.suptitle(title, fontsize=11)
    for ax, metric in zip(fig.subplots(1, len(metrics), squeeze=False)[0], metrics):
        grid = np.full((nr, nc), np.nan)
        for i, rl in enumerate(pivot.row_labels):
            for j, cl in enumerate(pivot.col_labels):
                r = pivot.cells.get((rl, cl))
                v = metric.value(r) if r is not None and r.get("status") == Status.OK else None
                if v is not None:
                    grid[i, j] = v
        ok = [float(v) for v in grid[~np.isnan(grid)]]
        norm = color_norm(metric, ok)
        if metric.scale is Scale.LOG:         # a zero (exact) at the floor; cells without numbers stay grey
            grid = np.where(np.isnan(grid) | (grid > 0), grid, norm.vmin)
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
        im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
        for i, rl in enumerate(pivot.row_labels):
            for j, cl in enumerate(pivot.col_labels):
                text, color = _cell(pivot.cells.get((rl, cl)), metric)
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color=color, path_effects=halo)
        ax.set_xticks(range(nc), pivot.col_labels, rotation=30, ha="right")
        ax.set_yticks(range(nr), pivot.row_labels)
        ax.set_xlabel(pivot.col_title)
        ax.set_ylabel(pivot.row_title)
        ax.set_title(metric.title, fontsize=9, wrap=True)
        if ok:
            fig.colorbar(im, ax=ax, shrink=0.8)
    return fig


def _cell(row: dict[str, Any] | None, metric: Metric) -> tuple[str, str]:
    """A cell's text and its colour: the number, or why there is none (in red)."""
    if row is None:
        return "not run", "black"
    if row.get("status") != Status.OK:
        return str(row.get("status")), "#b00000"
    return metric.format(metric.value(row)), "black"
