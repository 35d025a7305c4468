"""Segmentation figures: a confusion matrix accumulated over a whole test set, per-class IoU,
mIoU and pixel accuracy, and the seed's two per-pixel entropy maps; a model's figures over a
split, a few images at a time (``evaluate``, ``mean_loss``, ``client_figures``).

Conventions. Pixels whose target is ``ignore`` (255, VOC's void/boundary label) count nowhere.
The IoU of class c is ``m[c, c] / (row_c + col_c - m[c, c])``; a class absent from both the
truth and the prediction has no IoU (NaN) and is left out of the mIoU, while a class that is
only predicted (or only present in the truth) has IoU 0 and does count.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from protofl import tasks
from protofl.errors import ProtoflError
from protofl.metrics.classification import spread
from protofl.tasks import VOID

Predict = Callable[[torch.Tensor], torch.Tensor]  # model inputs -> logits (B, C, H, W)
Inputs = Callable[[torch.Tensor], torch.Tensor]  # stored rows -> model inputs


def confusion(target: torch.Tensor, pred: torch.Tensor, num_classes: int,
              ignore: int = VOID) -> torch.Tensor:
    """``(C, C)`` int64 counts, ``m[i, j]`` = pixels of true class i predicted as j.

    ``target`` and ``pred`` hold class indices of the same shape (any, e.g. ``(B, H, W)``);
    target pixels equal to ``ignore`` are skipped. A target value outside ``0..C-1`` (other
    than ``ignore``) or a prediction outside it is an error.
    """
    if target.shape != pred.shape:
        raise ProtoflError(f"segmentation target {tuple(target.shape)} and prediction "
                           f"{tuple(pred.shape)} differ in shape")
    t = target.reshape(-1).long()
    p = pred.reshape(-1).long()
    keep = t != ignore
    t, p = t[keep], p[keep]
    if len(t) and (t.min() < 0 or t.max() >= num_classes or p.min() < 0
                   or p.max() >= num_classes):
        raise ProtoflError(f"segmentation labels outside 0..{num_classes - 1} "
                           f"(and {ignore} = void)")
    return torch.bincount(t * num_classes + p, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes)


class ConfusionMeter:
    """Sums the confusion matrices of many batches (one matrix for the whole test set)."""

    def __init__(self, num_classes: int, ignore: int = VOID):
        self.num_classes = num_classes
        self.ignore = ignore
        self.matrix = torch.zeros(num_classes, num_classes, dtype=torch.int64)

    def update(self, target: torch.Tensor, pred_or_logits: torch.Tensor) -> None:
        """Add a batch: ``pred`` ``(B, H, W)`` indices, or logits ``(B, C, H, W)`` (argmax)."""
        pred = pred_or_logits
        if pred.dim() == target.dim() + 1:
            pred = pred.argmax(1)
        self.matrix += confusion(target.cpu(), pred.cpu(), self.num_classes, self.ignore)

    def report(self, class_names: list[str] | None = None) -> dict:
        return report(self.matrix.numpy(), class_names)


def iou(m: np.ndarray) -> np.ndarray:
    """Per-class IoU from a confusion matrix; NaN where the class is in neither truth nor
    prediction."""
    m = np.asarray(m, dtype=np.float64)
    tp = np.diag(m)
    union = m.sum(0) + m.sum(1) - tp
    return np.divide(tp, union, out=np.full(len(m), np.nan), where=union > 0)


def mean_iou(m: np.ndarray) -> float:
    """Mean IoU over the classes present in the truth or the prediction (0 if none)."""
    v = iou(m)
    v = v[~np.isnan(v)]
    return float(v.mean()) if len(v) else 0.0


def pixel_accuracy(m: np.ndarray) -> float:
    """Correct pixels over all non-void pixels (0 if there are none)."""
    m = np.asarray(m)
    total = m.sum()
    return float(np.trace(m) / total) if total else 0.0


def report(m: np.ndarray, class_names: list[str] | None = None) -> dict:
    """``miou``, ``pixel_accuracy``, ``mean_class_accuracy`` (recall averaged over classes in
    the truth) and ``iou`` per class name (None where undefined)."""
    m = np.asarray(m)
    names = class_names or [str(c) for c in range(len(m))]
    per = iou(m)
    support = m.sum(1)
    recall = np.diag(m)[support > 0] / support[support > 0]
    return {
        "miou": mean_iou(m),
        "pixel_accuracy": pixel_accuracy(m),
        "mean_class_accuracy": float(recall.mean()) if len(recall) else 0.0,
        "iou": {n: (None if np.isnan(v) else float(v)) for n, v in zip(names, per)},
    }


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``H(softmax(logits))`` over the class dimension 1, in nats: ``(B, C, H, W) -> (B, H,
    W)``; 0 for a one-hot prediction, ``log C`` for a uniform one."""
    logp = F.log_softmax(logits.double(), dim=1)
    return -(logp.exp() * logp).sum(1).to(logits.dtype)


def feature_entropy(z: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
    """Entropy of each pixel's feature vector read as a distribution over channels.

    ``z (B, d, h, w)`` is made non-negative by clamping at 0 (a ReLU: a no-op on the
    decoder's post-ReLU features), then divided by its channel sum, so each pixel is a
    probability vector; ``H = -sum_i p_i log p_i`` in nats (``log d`` when every channel is
    equally active, 0 when one is). A pixel whose features are all 0 has entropy 0. With
    ``size`` the ``(B, h, w)`` map is upsampled (bilinear) to it, as in the seed's figure.
    """
    q = z.double().clamp_min(0.0)
    s = q.sum(1, keepdim=True)
    p = torch.where(s > 0, q / s.clamp_min(1e-300), torch.zeros_like(q))
    h = -(torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))).sum(1)
    if size is not None and tuple(h.shape[-2:]) != tuple(size):
        h = F.interpolate(h[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    return h.to(z.dtype)


# ---- a model's figures over a split (the per-round metrics of segmentation runs) ----

def _passes(predict: Predict, x: torch.Tensor, y: torch.Tensor, batch: int,
            inputs: Inputs | None):
    """``(labels, logits)`` of consecutive batches of at most ``batch`` rows (capped so a
    pass holds ``tasks.DENSE_PIXELS`` label pixels)."""
    step = tasks.rows_per_pass(y, batch)
    prep = inputs or (lambda v: v)
    for i in range(0, len(y), step):
        yield y[i:i + step], predict(prep(x[i:i + step]))


@torch.no_grad()
def evaluate(predict: Predict, x: torch.Tensor, y: torch.Tensor, num_classes: int,
             batch: int, inputs: Inputs | None = None,
             class_names: list[str] | None = None) -> dict:
    """The segmentation report (``report``) of the logits ``predict`` gives for rows ``x``
    against masks ``y``, one confusion matrix over the whole split, plus ``accuracy`` (the
    pixel accuracy, under the name every task logs), ``loss`` (the mean over images of
    their mean pixel cross-entropy, void ignored: the local training objective) and
    ``confusion`` (pixels)."""
    if len(y) == 0:
        return {}
    meter = ConfusionMeter(num_classes)
    loss = 0.0
    for yb, logits in _passes(predict, x, y, batch, inputs):
        meter.update(yb, logits)
        loss += float(tasks.per_sample_cross_entropy(logits, yb.to(logits.device)).double().sum())
    out = meter.report(class_names)
    out["accuracy"] = out["pixel_accuracy"]
    out["loss"] = loss / len(y)
    out["confusion"] = meter.matrix.tolist()
    return out


@torch.no_grad()
def mean_loss(predict: Predict, x: torch.Tensor, y: torch.Tensor, batch: int,
              inputs: Inputs | None = None) -> float:
    """Mean over images of their mean non-void pixel cross-entropy (the training loss)."""
    total = sum(float(tasks.per_sample_cross_entropy(logits, yb.to(logits.device)).double().sum())
                for yb, logits in _passes(predict, x, y, batch, inputs))
    return total / max(len(y), 1)


def client_figures(preds: dict[int, tuple[torch.Tensor, torch.Tensor]], num_classes: int,
                   pooled: bool, class_names: list[str] | None = None) -> dict:
    """Per-client figures on each client's own local test split, from ``client -> (masks,
    predicted label maps)``: ``client_accuracy`` (pixel accuracy) and ``client_miou`` (mIoU
    of the client's own confusion matrix: the classes in its truth or its prediction), by
    id, and their means over clients ``local_accuracy`` and ``local_miou``; with ``pooled``,
    also the report of all clients' pixels together (personalised models)."""
    if not preds:
        return {}
    ks = sorted(preds)
    mats = {k: confusion(preds[k][0], preds[k][1], num_classes).numpy() for k in ks}
    acc = {str(k): pixel_accuracy(mats[k]) for k in ks}
    miou = {str(k): mean_iou(mats[k]) for k in ks}
    out = {}
    if pooled:
        total = sum(mats.values())
        out = report(total, class_names)
        out["accuracy"] = out["pixel_accuracy"]
        out["confusion"] = np.asarray(total).tolist()
    out.update(local_accuracy=float(np.mean(list(acc.values()))), client_accuracy=acc,
               **spread(list(acc.values())),
               local_miou=float(np.mean(list(miou.values()))), client_miou=miou)
    return out
