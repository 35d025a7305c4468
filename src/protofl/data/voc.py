"""Pascal VOC 2012 as the seed's federated split, for classification and partition statistics.

The images whose segmentation mask holds exactly one object class (besides background 0 and
the void border 255) are kept, labelled with that class: the 20 VOC classes, or the seed's
"macro" classes (person, vehicles, household, animals; the seed's fifth macro class,
background, labels no whole image). ``ImageSets/Segmentation/train.txt`` is partitioned with
``dirichlet_powerlaw`` (Dirichlet ``alpha`` class mix, power-law sizes ``gamma``, default 3),
``val.txt`` is the global test set. This reproduces the seed's Pascal split statistics; the
segmentation model (DeepLab-V3+ with a MobileNet encoder) and mIoU are NOT built here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from protofl.config import DataConfig
from protofl.data.federated import FederatedData, from_partition
from protofl.data.images import PIXEL_MAX, ImageRows
from protofl.data.partition import capped, config_partition
from protofl.errors import ProtoflError
from protofl.tasks import VOID

VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
               "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
               "sheep", "sofa", "train", "tvmonitor")  # mask values 1..20
MACRO_CLASSES = ("person", "vehicles", "household", "animals")
MACRO_OF = {
    "person": "person",
    **dict.fromkeys(("aeroplane", "bicycle", "boat", "bus", "car", "motorbike", "train"),
                    "vehicles"),
    **dict.fromkeys(("bottle", "chair", "diningtable", "pottedplant", "sofa", "tvmonitor"),
                    "household"),
    **dict.fromkeys(("bird", "cat", "cow", "dog", "horse", "sheep"), "animals"),
}
VOC_SIZE = 128
VOC_CLIENTS = 50  # our default; set data.num_clients for the seed's client count


def voc_root(root: str | Path) -> Path:
    """The VOC2012 folder: ``root`` itself, ``root/VOC2012`` or ``root/VOCdevkit/VOC2012``."""
    root = Path(root)
    for c in (root, root / "VOC2012", root / "VOCdevkit" / "VOC2012"):
        if (c / "SegmentationClass").is_dir() and (c / "JPEGImages").is_dir():
            return c
    raise ProtoflError(f"no Pascal VOC 2012 folder at {root}: expected JPEGImages/, "
                       "SegmentationClass/ and ImageSets/Segmentation/ (in it, VOC2012/ or "
                       "VOCdevkit/VOC2012/)")


def read_split(base: Path, split: str) -> list[str]:
    return read_list(base / "ImageSets" / "Segmentation" / f"{split}.txt")


def read_list(path: Path) -> list[str]:
    """Image ids of a split list, one per line (duplicates dropped, order kept)."""
    try:
        ids = [s.split()[0] for s in path.read_text().splitlines() if s.strip()]
    except (OSError, UnicodeDecodeError):
        raise ProtoflError(f"Pascal VOC split list {path} cannot be read") from None
    return list(dict.fromkeys(ids))


def read_mask(path: Path, aug: bool) -> np.ndarray:
    """A mask as uint8 (H, W) of class indices: a palette PNG in SegmentationClass, a plain
    8-bit (or palette) PNG in SegmentationClassAug; values must be 0..20 or 255."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            ok = ("P", "L") if aug else ("P",)
            if im.mode not in ok:
                kind = "an 8-bit label" if aug else "a palette (P)"
                raise ProtoflError(f"segmentation mask {path} is a mode-{im.mode} PNG; "
                                   f"expected {kind} PNG of class indices")
            mask = np.asarray(im, dtype=np.uint8)
    except FileNotFoundError:
        raise ProtoflError(f"segmentation mask {path} does not exist") from None
    except ProtoflError:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises many types on a damaged file
        raise ProtoflError(f"segmentation mask {path} cannot be read ({type(e).__name__})"
                           ) from None
    bad = np.setdiff1d(np.unique(mask), np.r_[np.arange(len(VOC_CLASSES) + 1), VOID])
    if len(bad):
        raise ProtoflError(f"segmentation mask {path} holds values {bad.tolist()}; allowed: "
                           "0-20 and 255")
    return mask


def mask_classes(path: Path) -> set[int]:
    """The object classes (1..20) a segmentation mask (palette or 8-bit PNG) contains."""
    return set(np.unique(read_mask(path, aug=True)).tolist()) - {0, VOID}


def single_class_images(base: Path, split: str) -> tuple[list[str], np.ndarray]:
    """(image ids, VOC class index 0..19) of the split's images with exactly one class."""
    ids, labels = [], []
    for image_id in read_split(base, split):
        found = mask_classes(base / "SegmentationClass" / f"{image_id}.png")
        if len(found) == 1:
            ids.append(image_id)
            labels.append(found.pop() - 1)
    return ids, np.asarray(labels, dtype=np.int64)


def _voc(cfg: DataConfig, macro: bool) -> FederatedData:
    base = voc_root(cfg.root)
    (tr_ids, y), (te_ids, y_test) = single_class_images(base, "train"), single_class_images(
        base, "val")
    if not tr_ids or not te_ids:
        raise ProtoflError(f"Pascal VOC at {base}: no single-class image in the "
                           f"{'train' if not tr_ids else 'val'} split")
    keep = capped(len(tr_ids), cfg)
    tr_ids, y = [tr_ids[i] for i in keep], y[keep]
    names: tuple[str, ...] = VOC_CLASSES
    if macro:
        to_macro = np.asarray([MACRO_CLASSES.index(MACRO_OF[c]) for c in VOC_CLASSES])
        y, y_test, names = to_macro[y], to_macro[y_test], MACRO_CLASSES
    size = cfg.image_size or VOC_SIZE
    jpg = base / "JPEGImages"
    x = ImageRows([jpg / f"{i}.jpg" for i in tr_ids], size, "RGB")
    x_test = ImageRows([jpg / f"{i}.jpg" for i in te_ids], size, "RGB")
    parts = config_partition(y, cfg, "dirichlet_powerlaw", VOC_CLIENTS)
    return from_partition("voc_macro" if macro else "voc", len(names), x, torch.from_numpy(y),
                          parts, x_test, torch.from_numpy(y_test), cfg.local_test_fraction,
                          cfg.seed, list(names), scale=PIXEL_MAX)


def voc_federation(cfg: DataConfig) -> FederatedData:
    """Single-class VOC 2012 images, 20 classes (see the module docstring)."""
    return _voc(cfg, macro=False)


def voc_macro_federation(cfg: DataConfig) -> FederatedData:
    """Single-class VOC 2012 images, the seed's macro classes (see the module docstring)."""
    return _voc(cfg, macro=True)
