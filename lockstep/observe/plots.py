"""PNG plots of a run's metrics: the loss curve, and any named series (reward, lr, grad norm ...).

Figures are drawn with matplotlib's object API on an Agg canvas - no pyplot, no global backend
switch - so plotting is safe in headless jobs and does not disturb a caller's own matplotlib use.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

_FEW_POINTS = 30  # draw markers when a series is this short, so a single point is visible


def _series(records: Sequence[dict[str, Any]], key: str, x: str) -> tuple[list[float], list[float]]:
    xs: list[float] = []
    ys: list[float] = []
    for i, r in enumerate(records):
        y = r.get(key)
        if isinstance(y, bool) or not isinstance(y, (int, float)) or not math.isfinite(y):
            continue
        xv = r.get(x, i)
        xs.append(float(xv) if isinstance(xv, (int, float)) else float(i))
        ys.append(float(y))
    return xs, ys


def _new_figure() -> tuple[Figure, Any]:
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _finish(fig: Figure, ax: Any, out_png: str | os.PathLike[str], title: str, xlabel: str,
            ylabel: str, drew: bool) -> Path:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if drew:
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _plot(ax: Any, xs: list[float], ys: list[float], label: str, **kw: Any) -> None:
    marker = "o" if len(xs) <= _FEW_POINTS else None
    ax.plot(xs, ys, label=label, marker=marker, markersize=4, **kw)


def plot_series(records: Sequence[dict[str, Any]], keys: Sequence[str],
                out_png: str | os.PathLike[str], title: str, *, x: str = "step",
                ylabel: str | None = None, logy: bool = False) -> Path:
    """One line per key in ``keys`` over ``records[x]`` (records lacking a key are skipped;
    missing ``x`` falls back to the record index). Returns the PNG path."""
    fig, ax = _new_figure()
    drew = False
    for key in keys:
        xs, ys = _series(records, key, x)
        if xs:
            _plot(ax, xs, ys, key)
            drew = True
    if logy and drew:
        ax.set_yscale("log")
    return _finish(fig, ax, out_png, title, x, ylabel or ", ".join(keys), drew)


def plot_loss(metrics: Sequence[dict[str, Any]], out_png: str | os.PathLike[str],
              val_metrics: Sequence[dict[str, Any]] | None = None, *,
              title: str = "Loss") -> Path:
    """Train ``loss`` vs ``step`` and validation ``val_loss`` on one figure. Validation points
    are taken from ``val_metrics`` when given, else from ``metrics`` itself (a mixed stream)."""
    fig, ax = _new_figure()
    xs, ys = _series(metrics, "loss", "step")
    if xs:
        _plot(ax, xs, ys, "train loss", linewidth=1.0)
    vx, vy = _series(metrics if val_metrics is None else val_metrics, "val_loss", "step")
    if vx:
        ax.plot(vx, vy, label="val loss", marker="o", markersize=5, linewidth=1.5)
    return _finish(fig, ax, out_png, title, "step", "loss", bool(xs or vx))
