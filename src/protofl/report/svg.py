"""Matplotlib figures as inline SVG for one HTML page: text kept as text, ids made unique per
figure, and artists given a ``gid`` of the form ``series-<i>-<part>`` tagged with the class
``series-<i>`` so a script can show, hide or read them."""

from __future__ import annotations

import io
import re

import matplotlib

RC = {"svg.fonttype": "none", "svg.hashsalt": "protofl", "figure.dpi": 72,
      "font.family": "sans-serif", "font.size": 9}

_ID = re.compile(r'\bid="([^"]+)"')
_REF = re.compile(r'(url\(#|href="#)([^)"]+)')
_SERIES = re.compile(r'<g id="([^"]*series-(\d+)-[^"]*)"')


def style():
    """Context in which to build a report figure (72 dpi: SVG units are points)."""
    return matplotlib.rc_context(RC)


def axes_box(fig, ax) -> list[float]:
    """``[x0, y0, x1, y1]`` of ``ax`` in the SVG's user units (points, y down); call after
    the figure is drawn."""
    b = ax.get_window_extent()
    scale = 72.0 / fig.dpi
    h = fig.bbox.height
    return [round(b.x0 * scale, 2), round((h - b.y1) * scale, 2), round(b.x1 * scale, 2),
            round((h - b.y0) * scale, 2)]


def to_svg(fig, prefix: str) -> str:
    """The figure as an ``<svg>`` element (no XML header) with every id prefixed by
    ``prefix``; afterwards its layout is final and ``axes_box`` can be read."""
    buf = io.StringIO()
    with matplotlib.rc_context(RC):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = _ID.sub(lambda m: f'id="{prefix}-{m.group(1)}"', text)
    text = _REF.sub(lambda m: f"{m.group(1)}{prefix}-{m.group(2)}", text)
    return _SERIES.sub(lambda m: f'<g id="{m.group(1)}" class="series-{m.group(2)}"', text)
