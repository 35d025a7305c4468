"""Segmentation figures from plain tensors: the seed's qualitative figure (predicted maps and
the two entropy maps per method) and its partition statistics across alpha settings (Fig.
S1), both in the Pascal VOC colormap."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from matplotlib.patches import Patch

from protofl.data.federated import FederatedData
from protofl.errors import ProtoflError
from protofl.metrics.segmentation import feature_entropy, softmax_entropy
from protofl.report.canvas import subplots
from protofl.tasks import VOID

MAPS = ("pred", "softmax_entropy", "feature_entropy")


def voc_colormap(n: int = 256) -> np.ndarray:
    """``(n, 3)`` uint8: Pascal VOC's colours. The bits of a label, taken three at a time
    (red, green, blue), fill each channel from its most significant bit down; label 255
    (void) comes out as (224, 224, 192)."""
    labels = np.arange(n)
    cmap = np.zeros((n, 3), dtype=np.int64)
    for bit in range(8):
        for ch in range(3):
            cmap[:, ch] |= ((labels >> (3 * bit + ch)) & 1) << (7 - bit)
    return cmap.astype(np.uint8)


def colorize(mask: np.ndarray | torch.Tensor) -> np.ndarray:
    """Label map ``(H, W)`` -> RGB ``(H, W, 3)`` uint8 in the VOC colormap."""
    m = np.asarray(mask, dtype=np.int64)
    return voc_colormap()[np.clip(m, 0, 255)]


def maps_from_outputs(z: torch.Tensor, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three maps a method contributes, from a model's ``(z, logits)``: ``pred`` (argmax
    label), ``softmax_entropy`` and ``feature_entropy`` (upsampled to the logits' size)."""
    with torch.no_grad():
        return {"pred": logits.argmax(1), "softmax_entropy": softmax_entropy(logits),
                "feature_entropy": feature_entropy(z, size=tuple(logits.shape[-2:]))}


def _rgb(image: np.ndarray | torch.Tensor) -> np.ndarray:
    a = np.asarray(image)
    if a.ndim == 3 and a.shape[0] in (1, 3):
        a = a.transpose(1, 2, 0)
    if a.dtype != np.uint8:
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
    return a[..., 0] if a.shape[-1] == 1 else a


def qualitative_figure(images, truth, methods: Mapping[str, Mapping[str, object]],
                       path: str | Path | None, class_names: list[str] | None = None,
                       title: str = ""):
    """One row per test image: the image, its ground truth, then for each method its
    predicted map, softmax entropy map and feature entropy map; writes and returns ``path``
    (``None``: returns the figure, for a run folder's store to write).

    ``images``: ``(N, 3, H, W)`` (uint8, or floats rescaled per image for display);
    ``truth``: ``(N, H, W)`` labels (255 void); ``methods``: name -> ``{"pred": (N, H, W),
    "softmax_entropy": (N, H, W), "feature_entropy": (N, H, W)}`` (see
    ``maps_from_outputs``). Each entropy kind shares one colour scale (its minimum to its
    maximum over all methods and images; dark: low entropy).
    """
    images, truth = np.asarray(images), np.asarray(truth)
    n = len(images)
    if n == 0 or len(truth) != n:
        raise ProtoflError(f"qualitative figure: {n} images and {len(truth)} ground truths")
    for name, maps in methods.items():
        missing = [k for k in MAPS if k not in maps]
        if missing or any(len(maps[k]) != n for k in MAPS):
            raise ProtoflError(f"qualitative figure: method {name!r} needs {', '.join(MAPS)} "
                               f"for {n} images")
    arrays = {m: {k: np.asarray(v[k], dtype=np.float64 if k != "pred" else np.int64)
                  for k in MAPS} for m, v in methods.items()}
    lo = {k: min(float(a[k].min()) for a in arrays.values()) for k in MAPS[1:]}
    hi = {k: max(max(float(a[k].max()) for a in arrays.values()), lo[k] + 1e-9)
          for k in MAPS[1:]}
    cols = 2 + 3 * len(methods)
    fig, axes = subplots(n, cols, squeeze=False, figsize=(1.6 * cols, 1.7 * n + 0.6))
    heads = ["image", "ground truth"] + [f"{m}\n{label}" for m in methods
                                         for label in ("prediction", "H softmax", "H features")]
    present: set[int] = set()
    for i in range(n):
        row = axes[i]
        row[0].imshow(_rgb(images[i]), cmap="gray")
        row[1].imshow(colorize(truth[i]), interpolation="nearest")
        present |= set(np.unique(truth[i]).tolist())
        for j, a in enumerate(arrays.values()):
            row[2 + 3 * j].imshow(colorize(a["pred"][i]), interpolation="nearest")
            present |= set(np.unique(a["pred"][i]).tolist())
            for k, key in enumerate(MAPS[1:], start=1):
                row[2 + 3 * j + k].imshow(a[key][i], cmap="viridis", vmin=lo[key],
                                          vmax=hi[key])
        for ax in row:
            ax.set_xticks([])
            ax.set_yticks([])
    for ax, head in zip(axes[0], heads):
        ax.set_title(head, fontsize=8)
    names = class_names or [str(c) for c in range(256)]
    cmap = voc_colormap()
    handles = [Patch(color=cmap[c] / 255.0, label=names[c] if c < len(names) else
                     ("void" if c == VOID else str(c))) for c in sorted(present)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=7,
               frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97 if title else 1))
    return fig if path is None else _save(fig, path, 110)


def _save(fig, path: str | Path, dpi: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def partition_figure(splits: Mapping[str, FederatedData], path: str | Path,
                     clients: int = 30, seed: int = 0) -> Path:
    """The seed's Fig. S1, one row per setting (e.g. ``{"alpha = 0.01": data, ...}``): how
    many clients hold each class, how many classes each client holds, and the class mix of
    ``clients`` randomly chosen clients (stacked, VOC colours). Counts are images per
    object class (``FederatedData.class_counts``); a background column that is all zero is
    left out."""
    if not splits:
        raise ProtoflError("partition figure: no splits given")
    cmap = voc_colormap() / 255.0
    fig, axes = subplots(len(splits), 3, figsize=(13, 3.0 * len(splits)), squeeze=False)
    for row, (label, data) in zip(axes, splits.items()):
        counts = data.class_counts
        classes = np.arange(data.num_classes)
        if not counts[:, 0].any():
            classes = classes[1:]
        held = counts[:, classes] > 0
        row[0].bar(range(len(classes)), held.sum(0), color=cmap[classes])
        row[0].set_xticks(range(len(classes)))
        row[0].set_xticklabels([data.class_names[c] for c in classes], rotation=90, fontsize=6)
        row[0].set_ylabel(f"{label}\nclients holding it")
        per = held.sum(1)
        row[1].bar(*np.unique(per, return_counts=True))
        row[1].set_xlabel("classes on a client")
        row[1].set_ylabel("clients")
        pick = np.sort(np.random.default_rng(seed).permutation(data.num_clients)[:clients])
        bottom = np.zeros(len(pick))
        for c in classes:
            row[2].bar(range(len(pick)), counts[pick, c], bottom=bottom, color=cmap[c])
            bottom += counts[pick, c]
        row[2].set_xlabel(f"{len(pick)} random clients")
        row[2].set_ylabel("images per class")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


# ---- the figures of finished runs ----

FIGURE_IMAGES = 4  # test images in a run's segmentation figure


def figure_images(data: FederatedData, n: int = FIGURE_IMAGES) -> np.ndarray:
    """Indices of ``n`` fixed global-test images: the first image of each object class, in
    class order, then the first of the others (the same images for every run of a dataset)."""
    if data.labels_test is not None:
        labels = data.labels_test.numpy()
        firsts = [int(np.flatnonzero(labels == c)[0]) for c in np.unique(labels)]
    else:
        firsts = []
    chosen = set(firsts)
    rest = [i for i in range(len(data.y_test)) if i not in chosen]
    return np.asarray((firsts + rest)[:n], dtype=np.int64)


@torch.no_grad()
def model_maps(exp, index: np.ndarray) -> dict[str, torch.Tensor]:
    """The three maps of a run's aggregate model (``exp``: an Experiment) on the global-test
    images ``index``."""
    from protofl.algorithms.base import forward

    weights = exp.alg.global_weights(exp.state)
    if weights is None:
        raise ProtoflError(f"{exp.alg.name} keeps personalised models: no aggregate model to "
                           "draw")
    exp.alg.model.eval()
    x = exp.data.inputs(exp.data.x_test[torch.from_numpy(index)])
    return maps_from_outputs(*forward(exp.alg.model, weights["params"], weights["buffers"], x))


def run_figure(exp, path: str | Path | None = None, n: int = FIGURE_IMAGES):
    """One run's figure (``exp``: a RoundView or a restored Experiment): ``n`` fixed test
    images, their truth and the aggregate model's prediction and entropy maps; written to
    ``path``, or returned as a figure when ``path`` is None."""
    index = figure_images(exp.data, n)
    data = exp.data
    return qualitative_figure(data.x_test[index], data.y_test[index],
                              {exp.alg.name: model_maps(exp, index)}, path, data.class_names,
                              f"{exp.alg.name} on {data.name}, round {exp.round}")


def runs_figure(folders: Mapping[str, str | Path], path: str | Path,
                n: int = FIGURE_IMAGES, title: str = "") -> Path:
    """The seed's qualitative figure from finished runs (label -> run folder, e.g. fedavg,
    fedmargin and central): each run's last checkpoint is loaded and its aggregate model
    drawn on the same ``n`` fixed test images. The runs must share a segmentation test set."""
    from protofl.report.runs import restored

    if not folders:
        raise ProtoflError("segmentation figure: no runs given")
    maps, first = {}, None
    for label, folder in folders.items():
        exp = restored(Path(folder))
        data = exp.data
        if data.task != "segmentation":
            raise ProtoflError(f"segmentation figure: {folder} is a {data.task} run")
        if first is None:
            first, index = data, figure_images(data, n)
        elif data.name != first.name or data.y_test.shape != first.y_test.shape or not (
                torch.equal(data.y_test, first.y_test)):
            raise ProtoflError(f"segmentation figure: {folder} has another test set than "
                               f"{next(iter(folders.values()))}")
        maps[label] = model_maps(exp, index)
    return qualitative_figure(first.x_test[index], first.y_test[index], maps, path,
                              first.class_names, title or first.name)
