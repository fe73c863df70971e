"""Matplotlib figures shared by ``lrstab`` and the scripts.

Drawn on :class:`matplotlib.figure.Figure` objects, never through pyplot, so importing this module
neither picks nor changes the process's matplotlib backend (a notebook's or a GUI's stays) and
works on a node without a display: a PNG is written by the Agg canvas whatever the backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure


@dataclass
class Curve:
    """One run's series in a figure.

    Args:
        label: the legend entry.
        series: values indexed by step.
        surge_step: drawn as a dashed vertical line (None: not drawn).
        decay_steps: steps where the LR is decayed, drawn as dotted vertical lines.
    """

    label: str
    series: pd.Series
    surge_step: int | None = None
    decay_steps: Sequence[int] = field(default_factory=list)
    abandoned: Sequence[pd.Series] = field(default_factory=list)  # lrstab guard: segments rolled back (grey)
    rollback_steps: Sequence[int] = field(default_factory=list)  # lrstab guard: the checkpoints resumed from


def _marks(ax, curve: Curve, color, scale: float = 1.0) -> None:
    for seg in curve.abandoned:
        ax.plot(seg.index, seg.values / scale, "-", color="0.6", lw=1, alpha=0.8)
    for s in curve.rollback_steps:
        ax.axvline(s, color=color, ls="-", lw=1.5, alpha=0.5)
        ax.plot([s], [0], marker="v", color=color, transform=ax.get_xaxis_transform(), clip_on=False)
    if curve.surge_step is not None:
        ax.axvline(curve.surge_step, color=color, ls="--", lw=1, alpha=0.8)
    for s in curve.decay_steps:
        ax.axvline(s, color=color, ls=":", lw=1, alpha=0.8)


def _finite(curves: Sequence[Curve]) -> pd.Series:
    values = pd.to_numeric(pd.concat([c.series for c in curves]), errors="coerce") if curves else pd.Series(dtype=float)
    return values[np.isfinite(values)]


def _overflows(curves: Sequence[Curve]) -> bool:
    """Whether the curves' span is near the float limit (a linear axis's ticks would overflow)."""
    values = _finite(curves)
    if values.empty:
        return False
    lo, hi = float(values.min()), float(values.max())
    return not np.isfinite((hi - lo) * 4 + max(abs(lo), abs(hi)) * 4)


def plot_curves(curves: Sequence[Curve], title: str, ylabel: str, path: str | Path, logy: bool = False) -> Path:
    """One figure, one line per run, surge (dashed) and decay (dotted) steps marked.

    Args:
        curves: the runs' series.
        title: the figure title.
        ylabel: the y axis label (the metric name as logged).
        path: where to save the PNG.
        logy: log-scale y axis (KL, grad norm).

    Returns:
        The path written.
    """
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    positive = all((c.series > 0).all() for c in curves)
    # a span near the float limit: matplotlib's margins and ticks would pass it (inf); a log axis
    # (positive values) or values drawn in units of a power of ten stay finite
    scale = 1.0
    if _overflows(curves) and not positive:
        scale = 10.0 ** math.floor(math.log10(float(_finite(curves).abs().max())))
        ylabel = f"{ylabel} (x {scale:g})"
    for i, c in enumerate(curves):
        color = f"C{i % 10}"
        style = "o-" if len(c.series) < 30 else "-"  # sparse logs: show the points
        ax.plot(c.series.index, c.series.values / scale, style, color=color, lw=1.2, ms=3, label=c.label)
        _marks(ax, c, color, scale)
    if (logy or _overflows(curves)) and positive:
        ax.set_yscale("log")
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.plot([], [], "k--", lw=1, label="surge")
    ax.plot([], [], "k:", lw=1, label="LR decay")
    if any(c.rollback_steps for c in curves):
        ax.plot([], [], "-", color="0.6", lw=1, label="abandoned (rolled back)")
        ax.plot([], [], "kv-", lw=1.5, alpha=0.5, label="rollback to checkpoint")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_replay(values: pd.Series, steps: Sequence[int], lr_scale: Sequence[float], baseline: Sequence[float],
                surge_step: int | None, metric: str, path: str | Path, title: str = "") -> Path:
    """The replayed run: the length metric with the detector's baseline, and the LR scale below.

    Args:
        values: the length metric indexed by step.
        steps, lr_scale, baseline: from :func:`verl_lrstab.log_replay.replay`.
        surge_step: the detector's firing step, or None.
        metric: the metric name, for the axis label.
        path: where to save the PNG.
        title: the figure title.

    Returns:
        The path written.
    """
    fig = Figure(figsize=(8, 6))
    ax, ax_lr = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    style = "o-" if len(values) < 30 else "-"
    ax.plot(values.index, values.values, style, lw=1.2, ms=3, label=metric)
    ax.plot(steps, baseline, color="gray", lw=1, label="detector baseline")
    decays = [s for s, a, b in zip(steps[1:], lr_scale, lr_scale[1:]) if b < a]
    for a in (ax, ax_lr):
        _marks(a, Curve("", values, surge_step, decays), "C3")
    ax.set(title=title, ylabel=metric)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax_lr.step(steps, lr_scale, where="post", color="C2")
    ax_lr.set(xlabel="step", ylabel="LR / initial LR", ylim=(0, 1.05))
    ax_lr.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path) -> Path:
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def plot_survival(curves, title: str, xlabel: str, ylabel: str, path: str | Path) -> Path:
    """Survival functions on log-log axes, one line per entry.

    Args:
        curves: ``(label, [(x, share), ...])`` each (shares > 0: a log axis).
        title, xlabel, ylabel: the figure's texts.
        path: where to save the PNG.

    Returns:
        The path written.
    """
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for label, points in curves:
        xs, ys = zip(*points)
        ax.plot(xs, ys, "o-", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def __getattr__(name: str):
    """``plots.plt``: pyplot, imported on first use (the repro scripts draw with it), backend untouched."""
    if name == "plt":
        import matplotlib.pyplot as plt

        return plt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
