"""Classification figures from predictions: accuracy, balanced accuracy, precision, recall,
F1 (weighted and macro) and the confusion matrix."""

from __future__ import annotations

import numpy as np


def confusion(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> np.ndarray:
    """``m[i, j]`` = samples of true class i predicted as j."""
    m = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(m, (y_true, y_pred), 1)
    return m


def report(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> dict:
    """All figures, from the confusion matrix (:func:`confusion_report`)."""
    return confusion_report(confusion(y_true, y_pred, num_classes))


def confusion_report(m: np.ndarray) -> dict:
    """All figures of a confusion matrix ``m`` (C, C). Classes absent from the true labels are
    left out of the balanced accuracy and the macro means; a class never predicted has
    precision 0."""
    m = np.asarray(m, dtype=np.int64)
    support = m.sum(1).astype(float)
    predicted = m.sum(0).astype(float)
    tp = np.diag(m).astype(float)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    present = support > 0
    w = support / max(support.sum(), 1.0)
    return {
        "accuracy": float(tp.sum() / max(m.sum(), 1)),
        "balanced_accuracy": float(recall[present].mean()) if present.any() else 0.0,
        "precision_weighted": float((w * precision).sum()),
        "recall_weighted": float((w * recall).sum()),
        "f1_weighted": float((w * f1).sum()),
        "precision_macro": float(precision[present].mean()) if present.any() else 0.0,
        "recall_macro": float(recall[present].mean()) if present.any() else 0.0,
        "f1_macro": float(f1[present].mean()) if present.any() else 0.0,
        "confusion": m.tolist(),
    }
