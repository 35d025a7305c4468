"""FederatedData with masks as targets: dtype kept, per-image labels gathered with the samples,
class counts by object class (or by presence without labels)."""

import numpy as np
import torch

from protofl.data.federated import from_partition


def pool():
    """6 masks (4 x 4): image i holds object class label[i] in its centre, void at one
    corner; image 5 holds no object."""
    labels = torch.tensor([1, 2, 1, 3, 2, 0])
    y = torch.zeros(6, 4, 4, dtype=torch.uint8)
    for i, c in enumerate(labels.tolist()):
        y[i, 1:3, 1:3] = c
    y[:, 0, 0] = 255
    x = torch.arange(6, dtype=torch.uint8).reshape(6, 1, 1, 1).expand(6, 3, 4, 4).clone()
    return x, y, labels


def test_masks_and_labels_follow_their_images():
    x, y, labels = pool()
    parts = [np.array([0, 1, 2]), np.array([3, 4, 5])]
    d = from_partition("m", 4, x, y, parts, x[:2], y[:2], 0.34, 0, labels=labels,
                       labels_test=labels[:2])
    assert d.task == "segmentation"
    assert d.y_train.dtype == torch.uint8 and d.y_test.dtype == torch.uint8
    for xs, ys, ls in ((d.x_train, d.y_train, d.labels_train),
                       (d.x_local_test, d.y_local_test, d.labels_local_test)):
        for xi, yi, li in zip(xs, ys, ls):
            i = int(xi[0, 0, 0])  # the image's pool index
            assert torch.equal(yi, y[i]) and int(li) == int(labels[i])
    # images per object class on each client's training split
    want = np.zeros((2, 4), np.int64)
    for k in range(2):
        a, b = d.train_offsets[k], d.train_offsets[k + 1]
        for c in d.labels_train[a:b].tolist():
            want[k, c] += 1
    assert np.array_equal(d.class_counts, want)
    assert d.labels_test.tolist() == [1, 2]


def test_counts_without_labels_are_presence():
    x, y, _ = pool()
    d = from_partition("m", 4, x, y, [np.arange(6)], local_test_fraction=0.0)
    # every mask holds background; classes 1, 2 twice, 3 once; void is not a class
    assert d.class_counts.tolist() == [[6, 2, 2, 1]]
    assert d.labels_train is None
