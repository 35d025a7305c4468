"""``protofl compare``: final figures across run folders (mean ± std over seeds), the seed's
Table 4 (AMM and FFD per method, Pearson's ρ of final AMM and accuracy), and curves."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protofl.engine import runfolder
from protofl.errors import ProtoflError
from protofl.metrics.mmd import ffd
from protofl.nested import flatten
from protofl.report import outputs
from protofl.report.labels import COLUMNS, LEGEND, headers, mix_note, row_labels, setting_caption
from protofl.report.plots import plot_groups, plot_weights

log = logging.getLogger("protofl")

REFERENCE = "fedavg"  # FFD(A, B) compares every method A with B = this one
CENTRAL = "central"  # the centralized baseline (and usual FFD reference model)


def load_runs(folders: list[Path]) -> list[dict]:
    """Each finished run folder as ``{folder, summary, config, rows}`` (each counted once),
    once verified against its manifest (a changed or corrupted file is refused in one line);
    runs made by different protofl versions, written before manifests, or whose settings
    changed on resume are compared with a warning."""
    folders = outputs.unique_runs(folders)
    manifests = {f: runfolder.RunStore(f).verify() for f in folders}
    unchecked = [str(f) for f, m in manifests.items() if m is None]
    if unchecked:
        log.warning("%d run folder(s) have no %s (written by protofl 0.1), so their files are "
                    "read unchecked: %s", len(unchecked), runfolder.mf.MANIFEST,
                    ", ".join(unchecked[:3]) + (" ..." if len(unchecked) > 3 else ""))
    for f, m in manifests.items():
        for h in m["history"] if m else ():
            changed = {k: v for k, v in h["changed"].items() if k != "rounds"}
            if changed:
                log.warning("%s: settings changed when it was resumed after round %d: %s",
                            f, h["round"], runfolder.mf.said(changed))
    runs = [{"folder": f, "summary": load_summary(f), "config": runfolder.load_config_json(f),
             "rows": runfolder.read_metrics(f)} for f in folders]
    versions = sorted({str(r["summary"].get("provenance", {}).get("protofl", "unknown"))
                       for r in runs})
    if len(versions) > 1:
        log.warning("these runs were made by different protofl versions (%s): their numbers "
                    "may differ for that reason alone", ", ".join(versions))
    return runs


def load_summary(folder: Path) -> dict:
    """A finished run folder's ``summary.json`` (checked to name its algorithm and dataset)."""
    path = folder / runfolder.SUMMARY
    if not path.exists():
        raise ProtoflError(f"{folder} has no {runfolder.SUMMARY}: not a finished run folder")
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProtoflError(f"{path} is not valid JSON") from None
    if not isinstance(summary, dict) or not {"algorithm", "dataset"} <= summary.keys():
        raise ProtoflError(f"{path} is not a protofl run summary (no algorithm/dataset)")
    return summary


def dataset_label(run: dict) -> str:
    """The dataset with its partition, so IID and non-IID runs are never pooled."""
    data = run["config"].get("data", {})
    scheme = data.get("partition")
    if not scheme:
        return run["summary"]["dataset"]
    detail = {"dirichlet": f" α={data.get('alpha')}", "dirichlet_powerlaw":
              f" α={data.get('alpha')}", "classes": f" k={data.get('classes_per_client')}"}
    return f"{run['summary']['dataset']} ({scheme}{detail.get(scheme, '')})"


IN_DATASET_LABEL = {"algorithm", "task", "data.name", "data.partition", "data.alpha",
                    "data.classes_per_client"}


@dataclass
class Row:
    """One row of a table: the runs (one per seed) of one method."""
    label: str
    algorithm: str
    runs: list[dict] = field(default_factory=list)

    def values(self, key: str) -> np.ndarray:
        return np.array([r["summary"][key] for r in self.runs
                         if isinstance(r["summary"].get(key), (int, float))], dtype=float)


@dataclass
class Table:
    """The runs of one dataset and partition, with the words that describe them."""
    dataset: str
    caption: str
    rows: list[Row]
    baselines: dict[str, str]

    @property
    def runs(self) -> list[dict]:
        return [r for row in self.rows for r in row.runs]


def _clients(run: dict) -> int | None:
    n = run["config"].get("data", {}).get("num_clients")
    if n is None and run["rows"]:
        n = len(run["rows"][-1].get("client_accuracy") or {}) or None
    return n


def natural_key(text: str) -> list:
    """Sort key that orders the numbers inside ``text`` by value: ``seed2`` before
    ``seed10``, ``α=0.01`` before ``α=0.1``."""
    return [(0, float(s), "") if re.fullmatch(r"\d+(\.\d+)?", s) else (1, 0.0, s)
            for s in re.split(r"(\d+(?:\.\d+)?)", text) if s]


def make_tables(runs: list[dict]) -> list[Table]:
    """Runs grouped by dataset (a table each, in natural order of their labels) and,
    within, by label (a row each; rows in the natural order of their first run's folder, so
    ``compare``, a suite's table.md and ``report`` list the methods alike)."""
    by_ds: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: natural_key(str(r["folder"]))):
        by_ds.setdefault(dataset_label(r), []).append(r)
    tables = []
    for ds, every in sorted(by_ds.items(), key=lambda item: natural_key(item[0])):
        # the centralized baseline (one client, its own steps) is labelled and described
        # apart, so its settings neither label the federated rows nor blur the caption
        fed = [r for r in every if r["summary"]["algorithm"] != CENTRAL]
        central = [r for r in every if r["summary"]["algorithm"] == CENTRAL]
        rows: dict[str, Row] = {}
        baselines: dict[str, str] = {}
        for rs in (fed, central):
            algs = [r["summary"]["algorithm"] for r in rs]
            labels, base = row_labels(algs, [flatten(r["config"]) for r in rs],
                                      IN_DATASET_LABEL)
            baselines.update(base)
            for r, label, alg in zip(rs, labels, algs):
                rows.setdefault(label, Row(label, alg)).runs.append(r)
        described = fed or central
        caption = setting_caption([flatten(r["config"]) for r in described],
                                  [r["summary"] for r in described],
                                  [_clients(r) for r in described])
        caption += mix_note({row.label: [r["summary"] for r in row.runs]
                             for row in rows.values()})
        if fed and central:
            caption += ("; central: one client holding all the training data, as many SGD "
                        "steps per round as a federated round's expected")
        tables.append(Table(ds, caption, list(rows.values()), baselines))
    return tables


def mean_std(v: np.ndarray) -> dict | None:
    return {"mean": float(v.mean()), "std": float(v.std()), "n": len(v)} if len(v) else None


def fmt(stat: dict | None, key: str = "") -> str:
    """``mean ± std``, or the value alone when one run gave it (a std of 0 says nothing)."""
    if stat is None:
        return "–"
    f = ".1f" if key == "seconds" else ".4f"
    if stat.get("n") == 1:
        return f"{stat['mean']:{f}}"
    return f"{stat['mean']:{f}} ± {stat['std']:{f}}"


def caption_text(t: Table) -> str:
    text = t.caption + "."
    for alg, base in t.baselines.items():
        text += f" {alg} rows, unless the label says otherwise: {base}."
    return text


def table_data(t: Table) -> dict:
    """The numbers behind a table: ``label -> {algorithm, seeds, column: {mean, std}}``."""
    cols = [c for c in COLUMNS if any(len(row.values(c)) for row in t.rows)]
    names = headers(cols, segmentation(t))
    out = {}
    for row in t.rows:
        out[row.label] = {"algorithm": row.algorithm, "seeds": len(row.runs),
                          "folders": [str(r["folder"]) for r in row.runs],
                          **{c: mean_std(row.values(c)) for c in cols}}
    return {"caption": caption_text(t), "columns": cols, "headers": names, "rows": out,
            "table4": table4(t)}


def segmentation(t: Table) -> bool:
    """Whether a table's runs are segmentation runs (they log mIoU)."""
    return any("miou" in r["summary"] for r in t.runs)


def table_markdown(t: Table, data: dict) -> list[str]:
    cols = data["columns"]
    lines = [f"### {t.dataset}", "", f"*{caption_text(t)}*", "",
             "| method | seeds | " + " | ".join(data["headers"][c] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for label, d in data["rows"].items():
        lines.append(f"| {label} | {d['seeds']} | "
                     + " | ".join(fmt(d[c], c) for c in cols) + " |")
    return lines + [""]


def pearson(pairs: list[tuple[float, float]]) -> dict | None:
    """Pearson's ρ and its two-sided p-value, or None with fewer than 3 pairs or no spread."""
    from scipy.stats import pearsonr

    if len(pairs) < 3:
        return None
    a, b = np.array(pairs, dtype=float).T
    if a.std() == 0 or b.std() == 0:
        return None
    rho, p = pearsonr(a, b)
    return {"rho": float(rho), "p": float(p), "runs": len(pairs)}


def table4(t: Table) -> dict:
    """The seed's Table 4 for one table: final AMM per method, FFD against fedavg from the
    final client-averaged MMD² (``mmd``; mean over seeds), and Pearson's ρ of final AMM and
    accuracy (segmentation: mIoU) over the table's federated runs (not the centralized
    baseline)."""
    amm = {row.label: mean_std(row.values("amm")) for row in t.rows}
    mmd = {row.label: mean_std(row.values("mmd")) for row in t.rows}
    ref = [row.label for row in t.rows if row.algorithm == REFERENCE]
    ref = ref if len(ref) == 1 else []  # several fedavg rows: no single reference
    ffds: dict[str, float | None] = {}
    for row in t.rows:
        if ref and mmd[row.label] and mmd[ref[0]]:
            ffds[row.label] = ffd(mmd[row.label]["mean"], mmd[ref[0]]["mean"])
        else:
            ffds[row.label] = None
    score = "miou" if segmentation(t) else "accuracy"
    pairs = [(r["summary"]["amm"], r["summary"][score]) for r in t.runs
             if r["summary"]["algorithm"] != CENTRAL  # across federated methods only
             and isinstance(r["summary"].get("amm"), (int, float))
             and isinstance(r["summary"].get(score), (int, float))]
    return {"amm": amm, "mmd": mmd, "ffd": ffds, "reference": ref[0] if ref else None,
            "pearson": pearson(pairs), "pairs": len(pairs), "score": COLUMNS[score]}


def ffd_cell(t4: dict, label: str) -> str:
    if label == t4["reference"] and t4["mmd"].get(label):
        return "0 (reference)"
    v = t4["ffd"].get(label)
    if v is None or not np.isfinite(v):
        return "not measured" if not t4["mmd"].get(label) else "–"
    return f"{v:+.1f}"


def pearson_text(t4: dict) -> str:
    p, score = t4["pearson"], t4.get("score", "accuracy")
    if p is None:
        return (f"Pearson rho(final AMM, {score}): not computable ({t4['pairs']} runs with "
                "both; needs 3 with some spread)")
    return (f"Pearson rho(final AMM, {score}) = {p['rho']:.2f} (p = {p['p']:.2g}, "
            f"{p['runs']} runs)")


def table4_markdown(t: Table, t4: dict) -> list[str]:
    if not any(t4["amm"].values()) and not any(t4["mmd"].values()):
        return []
    labels = [row.label for row in t.rows]
    ref = t4["reference"] or REFERENCE
    head = ["| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels),
            "| AMM | " + " | ".join(fmt(t4["amm"][label]) for label in labels) + " |"]
    if not any(t4["mmd"].values()):  # no run logged mmd: AMM alone
        return [f"**Table 4, {t.dataset}**: final AMM per method (FFD not measured: no run "
                "logged `mmd`; see `metrics.ffd_reference`)", "", *head, "",
                pearson_text(t4), ""]
    return [f"**Table 4, {t.dataset}**: final AMM per method (top) and FFD against "
            f"{ref} (bottom, % = 100 (MMD_{ref} − MMD_method) / MMD_{ref}, MMD² to a "
            "centrally trained model's features, averaged over clients and seeds)", "", *head,
            "| FFD vs " + ref + " (%) | " + " | ".join(ffd_cell(t4, label) for label in labels)
            + " |", "", pearson_text(t4), ""]


def report_markdown(tables: list[Table]) -> tuple[str, dict]:
    """Every table with its Table 4 as Markdown, and the numbers behind them."""
    lines, data = [], {}
    for t in tables:
        d = data[t.dataset] = table_data(t)
        lines += table_markdown(t, d) + table4_markdown(t, d["table4"])
    lines += [f"Columns: {LEGEND}", ""]
    return "\n".join(lines), data


def _safe(ds: str) -> str:
    return "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in ds).strip("_")


def compare(folders: list[Path], out: Path | None = None, *, overwrite: bool = False) -> str:
    """The tables as Markdown; with ``out``, also write it there, the numbers to ``out``.json
    and one curves PNG (and a weights PNG, when logged) per dataset next to it. Nothing is
    written inside a run folder, nor over an existing file unless ``overwrite``."""
    runs = load_runs(folders)
    if not runs:
        raise ProtoflError("compare needs at least one run folder")
    tables = make_tables(runs)
    text, data = report_markdown(tables)
    if out is None:
        return text
    out = Path(out)
    if out.suffix == ".json":
        raise ProtoflError(f"--out {out}: name the Markdown table (e.g. table.md); the numbers "
                           "go to the .json beside it")
    pngs = {}
    for t in tables:
        groups = {row.label: [r["rows"] for r in row.runs] for row in t.rows}
        pngs[out.with_name(f"{out.stem}_{_safe(t.dataset)}.png")] = (plot_groups, groups, t)
        if any(r.get("weights") and r.get("fedavg_weights")
               for rows in groups.values() for run in rows for r in run):
            pngs[out.with_name(f"{out.stem}_{_safe(t.dataset)}_weights.png")] = (
                plot_weights, groups, t)
    outputs.check_targets([out, out.with_suffix(".json"), *pngs],
                          [r["folder"] for r in runs], overwrite)
    if out.with_suffix(".json").name in runfolder.ARTEFACTS:
        raise ProtoflError(f"--out {out}: its numbers would go to {out.with_suffix('.json')}, "
                           "the name of a run folder's file (its folder would look like a "
                           "run); name the table otherwise, e.g. table.md")
    outputs.writable(out)
    outputs.write_text(out, text + "\n")
    outputs.write_json(out.with_suffix(".json"), data)
    for path, (plot, groups, t) in pngs.items():
        plot(groups, path, t.dataset)
    return text
