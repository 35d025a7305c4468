"""Federated evaluation: each site scores a model on its own held-out split and reports only
counts (its confusion matrix and summed cross-entropy); the server adds them up, so every
pooled figure weighs a site by its number of held-out samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from protofl.algorithms.base import Algorithm, Tensors, Weights
from protofl.metrics.classification import confusion, confusion_report, spread
from protofl.metrics.federated import EVAL_BATCH, Inputs, scores
from protofl.models.nets import ProtoNet


@dataclass
class SiteScore:
    """One site's evaluation: ``confusion[i, j]`` = its samples of class i predicted as j, and
    the sum of their cross-entropies."""

    confusion: np.ndarray
    loss_sum: float

    @property
    def n(self) -> int:
        return int(self.confusion.sum())


def score_split(alg: Algorithm, model: ProtoNet, weights: Weights | None, state: Tensors,
                x: torch.Tensor, y: torch.Tensor, num_classes: int, batch: int = EVAL_BATCH,
                inputs: Inputs | None = None) -> SiteScore:
    """The site's score of ``weights`` on rows ``(x, y)`` (``inputs`` makes model inputs of
    stored rows, batch by batch); an empty one without weights (a personalised client that
    has not trained yet) or samples."""
    if weights is None or len(y) == 0:
        return SiteScore(np.zeros((num_classes, num_classes), dtype=np.int64), 0.0)
    s = scores(alg, model, weights["params"], weights["buffers"], state, x, batch, inputs)
    return SiteScore(confusion(y.numpy(), s.argmax(1).cpu().numpy(), num_classes),
                     float(F.cross_entropy(s, y.to(s.device), reduction="sum")))


def pooled_figures(sites: dict[int, SiteScore]) -> dict:
    """The classification report of all sites' samples together (from the summed confusion
    matrices), ``loss`` (summed cross-entropy / samples), ``local_accuracy`` (the mean of the
    sites' accuracies), ``client_accuracy`` (by site), its spread
    (``classification.spread``) and ``clients_evaluated`` (how many
    sites those cover); sites without samples are left out, and nothing is returned when
    none has any."""
    ks = sorted(k for k, s in sites.items() if s.n > 0)
    if not ks:
        return {}
    out = confusion_report(sum(sites[k].confusion for k in ks))
    out["loss"] = sum(sites[k].loss_sum for k in ks) / sum(sites[k].n for k in ks)
    accs = [float(np.trace(sites[k].confusion) / sites[k].n) for k in ks]
    out["local_accuracy"] = float(np.mean(accs))
    out["client_accuracy"] = dict(zip(map(str, ks), accs))
    out.update(spread(accs))
    out["clients_evaluated"] = len(ks)
    return out
