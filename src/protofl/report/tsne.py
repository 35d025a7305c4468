"""t-SNE of the final aggregate model's features per class (the seed's Fig. S3): one point
per global-test sample, or for segmentation per sampled pixel of the feature map (labels
nearest-downsampled, background and void left out, VOC colours, as the seed draws it)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import torch

from protofl import tasks
from protofl.algorithms.base import Tensors, features
from protofl.data.federated import FederatedData
from protofl.engine.runfolder import RunStore
from protofl.errors import ProtoflError
from protofl.report.canvas import subplots
from protofl.report.runs import restored

BACKGROUND = 0
POOL = 4  # pixels gathered per pixel drawn, before the uniform draw
MIN_SAMPLES = 3  # t-SNE's perplexity (at least 2) must stay below the number of points


def pixel_features(model, weights: Tensors, data: FederatedData, samples: int, seed: int
                   ) -> tuple[torch.Tensor, np.ndarray]:
    """Up to ``samples`` labelled pixel feature rows of the global test set, background and
    void left out: test images in a seeded order, a few at a time, until ``POOL`` times that
    many rows are gathered (or the images run out), then ``samples`` of them drawn
    uniformly."""
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(data.y_test)))
    step = tasks.rows_per_pass(data.y_test, 256)
    rows, labels, have = [], [], 0
    for i in range(0, len(order), step):
        idx = order[i:i + step]
        z = features(model, weights["params"], weights["buffers"],
                     data.inputs(data.x_test[idx]), step)
        r, c = tasks.labelled_features(z, data.y_test[idx])
        keep = c != BACKGROUND
        rows.append(r[keep])
        labels.append(c[keep])
        have += int(keep.sum())
        if have >= POOL * samples:
            break
    z, y = torch.cat(rows), torch.cat(labels).numpy()
    if not len(y):
        raise ProtoflError(f"{data.name}: no labelled object pixel in the test set to embed")
    pick = np.sort(np.random.default_rng(seed + 1).permutation(len(y))[:samples])
    return z[torch.from_numpy(pick)], y[pick]


def tsne_plot(folder: Path, samples: int = 1000, seed: int = 0) -> Path:
    """Embed the features z of up to ``samples`` global-test samples (segmentation: pixels)
    under the run's last checkpointed global weights; writes and returns
    ``folder/tsne.png``."""
    from sklearn.manifold import TSNE

    if samples < MIN_SAMPLES:
        raise ProtoflError(f"--samples {samples}: t-SNE needs at least {MIN_SAMPLES} samples")
    folder = Path(folder).expanduser()
    exp = restored(folder)
    weights = exp.alg.global_weights(exp.state)
    if weights is None:
        raise ProtoflError(f"{exp.alg.name} keeps personalised models: no global model to embed")
    exp.alg.model.eval()
    data = exp.data
    dense = data.task == "segmentation"
    if dense:
        z, labels = pixel_features(exp.alg.model, weights, data, samples, seed)
    else:
        x, y = data.x_test, data.y_test
        pick = np.sort(np.random.default_rng(seed).permutation(len(y))[:samples])
        z = features(exp.alg.model, weights["params"], weights["buffers"],
                     data.inputs(x[torch.from_numpy(pick)]))
        labels = y[pick].numpy()
    if len(labels) < MIN_SAMPLES:
        raise ProtoflError(f"{data.name}: only {len(labels)} test points to embed; t-SNE needs "
                           f"at least {MIN_SAMPLES}")
    emb = TSNE(2, init="pca", random_state=seed,
               perplexity=min(30.0, max(2.0, len(labels) / 4))).fit_transform(z.numpy())
    fig, ax = subplots(figsize=(6, 6))
    if dense:
        from protofl.report.segmentation import voc_colormap

        colours = voc_colormap() / 255.0
    else:
        cmap = matplotlib.colormaps.get_cmap("tab20")
        colours = [cmap(c % 20) for c in range(data.num_classes)]
    for c in np.unique(labels):
        m = labels == c
        ax.scatter(emb[m, 0], emb[m, 1], s=6, color=colours[int(c)],
                   label=data.class_names[int(c)])
    ax.legend(fontsize=7, markerscale=2, loc="best")
    what = "pixel features (background left out)" if dense else "features"
    ax.set_title(f"{exp.alg.name} on {data.name}, round {exp.round}: t-SNE of {what}",
                 fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    return RunStore(folder).save_figure("tsne.png", fig)
