"""Figures drawn without pyplot, so protofl never sets matplotlib's backend or global state
(a notebook keeps its own)."""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure


def subplots(*args: Any, figsize: tuple[float, float] | None = None, layout: str | None = None,
             **kwargs: Any) -> tuple[Figure, Any]:
    """A new Figure and its axes (``Figure.subplots`` arguments), as ``pyplot.subplots``."""
    fig = Figure(figsize=figsize, layout=layout)
    return fig, fig.subplots(*args, **kwargs)


COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")


def color(i: int) -> str:
    """Series ``i``'s colour, the same in every panel and page."""
    return COLORS[i % len(COLORS)]


def dash(i: int) -> str:
    """Series past the palette's ten colours repeat them dashed."""
    return "-" if i < len(COLORS) else "--"
