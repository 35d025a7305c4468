"""Pascal VOC 2012 segmentation loader on a tiny VOCdevkit tree in the real layout."""

import numpy as np
import pytest
import torch
from PIL import Image
from voctree import palette_png, write_tree

from protofl.config import DataConfig
from protofl.data.registry import dataset_spec, load_dataset
from protofl.data.segmentation import (
    SEG_CLASSES,
    SEG_MACRO_CLASSES,
    alpha_setting,
    voc_seg_federation,
    voc_seg_macro_federation,
)
from protofl.errors import ProtoflError

H, W = 10, 12
# the seed's macro map, written out again: person; vehicles; household; animals
MACRO = {15: 1, **dict.fromkeys((1, 2, 4, 6, 7, 14, 19), 2),
         **dict.fromkeys((5, 9, 11, 16, 18, 20), 3),
         **dict.fromkeys((3, 8, 10, 12, 13, 17), 4)}


def make_mask(classes):
    """Objects as blocks (class id), each outlined by void; void border on every mask."""
    mask = np.zeros((H, W), np.uint8)
    for j, c in enumerate(classes):
        mask[1 + 4 * j: 5 + 4 * j, 2:8] = 255
        mask[2 + 4 * j: 4 + 4 * j, 3:7] = c
    mask[0, :] = 255
    return mask


def write_voc(root, count=36):
    """ids n % 6 == 0 hold two classes (dropped), n % 7 == 0 background only (dropped).
    Returns the VOC2012 folder and the expected {split: {id: class}} of kept images."""
    masks, expected = {"train": {}, "val": {}}, {"train": {}, "val": {}}
    for n in range(count):
        image_id = f"2007_{n:06d}"
        split = "train" if n < 26 else "val"
        if n % 7 == 0:
            classes = []
        elif n % 6 == 0:
            classes = [1 + n % 20, 1 + (n + 7) % 20]
        else:
            classes = [1 + n % 20]
        masks[split][image_id] = make_mask(classes)
        if len(classes) == 1:
            expected[split][image_id] = classes[0]
    return write_tree(root, masks), expected


def cfg(root, **kw):
    return DataConfig(**{"name": "voc_seg", "root": str(root), "num_clients": 3,
                         "image_size": 8, "alpha": 0.1, **kw})


def all_train_labels(data):
    return sorted(data.labels_train.tolist() + data.labels_local_test.tolist())


def test_loader_single_class_filter_and_layout(tmp_path):
    base, expected = write_voc(tmp_path)
    data = voc_seg_federation(cfg(tmp_path))
    assert data.task == "segmentation" and data.num_classes == 21
    assert data.class_names == list(SEG_CLASSES)
    assert {t.dtype for t in (data.x_train, data.y_train, data.x_test, data.y_test)} == {
        torch.uint8}
    assert data.input_shape == (3, 8, 8) and data.y_train.shape[1:] == (8, 8)
    assert all_train_labels(data) == sorted(expected["train"].values())
    assert data.labels_test.tolist() == list(expected["val"].values())
    for masks, labels in ((data.y_train, data.labels_train), (data.y_test, data.labels_test)):
        for m, c in zip(masks, labels):  # one object class, background and void kept
            assert set(m.unique().tolist()) <= {0, 255, int(c)} and (m == c).any()
            assert (m[0] == 255).all()
    # class_counts: images per object class on each client; background column stays 0
    assert data.class_counts.sum() == len(data.y_train) and (data.class_counts[:, 0] == 0).all()
    assert data.num_clients == 3
    assert dataset_spec("voc_seg").task == "segmentation"
    assert load_dataset(cfg(base)).num_clients == 3


def test_macro_map(tmp_path):
    _, expected = write_voc(tmp_path)
    data = voc_seg_macro_federation(cfg(tmp_path))
    assert data.num_classes == 5 and data.class_names == list(SEG_MACRO_CLASSES)
    assert data.labels_test.tolist() == [MACRO[c] for c in expected["val"].values()]
    assert all_train_labels(data) == sorted(MACRO[c] for c in expected["train"].values())
    for m, c in zip(data.y_test, data.labels_test):
        assert set(m.unique().tolist()) <= {0, 255, int(c)}


def test_augmented_masks_and_list(tmp_path):
    base, expected = write_voc(tmp_path)
    aug = base / "SegmentationClassAug"
    aug.mkdir()
    train_ids = list(expected["train"])[:5] + ["2007_000006"]  # the last holds two classes
    for image_id in train_ids:  # plain 8-bit label PNGs; class 20 everywhere
        mask = np.asarray(Image.open(base / "SegmentationClass" / f"{image_id}.png")).copy()
        if image_id != "2007_000006":
            mask[(mask > 0) & (mask < 255)] = 20
        Image.fromarray(mask, mode="L").save(aug / f"{image_id}.png")
    sets = base / "ImageSets" / "Segmentation"
    (sets / "train_aug.txt").write_text("\n".join(train_ids) + "\n")
    data = voc_seg_federation(cfg(tmp_path, num_clients=2))
    assert all_train_labels(data) == [20] * 5  # the aug list and aug masks were used
    assert data.labels_test.tolist() == list(expected["val"].values())  # val from the palette


def test_alpha_settings():
    assert [alpha_setting(n) for n in ("a0.01", "a0.1", "a1")] == [0.01, 0.1, 1.0]
    with pytest.raises(ProtoflError, match="a0.01, a0.1, a1"):
        alpha_setting("a0.5")


@pytest.mark.parametrize("case", ["size", "missing_jpg", "missing_mask", "rgb_mask",
                                  "corrupt_mask", "corrupt_jpg", "bad_value"])
def test_bad_files(tmp_path, case):
    base, _ = write_voc(tmp_path)
    image_id = "2007_000003"
    png = base / "SegmentationClass" / f"{image_id}.png"
    jpg = base / "JPEGImages" / f"{image_id}.jpg"
    if case == "size":
        palette_png(png, np.zeros((H + 2, W), np.uint8))
        name = png.name
    elif case == "missing_jpg":
        jpg.unlink()
        name = jpg.name
    elif case == "missing_mask":
        png.unlink()
        name = png.name
    elif case == "rgb_mask":
        Image.fromarray(np.zeros((H, W, 3), np.uint8)).save(png)
        name = png.name
    elif case == "corrupt_mask":
        png.write_bytes(b"\x89PNG\r\n\x1a\n broken")
        name = png.name
    elif case == "corrupt_jpg":
        jpg.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
        name = jpg.name
    else:
        palette_png(png, np.full((H, W), 33, np.uint8))
        name = png.name
    with pytest.raises(ProtoflError, match=name) as err:
        voc_seg_federation(cfg(tmp_path))
    assert "\n" not in str(err.value)


def test_no_tree(tmp_path):
    with pytest.raises(ProtoflError, match="no Pascal VOC 2012 folder"):
        voc_seg_federation(cfg(tmp_path / "none"))
    with pytest.raises(ProtoflError, match="needs its files"):
        load_dataset(DataConfig(name="voc_seg"))
