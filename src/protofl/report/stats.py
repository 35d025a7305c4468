"""Partition statistics (the seed's Fig. S1): classes per client and samples per client."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from protofl.data.federated import FederatedData  # noqa: E402


def partition_stats(data: FederatedData, out: Path | None = None) -> str:
    """A text summary; with ``out``, also ``stats.json`` and ``stats.png`` there."""
    s = data.summary()
    classes = (data.class_counts > 0).sum(1)
    hist = np.bincount(classes, minlength=data.num_classes + 1)[1:]
    s["clients_with_n_classes"] = {int(i + 1): int(v) for i, v in enumerate(hist) if v}
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
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "stats.json").write_text(json.dumps(s, indent=2) + "\n")
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
        axes[0].bar(range(1, data.num_classes + 1), hist)
        axes[0].set_xlabel("classes on a client")
        axes[0].set_ylabel("clients")
        axes[1].hist(data.train_sizes, bins=30)
        axes[1].set_xlabel("samples on a client")
        axes[1].set_ylabel("clients")
        shown = data.class_counts[: min(30, data.num_clients)]
        bottom = np.zeros(len(shown))
        cmap = plt.get_cmap("tab20")
        for c in range(data.num_classes):
            axes[2].bar(range(len(shown)), shown[:, c], bottom=bottom, color=cmap(c % 20))
            bottom += shown[:, c]
        axes[2].set_xlabel("client")
        axes[2].set_ylabel("samples per class")
        fig.suptitle(f"{s['dataset']} partition")
        fig.tight_layout()
        fig.savefig(out / "stats.png", dpi=100)
        plt.close(fig)
        lines.append(f"  written: {out / 'stats.json'}, {out / 'stats.png'}")
    return "\n".join(lines)
