"""Pascal VOC 2012 loader on a tiny tree in the real layout (palette PNG masks)."""

import numpy as np
import pytest
from voctree import palette_png, write_tree

from protofl.config import DataConfig
from protofl.data.registry import load_dataset
from protofl.data.voc import MACRO_CLASSES, VOC_CLASSES, voc_federation, voc_macro_federation
from protofl.errors import ProtoflError


def write_voc(root):
    """Masks: object classes by id; a void border (255) on every mask. Returns expected
    (train, val) single-class labels in 1..20."""
    masks = {"train": {}, "val": {}}
    expected = {"train": {}, "val": {}}
    for n in range(30):
        image_id = f"2007_{n:06d}"
        split = "train" if n < 22 else "val"
        classes = [1 + n % 20] if n % 5 else [1 + n % 20, 1 + (n + 7) % 20]
        mask = np.zeros((10, 12), np.uint8)
        for j, c in enumerate(classes):
            mask[2 + 3 * j: 5 + 3 * j, 2:8] = c
        mask[0, :] = 255
        masks[split][image_id] = mask
        if len(classes) == 1:
            expected[split][image_id] = classes[0]
    return write_tree(root, masks), expected


def test_voc_single_class_selection(tmp_path):
    base, expected = write_voc(tmp_path)
    data = voc_federation(DataConfig(name="voc", root=str(tmp_path), num_clients=3,
                                     image_size=8))
    assert data.num_classes == 20 and data.class_names == list(VOC_CLASSES)
    assert data.input_shape == (3, 8, 8)
    want_train = sorted(c - 1 for c in expected["train"].values())
    got_train = sorted(data.y_train.tolist() + data.y_local_test.tolist())
    assert got_train == want_train  # ids 0, 5, 10, ... (two classes) dropped
    assert data.y_test.tolist() == [c - 1 for c in expected["val"].values()]
    macro = voc_macro_federation(DataConfig(name="voc_macro", root=str(base), num_clients=3,
                                            image_size=8))
    assert macro.num_classes == 4 and macro.class_names == list(MACRO_CLASSES)
    # independent mapping by hand: person=15, vehicles 1,2,4,6,7,14,19, household 5,9,11,16,
    # 18,20, animals 3,8,10,12,13,17
    groups = {15: 0, **dict.fromkeys((1, 2, 4, 6, 7, 14, 19), 1),
              **dict.fromkeys((5, 9, 11, 16, 18, 20), 2),
              **dict.fromkeys((3, 8, 10, 12, 13, 17), 3)}
    assert macro.y_test.tolist() == [groups[c] for c in expected["val"].values()]
    assert load_dataset(DataConfig(name="voc", root=str(tmp_path), num_clients=3,
                                   image_size=8)).num_clients == 3


def test_voc_bad_mask(tmp_path):
    base, _ = write_voc(tmp_path)
    bad = base / "SegmentationClass" / "2007_000001.png"
    palette_png(bad, np.full((10, 12), 33))
    with pytest.raises(ProtoflError, match="2007_000001.png.*33"):
        voc_federation(DataConfig(name="voc", root=str(tmp_path), num_clients=3))
    bad.write_bytes(b"\x89PNG broken")
    with pytest.raises(ProtoflError, match="2007_000001.png"):
        voc_federation(DataConfig(name="voc", root=str(tmp_path), num_clients=3))
    with pytest.raises(ProtoflError, match="VOC"):
        voc_federation(DataConfig(name="voc", root=str(tmp_path / "none"), num_clients=3))
