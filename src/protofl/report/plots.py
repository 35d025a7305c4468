"""Plots from run folders: per-run curves and confusion matrix, and the seed's Fig. 2 curves
across algorithms (mean with a band of one standard deviation over seeds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protofl.engine.callbacks import Callback
from protofl.engine.runfolder import RunStore
from protofl.report.canvas import color, dash, subplots

CURVES = (("accuracy", "test accuracy"), ("train_loss", "training loss"),
          ("dissimilarity", "gradient dissimilarity"), ("amm", "aggregate mean margin"))


def curves_of(runs_rows: list[list[dict]]) -> tuple[tuple[str, str], ...]:
    """The four curves of runs: test mIoU instead of accuracy for segmentation runs."""
    if any("miou" in r for rows in runs_rows for r in rows):
        return (("miou", "test mIoU"),) + CURVES[1:]
    return CURVES


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
    if not pts:
        return np.array([]), np.array([])
    r, v = zip(*pts)
    return np.asarray(r), np.asarray(v, dtype=float)


def run_figures(rows: list[dict], summary: dict | None) -> dict:
    """A run's figures by file name: ``curves.png`` (the four curves of its records ``rows``)
    and, when its summary holds one, ``confusion.png``."""
    fig, axes = subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    for ax, (key, label) in zip(axes, curves_of([rows])):
        x, y = series(rows, key)
        ax.plot(x, y)
        ax.set_title(label)
        ax.set_xlabel("round")
        if key == "dissimilarity" and len(y) and (y > 0).all():
            ax.set_yscale("log")
    fig.tight_layout()
    figures = {"curves.png": fig}
    if summary and summary.get("confusion"):
        figures["confusion.png"] = confusion_figure(
            np.asarray(summary["confusion"]),
            f"{summary.get('algorithm')} on {summary.get('dataset')}")
    return figures


def plot_run(folder: Path | RunStore) -> None:
    """``curves.png`` (the four curves) and ``confusion.png`` for one run folder, written
    through its store."""
    store = folder if isinstance(folder, RunStore) else RunStore(folder)
    for name, fig in run_figures(store.records(), store.summary()).items():
        store.save_figure(name, fig)


def confusion_inches(classes: int) -> float:
    """The side of a confusion figure: 0.45 in (32 pt) per class and 2 in of labels."""
    return max(4.0, 0.45 * classes + 2)


def confusion_figure(m: np.ndarray, title: str = "", names: list[str] | None = None):
    """Row-normalised confusion matrix with the counts in the cells (11 pt up to 10 classes,
    9 pt up to 20: four digits fit a 32 pt cell; drawn at its natural size they are as many
    pixels tall)."""
    rows = m.sum(1, keepdims=True)
    norm = np.divide(m, rows, out=np.zeros(m.shape, dtype=float), where=rows > 0)
    size = confusion_inches(len(m))
    fig, ax = subplots(figsize=(size, size))
    ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    if len(m) <= 20:
        for i in range(len(m)):
            for j in range(len(m)):
                ax.text(j, i, str(m[i, j]), ha="center", va="center",
                        fontsize=11 if len(m) <= 10 else 9,
                        color="white" if norm[i, j] > 0.5 else "black")
    ticks = names or [str(i) for i in range(len(m))]
    ax.set_xticks(range(len(m)), ticks, rotation=90)
    ax.set_yticks(range(len(m)), ticks)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    fig.tight_layout()
    return fig


class PlotRun(Callback):
    """Draws a run folder's ``curves.png`` and ``confusion.png`` when the run ends, and for a
    segmentation run with an aggregate model ``segmentation.png`` (a few fixed test images,
    their truth, the prediction and the two entropy maps)."""

    def on_run_end(self, view, summary) -> None:
        if view.store is None:
            return
        plot_run(view.store)
        if view.data.task == "segmentation" and view.alg.global_weights(view.state) is not None:
            from protofl.report.segmentation import run_figure

            view.store.save_figure("segmentation.png", run_figure(view), dpi=110)


def plot_confusion(m: np.ndarray, path: Path, title: str = "",
                   names: list[str] | None = None) -> None:
    fig = confusion_figure(m, title, names)
    fig.savefig(path, dpi=100)


def plot_groups(groups: dict[str, list[list[dict]]], path: Path, title: str = "") -> None:
    groups_figure(groups, title).savefig(path, dpi=100)


def groups_figure(groups: dict[str, list[list[dict]]], title: str = ""):
    """One line per group (e.g. an algorithm), mean over its runs, shaded ±1 std; a group has
    one colour in every panel (drawn or not in the others)."""
    fig, axes = subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.4))
    for ax, (key, label) in zip(axes, curves_of([r for runs in groups.values() for r in runs])):
        drawn = False
        for i, (name, runs) in enumerate(groups.items()):  # one colour a group, every panel
            curves = [series(rows, key) for rows in runs]
            curves = [c for c in curves if len(c[0])]
            if not curves:
                continue
            drawn = True
            n = min(len(c[0]) for c in curves)
            x = curves[0][0][:n]
            ys = np.stack([c[1][:n] for c in curves])
            mean, std = ys.mean(0), ys.std(0)
            ax.plot(x, mean, label=name, color=color(i), ls=dash(i))
            ax.fill_between(x, mean - std, mean + std, color=color(i), alpha=0.2)
        ax.set_title(label)
        ax.set_xlabel("round")
        if not drawn:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        elif key == "dissimilarity":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def weights_figure(groups: dict[str, list[list[dict]]], title: str = ""):
    """The seed's Fig. S2: the distribution of aggregation weights a[k] (scaled by K', so 1 is
    uniform) against FedAvg's n_k / sum n, for runs that log both; None when none does."""
    hists = {}
    for name, runs in groups.items():
        a, f = [], []
        for rows in runs:
            for r in rows:
                if r.get("weights") and r.get("fedavg_weights"):
                    k = len(r["weights"])
                    a += [w * k for w in r["weights"]]
                    f += [w * k for w in r["fedavg_weights"]]
        if a:
            hists[name] = (np.asarray(a), np.asarray(f))
    if not hists:
        return None
    fig, axes = subplots(1, len(hists), squeeze=False, figsize=(4.5 * len(hists), 3.4))
    for ax, (name, (a, f)) in zip(axes[0], hists.items()):
        bins = np.linspace(0, max(a.max(), f.max()) * 1.05, 40)
        ax.hist(f, bins=bins, alpha=0.5, label="FedAvg n_k / sum n")
        ax.hist(a, bins=bins, alpha=0.5, label=f"{name} a[k]")
        ax.axvline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel("weight x K' (1 = uniform)")
        ax.set_ylabel("client-rounds")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(f"{title}: aggregation weights")
    fig.tight_layout()
    return fig


def plot_weights(groups: dict[str, list[list[dict]]], path: Path, title: str = "") -> None:
    """``weights_figure`` as a PNG at ``path``; nothing when no run logs weights."""
    fig = weights_figure(groups, title)
    if fig is not None:
        fig.savefig(path, dpi=100)
