"""Segmentation metrics against a confusion matrix and entropies worked out by hand."""

import math

import numpy as np
import pytest
import torch

from protofl.errors import ProtoflError
from protofl.metrics.segmentation import (
    ConfusionMeter,
    confusion,
    feature_entropy,
    iou,
    mean_iou,
    pixel_accuracy,
    report,
    softmax_entropy,
)

# 2 x 4 target with one void pixel; 7 counted pixels:
# (t, p) = (0,0) (0,1) (1,1) | (1,1) (2,2) (2,0) (0,0)
TARGET = torch.tensor([[[0, 0, 1, 255], [1, 2, 2, 0]]], dtype=torch.uint8)
PRED = torch.tensor([[[0, 1, 1, 2], [1, 2, 0, 0]]])
HAND = np.array([[2, 1, 0],
                 [0, 2, 0],
                 [1, 0, 1]])


def test_confusion_by_hand():
    assert confusion(TARGET, PRED, 3).tolist() == HAND.tolist()
    # IoU_c = tp / (row + col - tp): 2/(3+3-2), 2/(2+3-2), 1/(2+1-1)
    assert iou(HAND) == pytest.approx([0.5, 2 / 3, 0.5])
    assert mean_iou(HAND) == pytest.approx((0.5 + 2 / 3 + 0.5) / 3)
    assert pixel_accuracy(HAND) == pytest.approx(5 / 7)
    r = report(HAND, ["bg", "a", "b"])
    assert r["iou"] == pytest.approx({"bg": 0.5, "a": 2 / 3, "b": 0.5})
    assert r["mean_class_accuracy"] == pytest.approx((2 / 3 + 1 + 1 / 2) / 3)


def test_absent_classes():
    """A class in neither truth nor prediction is left out of the mIoU; a class only
    predicted has IoU 0 and counts."""
    m = confusion(TARGET, PRED, 4)
    assert np.isnan(iou(m.numpy())[3])
    assert mean_iou(m.numpy()) == pytest.approx((0.5 + 2 / 3 + 0.5) / 3)
    assert report(m.numpy())["iou"]["3"] is None
    pred = PRED.clone()
    pred[0, 0, 0] = 3  # a background pixel predicted as class 3, never in the truth
    m = confusion(TARGET, pred, 4).numpy()
    assert m[0].tolist() == [1, 1, 0, 1]
    # bg: 1/(3+2-1); a: 2/3; b: 1/2; class 3: 0/(0+1-0)
    assert iou(m) == pytest.approx([0.25, 2 / 3, 0.5, 0.0])
    assert mean_iou(m) == pytest.approx((0.25 + 2 / 3 + 0.5 + 0.0) / 4)


def test_meter_accumulates_batches_and_logits():
    meter = ConfusionMeter(3)
    logits = torch.nn.functional.one_hot(PRED, 3).permute(0, 3, 1, 2).float()
    meter.update(TARGET[:, :1], logits[:, :, :1])  # first row, as logits
    meter.update(TARGET[:, 1:], PRED[:, 1:])  # second row, as indices
    assert meter.matrix.tolist() == HAND.tolist()
    assert meter.report()["miou"] == pytest.approx(mean_iou(HAND))


def test_bad_labels():
    with pytest.raises(ProtoflError, match="outside 0..2"):
        confusion(torch.tensor([3]), torch.tensor([0]), 3)
    with pytest.raises(ProtoflError, match="differ in shape"):
        confusion(torch.zeros(2, 2), torch.zeros(2, 3), 3)


def test_softmax_entropy_by_hand():
    # logits (0, log 3) -> p = (1/4, 3/4); H = 1/4 ln 4 + 3/4 ln(4/3)
    logits = torch.tensor([0.0, math.log(3.0)]).reshape(1, 2, 1, 1)
    want = 0.25 * math.log(4) + 0.75 * math.log(4 / 3)
    assert softmax_entropy(logits).item() == pytest.approx(want, rel=1e-6)
    uniform = torch.zeros(2, 5, 3, 4)
    assert softmax_entropy(uniform).shape == (2, 3, 4)
    assert torch.allclose(softmax_entropy(uniform), torch.full((2, 3, 4), math.log(5)))
    peaked = torch.tensor([100.0, 0.0, 0.0]).reshape(1, 3, 1, 1)
    assert softmax_entropy(peaked).item() == pytest.approx(0.0, abs=1e-12)


def test_feature_entropy_by_hand():
    z = torch.tensor([[1.0, 1.0, 2.0, 0.0],  # p = (1/4, 1/4, 1/2, 0): H = 1.5 ln 2
                      [-1.0, 2.0, 2.0, 0.0],  # negatives clamped: (0, 1/2, 1/2, 0): ln 2
                      [0.0, 0.0, 0.0, 0.0],  # nothing active: 0
                      [3.0, 3.0, 3.0, 3.0]])  # uniform: ln 4
    z = z.T.reshape(1, 4, 2, 2)  # pixel i of the 2 x 2 map is row i above
    h = feature_entropy(z)
    want = torch.tensor([1.5 * math.log(2), math.log(2), 0.0, math.log(4)]).reshape(1, 2, 2)
    assert torch.allclose(h, want, atol=1e-6)
    up = feature_entropy(z, size=(8, 8))
    assert up.shape == (1, 8, 8)
    assert up.min() >= 0 and up.max() <= math.log(4) + 1e-6
