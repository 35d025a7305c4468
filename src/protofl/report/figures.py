"""The HTML report's figures as inline SVG: per-round curves (mean ± std over seeds) with the
numbers a script needs for hover values, FFD curves, Fig. S2 and confusion matrices."""

from __future__ import annotations

import numpy as np
from matplotlib.ticker import MaxNLocator

from protofl.metrics.mmd import ffd
from protofl.report import svg
from protofl.report.canvas import color, dash, subplots
from protofl.report.plots import confusion_figure, weights_figure

NAMES = {"accuracy": "test accuracy", "balanced_accuracy": "balanced accuracy",
         "loss": "test loss", "train_loss": "training loss", "client_loss":
         "clients' local training loss", "local_accuracy": "local accuracy (mean over clients)",
         "dissimilarity": "gradient dissimilarity", "amm": "AMM (aggregate mean margin)",
         "mmd": "MMD² to the central model (mean over clients)", "ffd": "FFD vs fedavg (%)",
         "f1_weighted": "weighted F1", "f1_macro": "macro F1", "precision_weighted":
         "weighted precision", "precision_macro": "macro precision", "recall_weighted":
         "weighted recall", "recall_macro": "macro recall", "miou": "test mIoU",
         "pixel_accuracy": "test pixel accuracy", "mean_class_accuracy":
         "mean class accuracy (pixels)", "local_miou": "local mIoU (mean over clients)",
         "auc": "test ROC AUC (macro, one-vs-rest)", "client_accuracy_std":
         "std of the clients' local accuracies", "client_accuracy_worst10":
         "local accuracy of the worst 10% of clients", "validation_accuracy":
         "validation accuracy (held-out training rows)",
         "seconds": "wall-clock s (cumulative)"}
FIRST = ("miou", "accuracy", "loss", "train_loss", "local_miou", "local_accuracy",
         "dissimilarity", "amm", "mmd")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)


def numeric_metrics(runs_rows: list[list[dict]]) -> tuple[list[str], dict[str, float]]:
    """Per-round keys with finite numbers (not ``round``) in report order, and the constant ones.

    A key logged more than once, always with the same value (``clients_evaluated`` when every
    client is scored), would draw a flat line: it is returned apart, with its value.
    """
    values: dict[str, list[float]] = {}
    for rows in runs_rows:
        for r in rows:
            for k, v in r.items():
                if k != "round" and _number(v):
                    values.setdefault(k, []).append(float(v))
    keys = [k for k in FIRST if k in values] + sorted(set(values) - set(FIRST))
    flat = {k: values[k][0] for k in keys if len(values[k]) > 1 and len(set(values[k])) == 1}
    return [k for k in keys if k not in flat], flat


def band(runs_rows: list[list[dict]], key: str) -> tuple[list, list, list] | None:
    """Rounds, mean and std over the runs that logged ``key`` at each round."""
    per: dict[int, list[float]] = {}
    for rows in runs_rows:
        for r in rows:
            if _number(r.get(key)):
                per.setdefault(int(r["round"]), []).append(float(r[key]))
    if not per:
        return None
    xs = sorted(per)
    return (xs, [float(np.mean(per[x])) for x in xs], [float(np.std(per[x])) for x in xs])


def ffd_band(rows_of: dict[str, list[list[dict]]], reference: str
             ) -> dict[str, tuple[list, list, list]]:
    """Per-round FFD of every group against ``reference`` from their mean ``mmd``."""
    ref = band(rows_of[reference], "mmd")
    if ref is None:
        return {}
    ref_at = dict(zip(ref[0], ref[1]))
    out = {}
    for name, runs in rows_of.items():
        b = band(runs, "mmd")
        if b is None:
            continue
        xs = [x for x in b[0] if x in ref_at]
        vals = [ffd(m, ref_at[x]) for x, m in zip(b[0], b[1]) if x in ref_at]
        keep = [(x, v) for x, v in zip(xs, vals) if np.isfinite(v)]
        if keep:
            out[name] = ([x for x, _ in keep], [v for _, v in keep], [0.0] * len(keep))
    return out


def curve_svg(series: dict[int, tuple[str, tuple[list, list, list]]], title: str, prefix: str,
              log: bool = False, legend: bool = False) -> tuple[str, dict]:
    """One axis: a line per series (mean) with a ±1 std band, and with ``legend`` the
    series' names (a figure away from the page's method toggles). ``series``: index ->
    (name, band); the index fixes the colour and the ``series-<i>`` class. Returns the SVG
    and the numbers for hover values."""
    with svg.style():
        fig, ax = subplots(figsize=(4.6, 3.0), layout="constrained")
        for i, (name, (x, m, s)) in series.items():
            xa, ma, sa = np.asarray(x), np.asarray(m), np.asarray(s)
            (line,) = ax.plot(xa, ma, color=color(i), ls=dash(i), lw=1.5, label=name)
            line.set_gid(f"series-{i}-line")
            if sa.any():
                fill = ax.fill_between(xa, ma - sa, ma + sa, color=color(i), alpha=0.18, lw=0)
                fill.set_gid(f"series-{i}-band")
        lows = [min(np.asarray(b[1]) - np.asarray(b[2])) for _, b in series.values()]
        highs = [max(np.asarray(b[1]) + np.asarray(b[2])) for _, b in series.values()]
        if log and lows and min(lows) > 0 and max(highs) / min(lows) > 10:
            ax.set_yscale("log")  # only when it spans more than a decade
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        if legend and series:
            ax.legend(fontsize=7, loc="best")
        text = svg.to_svg(fig, prefix)
        meta = {"box": svg.axes_box(fig, ax), "xlim": [float(v) for v in ax.get_xlim()],
                "title": title,
                "series": [{"i": i, "name": name, "x": x, "y": [round(v, 6) for v in m],
                            "s": [round(v, 6) for v in s]} for i, (name, (x, m, s))
                           in series.items()]}
        return text, meta


def weights_svg(groups: dict[str, list[list[dict]]], title: str, prefix: str) -> str | None:
    with svg.style():
        fig = weights_figure(groups, title)
        return None if fig is None else svg.to_svg(fig, prefix)


def confusion_svg(m: np.ndarray, title: str, prefix: str) -> str:
    with svg.style():
        return svg.to_svg(confusion_figure(m, title), prefix)
