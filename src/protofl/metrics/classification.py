"""Classification figures from predictions: accuracy, balanced accuracy, precision, recall,
F1 (weighted and macro) and the confusion matrix; from class scores, the ROC AUC; over
clients, the spread of their accuracies."""

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


def auc(y_true: np.ndarray, scores: np.ndarray) -> float | None:
    """Macro one-vs-rest ROC AUC (scikit-learn's ``roc_auc_score``) of the softmax of class
    scores ``(n, C)``, over the classes with both positives and negatives among ``y_true``;
    None where no class has both."""
    from sklearn.metrics import roc_auc_score

    scores = np.asarray(scores, dtype=np.float64)
    probs = np.exp(scores - scores.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    truth = np.asarray(y_true)[:, None] == np.arange(scores.shape[1])
    both = truth.any(0) & ~truth.all(0)
    if not both.any():
        return None
    return float(roc_auc_score(truth[:, both], probs[:, both], average="macro"))


def spread(accs: list[float]) -> dict:
    """How unevenly clients fare: ``client_accuracy_std`` (the population standard deviation
    of their accuracies) and ``client_accuracy_worst10`` (the mean of the lowest tenth, at
    least one client)."""
    a = np.sort(np.asarray(accs, dtype=np.float64))
    worst = a[:max(1, int(np.ceil(0.1 * len(a))))]
    return {"client_accuracy_std": float(a.std()), "client_accuracy_worst10": float(worst.mean())}
