"""``protofl report ... --markdown FILE``: the tables and curve PNGs as Markdown, e.g. to
regenerate ``docs/results.md`` from fresh suite folders.

Each section is written between two marker comments. When FILE exists (``overwrite``
needed), only the text between a section's markers is replaced, so prose around them (a
heading, the command that made the runs, a comment on the numbers) survives; a section
without markers is appended."""

from __future__ import annotations

import os
import re
from pathlib import Path

from protofl.errors import ProtoflError
from protofl.report import outputs
from protofl.report.compare import LEGEND, table4_markdown, table_data, table_markdown
from protofl.report.plots import plot_groups, plot_weights
from protofl.report.sections import Section


def begin(name: str) -> str:
    return f"<!-- protofl report {name}: begin (generated; edit outside these markers) -->"


def end(name: str) -> str:
    return f"<!-- protofl report {name}: end -->"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_") or "runs"


def plan_figures(secs: list[Section], fig_dir: Path) -> dict[Path, tuple]:
    """``path -> (plot function, groups, dataset, section)`` for every PNG needed."""
    out: dict[Path, tuple] = {}
    stems = [_safe(Path(s.name).name) for s in secs]
    for k, (s, stem) in enumerate(zip(secs, stems)):
        if stems.count(stem) > 1:
            stem = f"{stem}{k + 1}"
        for t in s.tables:
            groups = {row.label: [r["rows"] for r in row.runs] for row in t.rows}
            base = fig_dir / f"{stem}_{_safe(t.dataset)}"
            out[base.with_suffix(".png")] = (plot_groups, groups, t.dataset, s.name)
            if any(r.get("weights") and r.get("fedavg_weights")
                   for runs in groups.values() for rows in runs for r in rows):
                out[Path(f"{base}_weights.png")] = (plot_weights, groups, t.dataset, s.name)
    return out


def section_markdown(section: Section, figs: dict[Path, tuple], md: Path, legend: bool = False
                     ) -> str:
    """A section's generated block (with the column legend when ``legend``)."""
    lines = [begin(section.name), ""]
    for t in section.tables:
        d = table_data(t)
        lines += table_markdown(t, d) + table4_markdown(t, d["table4"])
        for path, (_, _, title, sec) in figs.items():
            if title == t.dataset and sec == section.name:
                rel = Path(os.path.relpath(path, md.parent)).as_posix()
                what = "aggregation weights" if path.stem.endswith("_weights") else "curves"
                lines += [f"![{section.name}, {t.dataset}: {what}]({rel})", ""]
    if legend:
        lines += [f"Columns: {LEGEND}", ""]
    return "\n".join(lines + [end(section.name)])


def merge_sections(old: str, blocks: dict[str, str]) -> str:
    """``old`` with each marked section replaced by its new block; new ones appended."""
    text = old
    for name, block in blocks.items():
        b, e = begin(name), end(name)
        if b in text and e in text and text.index(b) < text.index(e):
            text = text[:text.index(b)] + block + text[text.index(e) + len(e):]
        else:
            text = text.rstrip("\n") + f"\n\n## {name}\n\n{block}\n"
    return text


def write_markdown(secs: list[Section], md: Path, fig_dir: Path | None = None,
                   overwrite: bool = False) -> list[Path]:
    """Write (or update the generated sections of) ``md`` and its PNGs in ``fig_dir``
    (default: ``img/`` beside it); returns the files written."""
    md = Path(md)
    fig_dir = Path(fig_dir) if fig_dir is not None else md.parent / "img"
    figs = plan_figures(secs, fig_dir)
    outputs.check_targets([md, *figs], [r["folder"] for s in secs for r in s.runs], overwrite)
    outputs.writable(md)
    outputs.writable(fig_dir / "x.png")
    blocks = {s.name: section_markdown(s, figs, md, legend=k == 0) for k, s in enumerate(secs)}
    if md.exists():
        try:
            old = md.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ProtoflError(f"cannot read {md}: {e}") from None
    else:
        old = ("# Results\n\nMade by `protofl report RUN_DIR... --markdown FILE` from the run "
               "folders; the text between the report's markers is regenerated on every run, "
               "the rest is kept.\n")
    outputs.write_text(md, merge_sections(old, blocks))
    for path, (plot, groups, title, _) in figs.items():
        plot(groups, path, title)
    return [md, *figs]
