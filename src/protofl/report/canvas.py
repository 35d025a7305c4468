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
