"""``protofl compare``: final figures across run folders (mean ± std over seeds) and curves."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from protofl.engine import runfolder
from protofl.errors import ProtoflError
from protofl.nested import flatten
from protofl.report.plots import plot_groups, plot_weights

COLUMNS = ("accuracy", "balanced_accuracy", "f1_weighted", "local_accuracy", "train_loss",
           "dissimilarity", "amm", "seconds")


def load_runs(folders: list[Path]) -> list[dict]:
    runs = []
    for f in folders:
        f = Path(f)
        path = f / runfolder.SUMMARY
        if not path.exists():
            raise ProtoflError(f"{f} has no {runfolder.SUMMARY}: not a finished run folder")
        try:
            summary = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ProtoflError(f"{path} is not valid JSON") from None
        cfg = runfolder.load_config_json(f)
        runs.append({"folder": f, "summary": summary, "config": cfg,
                     "rows": runfolder.read_metrics(f)})
    return runs


IN_DATASET_LABEL = {"seed", "algorithm", "data.partition", "data.alpha",
                    "data.classes_per_client"}


def labels(runs: list[dict]) -> list[str]:
    """Runs that differ only in seed share a label: the algorithm, plus every config key whose
    value varies among the runs of that algorithm (e.g. ``algo.weights``,
    ``clients.tolerate_partial``)."""
    flats = [flatten(r["config"]) for r in runs]
    names = [r["summary"]["algorithm"] for r in runs]
    out = []
    for name, f in zip(names, flats):
        same = [g for n, g in zip(names, flats) if n == name]
        keys = sorted({k for g in same for k in g} - IN_DATASET_LABEL)
        varying = [k for k in keys if len({repr(g.get(k)) for g in same}) > 1]
        extra = ",".join(f"{k.removeprefix('algo.')}={f[k]}" for k in varying
                         if f.get(k) is not None)
        out.append(name + (f"[{extra}]" if extra else ""))
    return out


def grouped(runs: list[dict], what: str) -> dict[str, dict[str, list]]:
    """``dataset -> label -> [run[what] ...]``."""
    by_ds: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_ds[dataset_label(r)].append(r)
    out: dict[str, dict[str, list]] = {}
    for ds, rs in by_ds.items():
        out[ds] = defaultdict(list)
        for r, name in zip(rs, labels(rs)):
            out[ds][name].append(r[what])
    return out


def dataset_label(run: dict) -> str:
    """The dataset with its partition, so IID and non-IID runs are never pooled."""
    data = run["config"].get("data", {})
    scheme = data.get("partition")
    if not scheme:
        return run["summary"]["dataset"]
    detail = {"dirichlet": f" α={data.get('alpha')}", "dirichlet_powerlaw":
              f" α={data.get('alpha')}", "classes": f" k={data.get('classes_per_client')}"}
    return f"{run['summary']['dataset']} ({scheme}{detail.get(scheme, '')})"


def table(runs: list[dict]) -> tuple[str, dict]:
    """A Markdown table per dataset (rows: algorithms) and the numbers behind it."""
    lines, data = [], {}
    for ds, algs in grouped(runs, "summary").items():
        cols = [c for c in COLUMNS if any(s.get(c) is not None for v in algs.values() for s in v)]
        lines += [f"### {ds}", "", "| algorithm | seeds | " + " | ".join(cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        data[ds] = {}
        for alg, sums in algs.items():
            cells, stats = [], {}
            for c in cols:
                vals = np.array([s[c] for s in sums if s.get(c) is not None], dtype=float)
                if len(vals):
                    stats[c] = {"mean": float(vals.mean()), "std": float(vals.std())}
                    fmt = ".1f" if c == "seconds" else ".4f"
                    cells.append(f"{vals.mean():{fmt}} ± {vals.std():{fmt}}")
                else:
                    cells.append("–")
            data[ds][alg] = {"seeds": len(sums), **stats}
            lines.append(f"| {alg} | {len(sums)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines), data


def amm_correlation(runs: list[dict]) -> str:
    """Pearson's rho between final AMM and accuracy across runs, per dataset (the seed's
    Table 4 claim), when at least three runs have both."""
    from scipy.stats import pearsonr

    by_ds: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in runs:
        s = r["summary"]
        if s.get("amm") is not None and s.get("accuracy") is not None:
            by_ds[dataset_label(r)].append((s["amm"], s["accuracy"]))
    lines = []
    for ds, pairs in by_ds.items():
        a, b = np.array(pairs).T
        if len(pairs) >= 3 and a.std() > 0 and b.std() > 0:
            rho, p = pearsonr(a, b)
            lines.append(f"{ds}: Pearson rho(final AMM, accuracy) = {rho:.2f} "
                         f"(p = {p:.2g}, {len(pairs)} runs)")
    return "\n".join(lines) + ("\n" if lines else "")


def compare(folders: list[Path], out: Path | None = None) -> str:
    """Write ``out`` (Markdown table), ``out``.json and one curves PNG per dataset."""
    runs = load_runs(folders)
    if not runs:
        raise ProtoflError("compare needs at least one run folder")
    text, data = table(runs)
    text += amm_correlation(runs)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        runfolder.write_json(out.with_suffix(".json"), data)
        for ds, groups in grouped(runs, "rows").items():
            safe = "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in ds).strip("_")
            plot_groups(groups, out.with_name(f"{out.stem}_{safe}.png"), ds)
            plot_weights(groups, out.with_name(f"{out.stem}_{safe}_weights.png"), ds)
    return text
