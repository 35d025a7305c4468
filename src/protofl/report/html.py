"""``protofl report``: one self-contained HTML page (inline SVG figures, a small inline
script, nothing fetched) from run folders."""

from __future__ import annotations

import base64
import json
from html import escape
from pathlib import Path

import numpy as np

from protofl.report import assets, figures, outputs
from protofl.report.compare import (
    LEGEND,
    REFERENCE,
    Table,
    caption_text,
    ffd_cell,
    fmt,
    pearson_text,
    segmentation,
    table_data,
)
from protofl.report.plots import confusion_inches
from protofl.report.sections import Section

CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "img-src data:")


class Page:
    """Collects the HTML of one report; ``uid`` numbers figures and blocks."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.n = 0

    def uid(self, kind: str) -> str:
        self.n += 1
        return f"{kind}{self.n}"

    def add(self, *html: str) -> None:
        self.parts.extend(html)


def _swatch(i: int) -> str:
    return f'<span class="swatch" style="background:{figures.color(i)}"></span>'


def _png(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img class="png" alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def comparison_table(t: Table, data: dict) -> str:
    cols = data["columns"]
    head = "".join(f"<th>{escape(data['headers'][c])}</th>" for c in cols)
    body = []
    for i, (label, d) in enumerate(data["rows"].items()):
        cells = "".join(f"<td>{escape(fmt(d[c], c))}</td>" for c in cols)
        body.append(f"<tr><td>{_swatch(i)}{escape(label)}</td><td>{d['seeds']}</td>{cells}</tr>")
    return ('<div class="scroll"><table class="cmp"><thead><tr><th>method</th><th>seeds</th>'
            f"{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table></div>")


def table4_html(t: Table, t4: dict) -> str:
    labels = [row.label for row in t.rows]
    ref = t4["reference"] or REFERENCE
    head = "".join(f"<th>{escape(label)}</th>" for label in labels)
    amm = "".join(f"<td>{escape(fmt(t4['amm'][label]))}</td>" for label in labels)
    ffd = "".join(f"<td>{escape(ffd_cell(t4, label))}</td>" for label in labels)
    return (f'<table class="t4"><thead><tr><th></th>{head}</tr></thead><tbody>'
            f"<tr><td>AMM (final)</td>{amm}</tr><tr><td>FFD vs {escape(ref)} (%)</td>{ffd}"
            f"</tr></tbody></table><p>{escape(pearson_text(t4))}</p>"
            f'<p class="muted">FFD(A, {escape(ref)}) = 100 (MMD_{escape(ref)} − MMD_A) / '
            f"MMD_{escape(ref)}, with MMD² between each client model's features and a "
            "centrally trained model's on a fixed probe set, averaged over clients and seeds "
            "(logged per round as <code>mmd</code>).</p>")


def curves(page: Page, t: Table) -> str:
    rows_of = {row.label: [r["rows"] for r in row.runs] for row in t.rows}
    index = {row.label: i for i, row in enumerate(t.rows)}
    keys, constant = figures.numeric_metrics([rows for runs in rows_of.values() for rows in runs])
    out = []
    for key in keys:
        series = {}
        for label, runs in rows_of.items():
            b = figures.band(runs, key)
            if b is not None:
                series[index[label]] = (label, b)
        out.append(_curve(page, series, figures.NAMES.get(key, key), key == "dissimilarity"))
    html = f'<div class="grid">{"".join(out)}</div>'
    if constant:
        same = ", ".join(f"{figures.NAMES.get(k, k)} = {v:g}" for k, v in constant.items())
        html += f'<p class="note">The same in every run and round: {escape(same)}.</p>'
    return html


def _curve(page: Page, series: dict, title: str, log: bool = False,
           legend: bool = False) -> str:
    fid = page.uid("f")
    svg, meta = figures.curve_svg(series, title, fid, log, legend)
    colors = "".join(f' data-color-{i}="{figures.color(i)}"' for i in series)
    return (f'<figure class="curve" id="{fid}" data-meta="{escape(json.dumps(meta))}"'
            f"{colors}>{svg}</figure>")


def ffd_curve(page: Page, t: Table) -> str:
    """FFD against fedavg per round, or why it is not there."""
    rows_of = {row.label: [r["rows"] for r in row.runs] for row in t.rows}
    index = {row.label: i for i, row in enumerate(t.rows)}
    notes = []
    if not any(figures.band(runs, "amm") for runs in rows_of.values()):
        notes.append("AMM: not measured (no run logged <code>amm</code>).")
    refs = [row.label for row in t.rows if row.algorithm == REFERENCE]
    bands = figures.ffd_band(rows_of, refs[0]) if len(refs) == 1 else {}
    if not bands:
        why = ("no run logged <code>mmd</code>" if not any(
            figures.band(runs, "mmd") for runs in rows_of.values())
               else f"needs exactly one {REFERENCE} row with <code>mmd</code>")
        notes.append(f"FFD: not measured ({why}).")
    html = "".join(f'<p class="note">{n}</p>' for n in notes)
    if bands:
        html += _curve(page, {index[k]: (k, b) for k, b in bands.items()},
                       f"FFD vs {REFERENCE} (%)", legend=True)
    return html


def weights(page: Page, t: Table) -> str:
    groups = {row.label: [r["rows"] for r in row.runs] for row in t.rows}
    svg = figures.weights_svg(groups, t.dataset, page.uid("f"))
    if svg is None:
        return ('<p class="note">Not logged: no run wrote <code>weights</code> and '
                "<code>fedavg_weights</code>.</p>")
    return (f'<figure class="wide">{svg}<figcaption class="muted">Aggregation weights a[k] '
            "× K' (1 = uniform) over all client-rounds, against FedAvg's n_k / Σ n "
            "(the seed's Fig. S2).</figcaption></figure>")


def partition(t: Table) -> str:
    for r in t.runs:
        path = r["folder"] / "stats.json"
        if path.exists():
            try:
                s = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            cells = []
            for k, v in s.items():
                if isinstance(v, dict):
                    v = ", ".join(f"{a}: {b:g}" if isinstance(b, float) else f"{a}: {b}"
                                  for a, b in v.items())
                cells.append(f"<tr><td>{escape(str(k).replace('_', ' '))}</td>"
                             f"<td>{escape(str(v))}</td></tr>")
            png = r["folder"] / "stats.png"
            img = _png(png, "partition statistics") if png.exists() else ""
            return (f'<p class="muted">From {escape(str(path))}.</p><table>'
                    f"{''.join(cells)}</table>{img}")
    return ('<p class="note">Not recorded: no run folder here holds a <code>stats.json</code> '
            "(runs write one when they start; for older runs, <code>protofl stats ... --out "
            "DIR</code> writes one).</p>")


def confusion(page: Page, t: Table) -> str:
    parts = []
    for i, row in enumerate(t.rows):
        seg = [r["folder"] / "segmentation.png" for r in row.runs
               if (r["folder"] / "segmentation.png").exists()]
        if seg:
            parts.append(f'<figure>{_png(seg[0], row.label)}<figcaption>{_swatch(i)}'
                         f"{escape(row.label)} ({escape(str(seg[0].parent))})"
                         "</figcaption></figure>")
            continue
        ms = [np.asarray(r["summary"]["confusion"]) for r in row.runs
              if r["summary"].get("confusion")]
        ms = [m for m in ms if m.ndim == 2 and m.shape == ms[0].shape]
        if ms:
            svg = figures.confusion_svg(sum(ms), f"{row.label} ({len(ms)} seeds)",
                                        page.uid("f"))
            width = round(confusion_inches(len(ms[0])) * 72)  # 1 pt = 1 px: text as set
            parts.append(f'<figure class="cm" style="width:{width}px">{svg}</figure>')
    if not parts:
        return '<p class="note">Not recorded: no confusion matrix or segmentation figure.</p>'
    return ('<p class="muted">Final round, counts summed over seeds, colours normalised per '
            f'true class.</p><div class="grid">{"".join(parts)}</div>')


def configs(t: Table) -> str:
    out = []
    for row in t.rows:
        for r in row.runs:
            s = r["summary"]
            title = (f"{row.label}, seed {s.get('seed')}: {r['folder']} "
                     f"(accuracy {s['accuracy']:.4f})" if isinstance(s.get("accuracy"), float)
                     else f"{row.label}, seed {s.get('seed')}: {r['folder']}")
            out.append(f"<details><summary>{escape(title)}</summary><pre>"
                       f"{escape(json.dumps(r['config'], indent=2), quote=False)}</pre></details>")
    return "".join(out)


def table_block(page: Page, t: Table) -> None:
    bid = page.uid("b")
    data = table_data(t)
    toggles = "".join(f'<label><input type="checkbox" class="toggle" data-series="{i}" '
                      f"checked>{_swatch(i)}{escape(row.label)}</label>"
                      for i, row in enumerate(t.rows))
    page.add(f'<section class="block" id="{bid}"><h3>{escape(t.dataset)}</h3>',
             f'<p class="caption">{escape(caption_text(t))}</p>',
             comparison_table(t, data),
             f'<div class="toggles">Methods shown in the curves: {toggles}</div>',
             "<h4>AMM and FFD (the seed's Table 4)</h4>", table4_html(t, data["table4"]),
             ffd_curve(page, t),
             "<h4>Per-round curves (mean ± std over seeds; hover for values)</h4>",
             curves(page, t),
             "<h4>Aggregation weights against FedAvg's</h4>", weights(page, t),
             "<h4>Partition statistics</h4>", partition(t),
             f"<h4>{'Segmentation' if segmentation(t) else 'Confusion matrices'}</h4>",
             confusion(page, t),
             "<h4>Runs and their resolved configs</h4>", configs(t), "</section>")


def build_html(secs: list[Section], title: str = "protofl report") -> str:
    """The whole page as one string."""
    page = Page()
    n = sum(len(s.runs) for s in secs)
    toc = "".join(f"<li>{escape(s.name)}: " + ", ".join(escape(t.dataset) for t in s.tables)
                  + "</li>" for s in secs)
    page.add(f"<header><h1>{escape(title)}</h1><p class='muted'>{n} runs. Made by "
             "<code>protofl report</code>: everything is in this one file and nothing is "
             f"fetched.</p><ul>{toc}</ul></header>")
    for s in secs:
        page.add(f"<h2>{escape(s.name)}</h2>")
        for t in s.tables:
            table_block(page, t)
    page.add(f'<p class="muted">Columns: {escape(LEGEND)}</p>')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{assets.CSS}</style>"
            f"<script>{assets.ERRORS}</script></head><body>"
            '<pre id="errors" hidden></pre><div id="tip" hidden></div>'
            + "\n".join(page.parts) + f"<script>{assets.SCRIPT}</script></body></html>\n")


def write_html(secs: list[Section], out: Path, overwrite: bool = False,
               title: str = "protofl report") -> Path:
    """Write the page to ``out`` (never inside a run folder, never over a file without
    ``overwrite``)."""
    out = Path(out)
    outputs.check_targets([out], [r["folder"] for s in secs for r in s.runs], overwrite)
    outputs.writable(out)
    outputs.write_text(out, build_html(secs, title))
    return out
