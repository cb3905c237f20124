"""Per-layer error plot: SNR (dB) and cosine of every op output, in graph order, written as a PNG.

matplotlib is optional (`pip install 'netquant[plots]'`) and imported only when a plot is drawn.
Same errors in -> same PNG bytes out (Agg canvas, no timestamp / software metadata).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from netquant.analysis.layer_error import LayerError
from netquant.atomic import atomic_path
from netquant.errors import ConfigError, DataError

DEFAULT_LABELLED = 5
MAX_NAMED_TICKS = 60  # more ops than this: index ticks, only the worst ops are named
QUANT_COLOR, FLOAT_COLOR, WORST_COLOR, QUANT_BAND = "#1f77b4", "#9a9a9a", "#d62728", "#e8f0fa"


def require_matplotlib() -> ModuleType:
    """Import matplotlib or raise ConfigError telling how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting the per-layer report needs matplotlib: pip install 'netquant[plots]'") from None
    return matplotlib


def check_plot_target(path: str | os.PathLike[str]) -> Path:
    """Fail early (before any calibration) if `path` is not a .png or matplotlib is missing."""
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise ConfigError(f"the per-layer error plot is a PNG file; '{target}' should end in .png")
    require_matplotlib()
    return target


def plot_layer_errors(errors: Sequence[LayerError], path: str | os.PathLike[str], *, title: str | None = None,
                      top: int | None = None) -> Path:
    """Write a two-panel PNG (SNR dB, cosine) of `errors` in graph order; returns the path.

    Quantized op outputs are drawn in colour, float ones in grey; the `top` (default 5) op outputs
    with the lowest SNR / cosine are circled and named. Infinite SNR (exact output) sits on the top edge.
    """
    target = check_plot_target(path)
    if not errors:
        raise DataError(f"no per-layer errors to plot into '{target}' (the model has no float op outputs?)")
    n_label = DEFAULT_LABELLED if top is None else top
    if n_label < 0:
        raise ConfigError(f"top must be >= 0 (number of worst layers to name), got {top}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.style import context as style_context

    n = len(errors)
    n_quant = sum(e.quantized for e in errors)
    with style_context("default"):  # independent of the user's matplotlibrc
        fig = Figure(figsize=(min(22.0, max(8.0, 4.0 + 0.16 * n)), 7.0), dpi=110, layout="constrained")
        FigureCanvasAgg(fig)
        snr_ax, cos_ax = fig.subplots(2, 1, sharex=True)
        _panel(snr_ax, [e.snr_db for e in errors], errors, "SNR (dB)", n_label, lambda v: f"{v:.1f} dB")
        _panel(cos_ax, [e.cosine for e in errors], errors, "cosine similarity", n_label, lambda v: f"{v:.5f}")
        cos_ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        if n <= MAX_NAMED_TICKS:
            cos_ax.set_xticks(range(n), [e.op for e in errors], rotation=90, fontsize=7)
            for label, e in zip(cos_ax.get_xticklabels(), errors):
                label.set_color(QUANT_COLOR if e.quantized else "#555555")
        else:
            cos_ax.set_xlabel("op output index (graph order)")
        cos_ax.set_xlim(-0.8, n - 0.2)
        for ax in (snr_ax, cos_ax):
            for i, e in enumerate(errors):
                if e.quantized:
                    ax.axvspan(i - 0.5, i + 0.5, color=QUANT_BAND, linewidth=0, zorder=0)
        fig.legend(handles=_legend_handles(), loc="outside lower center", ncols=5, fontsize=8, frameon=False)
        fig.suptitle(title or f"per-layer quantization error: {n} op outputs, {n_quant} quantized")
        with atomic_path(target, "per-layer error plot") as tmp:
            fig.savefig(tmp, format="png", metadata={"Software": None})
    return target


def _panel(ax: Any, values: list[float], errors: Sequence[LayerError], ylabel: str, n_label: int,
           fmt: Any) -> None:
    """One metric against op index: grey line, coloured markers, worst points circled and named."""
    finite = [v for v in values if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    pad = (hi - lo) * 0.08 or max(abs(hi) * 0.01, 1e-6)
    top_edge, bottom_edge = hi + pad, lo - pad
    shown = [top_edge if v == math.inf else bottom_edge if v == -math.inf else v for v in values]
    xs = range(len(values))
    ax.plot(xs, shown, color="#cccccc", linewidth=1.0, zorder=1)
    for quantized, color in ((True, QUANT_COLOR), (False, FLOAT_COLOR)):
        for edge_value, marker in ((None, "o"), (math.inf, "^"), (-math.inf, "v")):
            idx = [i for i, e in enumerate(errors) if e.quantized == quantized
                   and (math.isfinite(values[i]) if edge_value is None else values[i] == edge_value)]
            ax.scatter(idx, [shown[i] for i in idx], s=26, marker=marker, color=color, zorder=2,
                       edgecolors="white" if quantized else color, linewidths=0.5)
    worst = sorted((i for i in xs if math.isfinite(values[i])), key=lambda i: (values[i], i))[:n_label]
    if worst:
        ax.scatter(worst, [values[i] for i in worst], s=110, facecolors="none", edgecolors=WORST_COLOR,
                   linewidths=1.3, zorder=3)
        for rank, i in enumerate(worst, 1):
            ax.annotate(str(rank), (i, values[i]), xytext=(5, -11), textcoords="offset points", fontsize=8,
                        color=WORST_COLOR, fontweight="bold", zorder=4)
        from matplotlib.lines import Line2D

        rows = [Line2D([], [], linestyle="none", label=f"{rank}  {_short(errors[i].op)} (#{i})  {fmt(values[i])}")
                for rank, i in enumerate(worst, 1)]
        ax.legend(handles=rows, title=f"lowest {ylabel.split(' ')[0]}", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=7, title_fontsize=8, handlelength=0, handletextpad=0, frameon=False,
                  labelcolor=WORST_COLOR, alignment="left")
    ax.set_ylim(bottom_edge - pad * 2.5, top_edge + pad)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", color="#e5e5e5", linewidth=0.7)
    ax.set_axisbelow(True)


def _short(name: str, limit: int = 36) -> str:
    """Long op names keep their start and end: 'backbone.stage...conv2'."""
    return name if len(name) <= limit else f"{name[:limit // 2 - 1]}...{name[-(limit // 2 - 2):]}"


def _legend_handles() -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def dot(color: str, marker: str, label: str, face: str | None = None) -> Any:
        return Line2D([], [], linestyle="none", marker=marker, color=color, markerfacecolor=face or color,
                      markersize=6, label=label)

    band = Patch(facecolor=QUANT_BAND, edgecolor="none", label="quantized column")
    return [dot(QUANT_COLOR, "o", "quantized op"), dot(FLOAT_COLOR, "o", "float op"), band,
            dot(FLOAT_COLOR, "^", "exact (SNR = inf)"), dot(WORST_COLOR, "o", "lowest values (numbered)", face="none")]
