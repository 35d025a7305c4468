"""t-SNE of the final aggregate model's features per class (the seed's Fig. S3)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from protofl.algorithms.base import features  # noqa: E402
from protofl.engine import runfolder  # noqa: E402
from protofl.errors import ProtoflError  # noqa: E402


def tsne_plot(folder: Path, samples: int = 1000, seed: int = 0) -> Path:
    """Embed the features z of up to ``samples`` global-test samples under the run's last
    checkpointed global weights; writes and returns ``folder/tsne.png``."""
    from sklearn.manifold import TSNE

    from protofl.config import config_from_dict
    from protofl.engine.experiment import Experiment

    folder = Path(folder)
    exp = Experiment(config_from_dict(runfolder.load_config_json(folder)))
    exp.restore(runfolder.load_checkpoint(folder))
    weights = exp.alg.global_weights(exp.state)
    if weights is None:
        raise ProtoflError(f"{exp.alg.name} keeps personalised models: no global model to embed")
    x, y = exp.data.x_test, exp.data.y_test
    pick = np.sort(np.random.default_rng(seed).permutation(len(y))[:samples])
    exp.alg.model.eval()
    z = features(exp.alg.model, weights["params"], weights["buffers"],
                 exp.data.inputs(x[torch.from_numpy(pick)]))
    emb = TSNE(2, init="pca", random_state=seed,
               perplexity=min(30.0, max(2.0, len(pick) / 4))).fit_transform(z.numpy())
    labels = y[pick].numpy()
    fig, ax = plt.subplots(figsize=(6, 6))
    cmap = plt.get_cmap("tab20")
    for c in np.unique(labels):
        m = labels == c
        ax.scatter(emb[m, 0], emb[m, 1], s=6, color=cmap(int(c) % 20),
                   label=exp.data.class_names[int(c)])
    ax.legend(fontsize=7, markerscale=2, loc="best")
    ax.set_title(f"{exp.alg.name} on {exp.data.name}, round {exp.round}: t-SNE of features")
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    path = folder / "tsne.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
