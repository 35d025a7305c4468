"""Segmentation metrics of a model over a split, checked against a hand-worked example: the
whole-split confusion matrix, mIoU, pixel accuracy, the image-mean loss and the per-client
figures; the per-pixel task helpers they use."""

import math

import numpy as np
import pytest
import torch

from protofl import tasks
from protofl.metrics import segmentation as seg

# two 2 x 2 masks (3 classes, one void pixel) and the label maps predicted for them
Y = torch.tensor([[[0, 1], [1, 255]], [[2, 2], [0, 1]]], dtype=torch.uint8)
PRED = torch.tensor([[[0, 1], [2, 0]], [[2, 0], [0, 1]]])
LOGITS = 2.0 * torch.nn.functional.one_hot(PRED, 3).permute(0, 3, 1, 2).double()
# per pixel: -log softmax of the logit 2 among (2, 0, 0) when right, of a 0 when wrong
RIGHT, WRONG = math.log(math.exp(2) + 2) - 2, math.log(math.exp(2) + 2)
LOSS = ((2 * RIGHT + WRONG) / 3 + (3 * RIGHT + WRONG) / 4) / 2  # mean over images


@pytest.mark.parametrize("batch", [1, 2, 64])
def test_evaluate_by_hand(batch):
    out = seg.evaluate(lambda v: v, LOGITS, Y, 3, batch, class_names=["bg", "a", "b"])
    # rows true, columns predicted; the void pixel counts nowhere
    assert out["confusion"] == [[2, 0, 0], [0, 2, 1], [1, 0, 1]]
    assert out["iou"] == pytest.approx({"bg": 2 / 3, "a": 2 / 3, "b": 1 / 3})
    assert out["miou"] == pytest.approx(5 / 9)
    assert out["pixel_accuracy"] == out["accuracy"] == pytest.approx(5 / 7)
    assert out["loss"] == pytest.approx(LOSS)
    assert seg.mean_loss(lambda v: v, LOGITS, Y, batch) == pytest.approx(LOSS)


def test_evaluate_applies_inputs_and_an_empty_split_is_empty():
    out = seg.evaluate(lambda v: v, LOGITS / 2, Y, 3, 8, inputs=lambda v: v * 2)
    assert out["loss"] == pytest.approx(LOSS)
    assert seg.evaluate(lambda v: v, LOGITS[:0], Y[:0], 3, 8) == {}


def test_client_figures_by_hand():
    preds = {0: (Y[:1], PRED[:1]), 1: (Y[1:], PRED[1:])}
    out = seg.client_figures(preds, 3, pooled=False)
    # client 0: [[1,0,0],[0,1,1],[0,0,0]] -> IoU 1, 1/2, 0; client 1: IoU 1/2, 1, 1/2
    assert out["client_miou"] == pytest.approx({"0": 0.5, "1": 2 / 3})
    assert out["client_accuracy"] == pytest.approx({"0": 2 / 3, "1": 3 / 4})
    assert out["local_miou"] == pytest.approx(7 / 12)
    assert out["local_accuracy"] == pytest.approx(17 / 24)
    assert "miou" not in out
    pooled = seg.client_figures(preds, 3, pooled=True)
    assert pooled["miou"] == pytest.approx(5 / 9) and pooled["accuracy"] == pytest.approx(5 / 7)
    assert seg.client_figures({}, 3, pooled=False) == {}


def test_rows_per_pass_caps_pixels_of_label_maps(monkeypatch):
    assert tasks.rows_per_pass(torch.zeros(10, dtype=torch.long), 7) == 7
    monkeypatch.setattr(tasks, "DENSE_PIXELS", 100)
    assert tasks.rows_per_pass(torch.zeros(10, 5, 5), 7) == 4
    assert tasks.rows_per_pass(torch.zeros(10, 20, 20), 7) == 1


def test_loss_takes_uint8_masks():
    loss = tasks.per_sample_cross_entropy(LOGITS, Y)
    assert loss.tolist() == pytest.approx([(2 * RIGHT + WRONG) / 3, (3 * RIGHT + WRONG) / 4])
    assert np.allclose(loss.numpy(), tasks.per_sample_cross_entropy(LOGITS, Y.long()).numpy())
