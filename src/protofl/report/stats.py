"""Partition statistics (the seed's Fig. S1): classes per client and samples per client,
written into every run folder when it starts (:class:`PartitionStats`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

from protofl.data.federated import FederatedData
from protofl.engine.callbacks import Callback
from protofl.engine.runfolder import RunStore, write_json
from protofl.report.canvas import subplots


def partition_summary(data: FederatedData) -> dict:
    """``data.summary()`` with the number of clients holding n classes."""
    s = data.summary()
    classes = (data.class_counts > 0).sum(1)
    hist = np.bincount(classes, minlength=data.num_classes + 1)[1:]
    s["clients_with_n_classes"] = {int(i + 1): int(v) for i, v in enumerate(hist) if v}
    return s


def stats_figure(data: FederatedData, s: dict):
    """The figure of ``stats.png``: classes per client, samples per client, samples per class
    of the first 30 clients (``s``: :func:`partition_summary`)."""
    hist = [s["clients_with_n_classes"].get(n, 0) for n in range(1, data.num_classes + 1)]
    fig, axes = subplots(1, 3, figsize=(13, 3.4))
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.16, top=0.88, wspace=0.25)  # fast
    axes[0].bar(range(1, data.num_classes + 1), hist)
    axes[0].set_xlabel("classes on a client")
    axes[0].set_ylabel("clients")
    axes[1].hist(data.train_sizes, bins=30, histtype="stepfilled")
    axes[1].set_xlabel("samples on a client")
    axes[1].set_ylabel("clients")
    shown = data.class_counts[: min(30, data.num_clients)]
    bottom = np.zeros(len(shown))
    cmap = matplotlib.colormaps.get_cmap("tab20")
    for c in range(data.num_classes):
        axes[2].bar(range(len(shown)), shown[:, c], bottom=bottom, color=cmap(c % 20))
        bottom += shown[:, c]
    axes[2].set_xlabel("client")
    axes[2].set_ylabel("samples per class")
    fig.suptitle(f"{s['dataset']} partition")
    return fig


def write_stats(data: FederatedData, out: Path | RunStore) -> dict:
    """``stats.json`` and ``stats.png`` in ``out`` (a run folder's store, or any folder:
    ``protofl datasets --stats --out``); returns the statistics."""
    s = partition_summary(data)
    if isinstance(out, RunStore):
        out.write_json("stats.json", s)
        out.save_figure("stats.png", stats_figure(data, s))
        return s
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "stats.json", s)
    stats_figure(data, s).savefig(out / "stats.png", dpi=100)
    return s


def partition_stats(data: FederatedData, out: Path | None = None) -> str:
    """A text summary; with ``out``, also ``stats.json`` and ``stats.png`` there."""
    s = write_stats(data, out) if out is not None else partition_summary(data)
    lines = [f"{s['dataset']}: {s['clients']} clients, {s['classes']} classes, "
             f"{s['train_samples']} train / {s['local_test_samples']} local test / "
             f"{s['global_test_samples']} global test samples"]
    for key in ("samples_per_client", "classes_per_client"):
        d = s[key]
        lines.append(f"  {key.replace('_', ' ')}: min {d['min']}, median {d['median']:g}, "
                     f"mean {d['mean']:.1f}, max {d['max']}")
    lines.append("  clients holding n classes: " + ", ".join(
        f"{n}: {c}" for n, c in s["clients_with_n_classes"].items()))
    if out is not None:
        lines.append(f"  written: {Path(out) / 'stats.json'}, {Path(out) / 'stats.png'}")
    return "\n".join(lines)


class PartitionStats(Callback):
    """Writes a run folder's ``stats.json`` and ``stats.png`` when a run starts (a resumed
    run keeps them), so every run folder, and ``protofl report``, has its partition
    statistics (not in site mode, where the server holds no client rows); written through
    the run's store, which has prepared the folder."""

    def on_run_start(self, view) -> None:
        if view.store is None or not len(view.data.y_train):
            return
        if view.round == 0 or view.store.read_json("stats.json") is None:
            write_stats(view.data, view.store)
